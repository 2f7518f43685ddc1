"""Dynamic batching rules that the broker and a worker both run: the request waiting in a queue
(``Pending``), Triton's dynamic batcher (``dynamic_batching``) for one model version, and when a
worker batches its lanes itself (``batches_on_worker``).

Requests wait in one FIFO queue per priority level. When an instance is free, a batch is formed
from the highest-priority requests whose inputs match beyond the batch dimension, up to
``max_batch_size``; a ragged input (``allow_ragged_batch``) need not match, as in Triton: the
backend concatenates its elements (workers/batch_io.py). It is sent at once when it reaches a
preferred size (the largest one it can fill; ``max_batch_size`` when none is configured), when
the next request would pass ``max_batch_size`` (waiting could add nothing), or when the oldest
request has waited ``max_queue_delay_microseconds``; otherwise the caller sleeps until that
moment. Queue policies (``default_queue_policy``, ``priority_queue_policy``) bound the queues and
time requests out, rejecting them or (``DELAY``) serving them after the requests of their level
and the levels above that did not time out, as Triton's priority queue does (each level keeps its
own delayed requests, behind its others and ahead of lower levels).

The delay is a maximum, not a price every batch pays: when a batch had to wait the whole delay,
its number of requests shows how much traffic one delay gathers. Once as many requests wait
again, the batch goes at once, as waiting longer would gather nothing more. With closed-loop
clients (each waits for its answer before sending again) this removes the delay from every round
trip after the first; a drop in traffic falls back to the full delay and the size adapts.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable

from shmserve.shm.batch_entry import BatchEntry


@dataclasses.dataclass
class Pending:
    """A request waiting in a queue or running in a batch."""

    client: Any  # who gets the answer: the broker's Client, or the ClientSegment of a lane a worker batches
    slot: int
    manifest_off: int
    entry: BatchEntry  # the resolved request, as the worker will read it
    batch: int
    arrived: float
    priority: int = 0
    timeout_us: int = 0
    level: int = 0  # queue index the batcher put it in
    deadline: float = 0.0  # monotonic time its queue timeout ends (0: none)
    delayed: bool = False  # timed out under timeout_action DELAY: served after its level's others
    key: tuple | None = None  # shape_key, computed once (the batcher asks on every look at the queue)

    def shape_key(self, ragged: frozenset[str] = frozenset()) -> tuple:
        """Requests batch together only when every input matches beyond the batch dimension,
        except the ``ragged`` ones, whose shapes may differ (one batcher always passes the same
        set, so the key is computed once)."""
        if self.key is None:
            self.key = tuple((t["name"], t["datatype"], None if t["name"] in ragged else tuple(t["shape"][1:]))
                             for t in self.entry["inputs"])
        return self.key


def waited_ns(pendings: Iterable[Pending], now: float) -> int:
    """How long ``pendings`` were in the server until ``now``, summed: the duration a failure of
    theirs counts in the statistics (``fail.ns``), as Triton counts a failed request's."""
    return sum(max(0, int((now - p.arrived) * 1e9)) for p in pendings)


class QueueFull(Exception):
    status = 503


@dataclasses.dataclass
class QueuePolicy:
    reject_on_timeout: bool = True
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    max_queue_size: int = 0

    @classmethod
    def from_dict(cls, policy: dict[str, Any]) -> "QueuePolicy":
        """A ``ModelQueuePolicy`` in the config's dict form (``shmserve.config_view.to_dict``)."""
        return cls(reject_on_timeout=policy.get("timeout_action", "REJECT") in ("REJECT", 0),
                   default_timeout_us=int(policy.get("default_timeout_microseconds", 0)),
                   allow_timeout_override=bool(policy.get("allow_timeout_override", False)),
                   max_queue_size=int(policy.get("max_queue_size", 0)))


def ragged_inputs(config: dict[str, Any]) -> frozenset[str]:
    """The inputs whose shapes may differ within a batch (``allow_ragged_batch``)."""
    return frozenset(t["name"] for t in config.get("input") or () if t.get("allow_ragged_batch"))


