"""Triton's sequence batcher (``sequence_batching``), run by the broker for one model version.

A sequence is a run of requests sharing a correlation id, from one flagged START to one flagged
END. Each sequence gets a slot on one instance for its whole life (so the instance may keep its
state), up to ``max_batch_size`` sequences per instance (one when the model does not batch); more
sequences wait in a backlog for a slot. Each batch takes at most one request per sequence, and
only requests whose inputs match beyond the batch dimension (ragged inputs aside), as Triton's
sequence batcher enforces equal shapes: the first candidate's shapes rule, and a sequence whose
next request differs waits for a later batch. ``direct`` walks the instance's slots in order and
sends what is there, at once or, with ``minimum_slot_utilization``, once that share of the slots
has a request or the oldest waited ``max_queue_delay_microseconds``; each request goes with its
``slot_index`` (the worker runs it in that row and fills the rows between with null requests,
workers/sequence.py). ``oldest`` keeps
``max_candidate_sequences`` slots per instance (``max_batch_size`` when unset) and batches the
candidates whose next request is oldest first, as Triton's dynamic batcher would: a batch goes
when it reaches a ``preferred_batch_size`` (the largest it can fill; ``max_batch_size`` when none
is configured) or when its oldest request has waited ``max_queue_delay_microseconds``; until
then the scheduler's timer brings the broker back. A sequence silent for
``max_sequence_idle_microseconds`` loses its slot. A request ``timeout`` bounds only the wait in
the backlog, as in Triton (its reaper's backlog expiry): once the earliest deadline among a
backlogged sequence's queued requests passes, they are all refused and the sequence is forgotten;
the slot holder it waited behind keeps its slot. The control inputs (START/END/READY/CORRID) and
implicit state are added by the worker, which owns the state.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from shmserve.batching import Pending
from shmserve.signature import InvalidRequest

from .models import Instance

START, END = 1, 2
DEFAULT_IDLE_S = 1.0  # Triton's default max_sequence_idle_microseconds
LOST_KEPT = 4096  # sequences lost with their instance, remembered to say so


@dataclasses.dataclass
class Sequence:
    corr: Any
    pending: collections.deque = dataclasses.field(default_factory=collections.deque)
    inst: Instance | None = None
    slot: int = -1
    last_seen: float = 0.0
    ending: bool = False  # its last queued request carries END


class SequenceBatcher:
    def __init__(self, config: Any) -> None:
        sb = config.sequence_batching
        self.model = config.name
        self.oldest = sb.HasField("oldest")
        idle_us = sb.max_sequence_idle_microseconds
        self.idle_s = idle_us / 1e6 if idle_us else DEFAULT_IDLE_S
        self.max_batch = max(1, config.max_batch_size)
        self.ragged = frozenset(t.name for t in config.input if t.allow_ragged_batch)
        self.slots_per_instance = self.max_batch
        # How long a batch may wait for more candidates, and what ends the wait: for oldest, the
        # sizes it prefers; for direct, the share of the instance's slots that have a request
        # (whose delay Triton applies only with a share set).
        self.delay_s = 0.0
        self.preferred = [self.max_batch]
        self.min_utilization = 0.0
        if not self.oldest and sb.direct.minimum_slot_utilization > 0:
            self.min_utilization = sb.direct.minimum_slot_utilization
            self.delay_s = sb.direct.max_queue_delay_microseconds / 1e6
        if self.oldest:
            oldest = sb.oldest
            self.slots_per_instance = oldest.max_candidate_sequences or self.max_batch
            self.delay_s = oldest.max_queue_delay_microseconds / 1e6
            self.preferred = sorted({p for p in oldest.preferred_batch_size if 0 < p <= self.max_batch}) \
                or [self.max_batch]
        self.sequences: dict[Any, Sequence] = {}
        self.backlog: collections.deque[Sequence] = collections.deque()
        self.slots: dict[int, list[Sequence | None]] = {}
        self.releases: dict[int, list[Any]] = collections.defaultdict(list)  # inst num -> corr ids to forget
        # Sequences whose instance died (their state with it), so that the refusal of their next
        # request says why; the latest LOST_KEPT of them.
        self.lost: collections.OrderedDict[Any, None] = collections.OrderedDict()

    # -- queueing -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return sum(len(s.pending) for s in self.sequences.values())

    def all(self) -> list[Pending]:
        return [p for s in self.sequences.values() for p in s.pending]

    def enqueue(self, p: Pending, instances: list[Instance], now: float) -> None:
        corr = p.entry.get("sequence_id")
        flags = p.entry.get("sequence_flags", 0)
        if p.batch != 1:  # one request is one step of one sequence (checked first, as Triton does)
            raise InvalidRequest(f"inference request to model '{self.model}' must specify batch-size 1 due to "
                                 f"requirements of sequence batcher")
        if corr in (None, 0, ""):
            raise InvalidRequest(f"inference request to model '{self.model}' must specify a non-zero or "
                                 f"non-empty correlation ID")
        seq = self.sequences.get(corr)
        if flags & START:
            self.lost.pop(corr, None)
            if seq is not None and not seq.pending:
                self._release(seq)  # a new START restarts the sequence
                seq = None
            if seq is None:
                seq = self.sequences[corr] = Sequence(corr)
                self._assign(seq, instances)
        elif seq is None or seq.ending:
            lost = " (the sequence was lost: the instance that held it exited)" if corr in self.lost else ""
            raise InvalidRequest(f"inference request for sequence {corr} to model '{self.model}' must specify "
                                 f"the START flag on the first request of the sequence{lost}")
        if seq.inst is None and p.timeout_us:  # waits in the backlog: its timeout counts (in a slot, none does)
            p.deadline = now + p.timeout_us / 1e6
        seq.pending.append(p)
        seq.last_seen = now
        # Whether its last queued request ends it: a START queued behind an END that has not run
        # yet begins the sequence again in the same slot (the worker resets its state at START).
        seq.ending = bool(flags & END)

    def _assign(self, seq: Sequence, instances: list[Instance]) -> None:
        best, best_free = None, 0
        for inst in instances:
            if not inst.ready:
                continue
            slots = self.slots.setdefault(inst.num, [None] * self.slots_per_instance)
            free = slots.count(None)
            if free > best_free:
                best, best_free = inst, free
        if best is None:
            self.backlog.append(seq)
            return
        slots = self.slots[best.num]
        seq.slot = slots.index(None)
        slots[seq.slot] = seq
        seq.inst = best

    def _release(self, seq: Sequence) -> None:
        self.sequences.pop(seq.corr, None)
        if seq.inst is not None:
            slots = self.slots.get(seq.inst.num)
            if slots is not None and 0 <= seq.slot < len(slots) and slots[seq.slot] is seq:
                slots[seq.slot] = None
            self.releases[seq.inst.num].append(seq.corr)
        elif seq in self.backlog:
            self.backlog.remove(seq)

    def _fill_from_backlog(self, instances: list[Instance]) -> None:
        while self.backlog:
            seq = self.backlog.popleft()
            self._assign(seq, instances)
            if seq.inst is None:  # still no room (_assign queued it at the end): keep its place
                self.backlog.pop()
                self.backlog.appendleft(seq)
                return

    # -- batching -------------------------------------------------------------------------------
    def next_batch(self, inst: Instance, instances: list[Instance], now: float) -> list[Pending] | None:
        """The next requests to send to ``inst``, one per sequence, or None to send nothing now."""
        self._fill_from_backlog(instances)
        slots = self.slots.get(inst.num) or []
        ready = [s for s in slots if s is not None and s.pending]
        if not ready:
            return None
        if self.oldest:
            ready.sort(key=lambda s: s.pending[0].arrived)
        elif self.delay_s and not self._direct_due(len(ready), min(s.pending[0].arrived for s in ready), now):
            return None
        if len(ready) > 1:  # (the backends concatenate a batch's inputs: their shapes must agree)
            key = ready[0].pending[0].shape_key(self.ragged)
            ready = [s for s in ready if s.pending[0].shape_key(self.ragged) == key]
        if self.oldest:
            size = self._oldest_size(len(ready), ready[0].pending[0].arrived, now)
            if not size:
                return None
            ready = ready[:size]
        batch = []
        for seq in ready[:self.max_batch]:
            p = seq.pending.popleft()
            p.entry["slot_index"] = seq.slot
            # Idle from now, not from the request's arrival: one whose START waited in the backlog
            # longer than the idle limit (behind busy slots, or its only instance restarting) was
            # released right after its answer, and its next step refused for a START it had sent.
            # (Triton times idleness from arrival and ends such a sequence so: compatibility.md.)
            seq.last_seen = max(seq.last_seen, now)
            batch.append(p)
            if seq.ending and not seq.pending:
                self._release(seq)
                self.releases[inst.num].remove(seq.corr)  # the worker forgets it on END itself
        return batch

    def _direct_due(self, ready: int, oldest: float, now: float) -> bool:
        """Whether a direct batch goes now: its oldest request waited the delay, or at least
        ``minimum_slot_utilization`` of the instance's slots have a request (Triton's rule)."""
        return now >= oldest + self.delay_s or ready / self.max_batch >= self.min_utilization

    def _oldest_size(self, ready: int, oldest: float, now: float) -> int:
        """How many of ``ready`` candidates to send now (0: wait), by Triton's dynamic batching
        rules: the largest preferred size at once, everything once the oldest waited the delay."""
        target = self.preferred[-1]
        if ready >= target:
            return target
        if not self.delay_s or now >= oldest + self.delay_s:
            return ready
        filled = [p for p in self.preferred if p <= ready]
        return filled[-1] if filled else 0

    def has_work_for(self, inst: Instance) -> bool:
        """Whether ``next_batch`` may find requests for ``inst``: its slots hold some, or
        sequences wait for a slot."""
        return bool(self.backlog) or any(s is not None and s.pending for s in self.slots.get(inst.num, ()))

    def take_releases(self, inst: Instance) -> list[Any]:
        return self.releases.pop(inst.num, [])

    def expire(self, now: float) -> list[Pending]:
        """Free the slots of sequences idle longer than max_sequence_idle_microseconds; take out
        (and return, to be refused) the backlogged requests whose wait timed out."""
        timed_out = self._expire_backlog(now) if self.backlog else []
        for seq in list(self.sequences.values()):
            if not seq.pending and now - seq.last_seen > self.idle_s:
                self._release(seq)
        return timed_out

    def _expire_backlog(self, now: float) -> list[Pending]:
        """Triton keeps a backlog queue per run of a sequence's requests (a START queued behind its
        END begins another) and refuses a whole queue once the earliest deadline in it passed; a
        sequence left with nothing queued is forgotten, so its next step needs START."""
        timed_out: list[Pending] = []
        for seq in list(self.backlog):
            kept: list[Pending] = []
            for run in _backlog_runs(seq.pending):
                due = min((p.deadline for p in run if p.deadline), default=0.0)
                (timed_out if due and due <= now else kept).extend(run)
            if len(kept) == len(seq.pending):
                continue
            seq.pending = collections.deque(kept)
            if kept:
                seq.ending = bool(kept[-1].entry.get("sequence_flags", 0) & END)
            else:
                self._release(seq)
        return timed_out

    def next_timer(self, now: float) -> float | None:
        """Seconds until a sequence may go idle, a backlogged request's timeout ends, or an oldest
        batch's delay ends (one that ended already waits for its instance, whose finish wakes the
        broker)."""
        due = [s.last_seen + self.idle_s for s in self.sequences.values() if not s.pending]
        due.extend(p.deadline for s in self.backlog for p in s.pending if p.deadline)
        if self.delay_s:
            due.extend(t for s in self.sequences.values() if s.pending and s.inst is not None
                       and (t := s.pending[0].arrived + self.delay_s) > now)
        return max(0.0, min(due) - now) if due else None

    def cancel(self, client: Any, slot: int, instances: list[Instance],
               now: float) -> tuple[Pending | None, list[tuple[Pending, InvalidRequest]]]:
        """Take out ``client``'s queued request in ``slot``, cancelled before it ran: as in Triton,
        that ends its sequence (a later request needs START again). The sequence's requests queued
        behind it are queued again as if they came now: one with START begins it afresh, the
        others are returned with their refusal. (None, []): no sequence here queues that slot."""
        seq = next((s for s in self.sequences.values()
                    if any(p.client is client and p.slot == slot for p in s.pending)), None)
        if seq is None:
            return None, []
        cancelled = next(p for p in seq.pending if p.client is client and p.slot == slot)
        behind = [p for p in seq.pending if p is not cancelled]
        seq.pending.clear()
        self._release(seq)
        refused = []
        for p in behind:
            try:
                self.enqueue(p, instances, now)
            except InvalidRequest as e:
                refused.append((p, e))
        return cancelled, refused

    def drop_client(self, client: Any) -> None:
        for seq in self.sequences.values():
            seq.pending = collections.deque(p for p in seq.pending if p.client is not client)

    def forget_instance(self, inst: Instance) -> list[Pending]:
        """An instance died: its sequences (and their state) are gone; return their queued requests."""
        lost = []
        for seq in list(self.sequences.values()):
            if seq.inst is inst:
                lost.extend(seq.pending)
                seq.pending.clear()
                self._release(seq)
                self.lost[seq.corr] = None
                while len(self.lost) > LOST_KEPT:
                    self.lost.popitem(last=False)
        self.slots.pop(inst.num, None)
        self.releases.pop(inst.num, None)
        return lost


def _backlog_runs(pending: collections.deque) -> list[list[Pending]]:
    """A backlogged sequence's queued requests split as Triton's backlog queues: a new one begins
    after each END (the request after it can only be a START)."""
    runs: list[list[Pending]] = []
    after_end = True
    for p in pending:
        if after_end:
            runs.append([])
        runs[-1].append(p)
        after_end = bool(p.entry.get("sequence_flags", 0) & END)
    return runs