def batches_on_worker(config: dict[str, Any], instances: int) -> bool:
    """Whether the worker batches the requests clients put on its lanes itself: dynamic batching
    with a single instance, where the broker would only add a hop and a wake-up per request (it
    still batches what reaches it: requests of clients without a lane, ensemble steps).

    Not when a queue policy bounds the queue or times requests out: a worker reads its lanes only
    between batches, and such a refusal is due at once, as Triton's scheduler thread gives it
    while a batch runs; the broker's scheduler does."""
    db = config.get("dynamic_batching")
    return instances == 1 and db is not None and not _policed(db) \
        and config.get("sequence_batching") is None and int(config.get("max_batch_size", 0)) > 0


def _policed(db: dict[str, Any]) -> bool:
    """Whether a queue policy of ``dynamic_batching`` refuses requests (``max_queue_size``) or
    times them out (``default_timeout_microseconds``)."""
    policies = [db.get("default_queue_policy") or {}, *(db.get("priority_queue_policy") or {}).values()]
    return any(int(p.get("max_queue_size", 0)) or int(p.get("default_timeout_microseconds", 0)) for p in policies)


class DynamicBatcher:
    """Takes the model config in its dict form (``shmserve.config_view.to_dict``), which both the broker and the
    workers hold."""

    def __init__(self, config: dict[str, Any]) -> None:
        db = config.get("dynamic_batching") or {}
        self.max_batch_size: int = int(config.get("max_batch_size", 0))
        self.ragged = ragged_inputs(config)
        # max_batch_size 0: the queue's order and policies still apply; each execution takes one
        # request at once (Triton's, checked side by side).
        self.delay_s = int(db.get("max_queue_delay_microseconds", 0)) / 1e6 if self.max_batch_size else 0.0
        preferred = sorted(int(p) for p in db.get("preferred_batch_size", ()) if 0 < int(p) <= self.max_batch_size)
        self.preferred = preferred or [self.max_batch_size]
        self.preserve_ordering = bool(db.get("preserve_ordering", False))
        self.levels = max(1, int(db.get("priority_levels", 0)))
        default_level = int(db.get("default_priority_level", 0)) if int(db.get("priority_levels", 0)) else 1
        self.default_level = min(max(default_level, 1), self.levels)
        default_policy = QueuePolicy.from_dict(db["default_queue_policy"]) if db.get("default_queue_policy") \
            is not None else QueuePolicy()
        self.policies = [default_policy] * self.levels
        for level, policy in (db.get("priority_queue_policy") or {}).items():
            if 1 <= int(level) <= self.levels:
                self.policies[int(level) - 1] = QueuePolicy.from_dict(policy)
        self.queues: list[collections.deque[Pending]] = [collections.deque() for _ in range(self.levels)]
        # Whether any request can carry a queue timeout (otherwise no deadline needs looking at).
        self.timed = any(p.default_timeout_us for p in self.policies)
        # per level: its requests that timed out under DELAY, served after the level's others
        self.delayed: list[collections.deque[Pending]] = [collections.deque() for _ in range(self.levels)]
        self.size = 0
        self.gathered = 0  # requests in the last batch that waited the whole delay (0: none yet)

    def __len__(self) -> int:
        return self.size

    def all(self) -> list[Pending]:
        return self._ordered()

    def enqueue(self, p: Pending, now: float) -> None:
        level = p.priority if 1 <= p.priority <= self.levels else self.default_level
        policy = self.policies[level - 1]
        queue = self.queues[level - 1]
        # (a level's delayed requests still wait in it: Triton's PolicyQueue counts them in its size)
        if policy.max_queue_size and len(queue) + len(self.delayed[level - 1]) >= policy.max_queue_size:
            raise QueueFull("Exceeds maximum queue size")  # (Triton's words, which clients match)
        timeout = policy.default_timeout_us
        if policy.allow_timeout_override and p.timeout_us and timeout:
            # A request may shorten a default timeout, never lengthen it nor set one where the
            # default is none (Triton's rule: a default of 0 is no timeout, whatever is asked).
            timeout = min(timeout, p.timeout_us)
        p.level = level
        p.deadline = now + timeout / 1e6 if timeout else 0.0
        queue.append(p)
        self.size += 1

    def drop_client(self, client: Any) -> None:
        """Forget the queued requests of a client that went away."""
        for i, q in enumerate(self.queues):
            self.queues[i] = collections.deque(p for p in q if p.client is not client)
        for i, q in enumerate(self.delayed):
            self.delayed[i] = collections.deque(p for p in q if p.client is not client)
        self.size = sum(len(q) for q in self.queues) + sum(len(q) for q in self.delayed)

    def take_out(self, client: Any, slot: int) -> Pending | None:
        """Remove and return the queued request in ``client``'s ``slot`` (a cancelled one)."""
        for p in self.all():
            if p.client is client and p.slot == slot:
                self._remove(p)
                return p
        return None

    def expire(self, now: float) -> list[Pending]:
        """Requests whose queue timeout passed: REJECT ones are returned (to fail), DELAY ones move
        behind everything else."""
        rejected: list[Pending] = []
        if not self.timed:
            return rejected  # no request here can carry a deadline
        for level, queue in enumerate(self.queues):
            if not any(p.deadline and p.deadline <= now for p in queue):
                continue
            keep: collections.deque[Pending] = collections.deque()
            for p in queue:
                if p.deadline and p.deadline <= now:
                    if self.policies[level].reject_on_timeout:
                        rejected.append(p)
                        self.size -= 1
                    else:
                        p.deadline = 0.0
                        p.delayed = True
                        self.delayed[level].append(p)
                else:
                    keep.append(p)
            self.queues[level] = keep
        return rejected

    def _ordered(self) -> list[Pending]:
        out: list[Pending] = []
        for q, delayed in zip(self.queues, self.delayed):
            out.extend(q)
            out.extend(delayed)
        return out

    def next_batch(self, now: float) -> list[Pending] | None:
        """The batch to send to a free instance now, or None to keep waiting (see ``next_timer``)."""
        if not self.size:
            return None
        candidates = self._ordered()
        first = candidates[0]
        if not self.max_batch_size:
            self._remove(first)
            return [first]
        key = first.shape_key(self.ragged)
        chosen: list[Pending] = []
        total = 0
        filled = 0  # requests in ``chosen`` when they last added up to a preferred size
        full = False  # the next request would pass max_batch_size: this batch cannot grow
        target = self.preferred[-1]
        for p in candidates:
            if p is not first and p.shape_key(self.ragged) != key:
                continue  # (another shape never limits this batch)
            if total + p.batch > self.max_batch_size:
                full = True
                break
            chosen.append(p)
            total += p.batch
            if total in self.preferred:
                filled = len(chosen)
            if total >= target:
                break
        oldest = min(p.arrived for p in chosen)
        waited_out = now >= oldest + self.delay_s
        everyone = self.gathered > 1 and len(chosen) >= self.gathered  # what one delay gathers is here
        if total < target and total not in self.preferred and not (waited_out or everyone or full or filled):
            return None  # wait for more, until the oldest has waited the configured delay
        if waited_out and total < target and total not in self.preferred:
            self.gathered = len(chosen)
        if not waited_out and total not in self.preferred:
            # Before the delay ends, send the largest preferred size the batch can fill, else
            # stop short of the request that passed the largest one (unless it is alone), as
            # Triton does; never an empty batch.
            if filled:
                chosen = chosen[:filled]
            elif total > target and len(chosen) > 1:
                chosen = chosen[:-1]
        for p in chosen:
            self._remove(p)
        return chosen

    def _remove(self, p: Pending) -> None:
        if p.delayed:
            self.delayed[p.level - 1].remove(p)
        else:
            self.queues[p.level - 1].remove(p)
        self.size -= 1

    def next_timer(self, now: float, looked: float = 0.0) -> float | None:
        """Seconds until the batcher must act without being woken: a delay or a timeout ends.
        What was due by ``looked`` (when the caller last asked for a batch, and could not send it
        for want of a free instance) waits for an instance to finish, which wakes the caller: a
        timer for it would only spin."""
        if not self.size:
            return None
        # Each level's queue is in arrival order, so its oldest is its first; the broker asks on
        # every pump, so no list of everything queued is built here.
        arrivals = [q[0].arrived for q in self.queues if q]
        arrivals.extend(p.arrived for q in self.delayed for p in q)
        times = [min(arrivals) + self.delay_s] if arrivals else []
        if self.timed:
            times.extend(p.deadline for q in self.queues for p in q if p.deadline)
        times = [t for t in times if t > looked]
        return max(0.0, min(times) - now) if times else None
