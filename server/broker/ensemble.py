"""Ensembles (``platform: "ensemble"``): a DAG of model steps run by the broker.

The broker is itself a client of the step models: it owns a client segment whose slots workers
complete, and it is woken through its own doorbell. A step is submitted as soon as every tensor
it maps in exists, so independent steps run in parallel on their own workers. Intermediate
tensors stay where the producing worker wrote them (its output arena) and the next step's worker
reads them there: they never pass through a frontend, and no byte is copied between steps. The
final outputs are copied once into the broker's answer (or into the client's regions).

A step that names another ensemble (a nested ensemble) has no workers: it runs here as a run of
its own whose client is the broker's own segment. Its answer lies in the broker's arena like any
ensemble answer, completes the step's slot, and the outer run reads its tensors there and frees
it with the other step answers. Ensembles that reach themselves through their steps are refused
at load (``find_cycle``), so a run never starts runs of itself without end.

A request to an ensemble whose own config enables the response cache is looked up before its
first step (``EnsembleCache``, ensemble_cache.py): a hit is answered from the cache and no step
runs; after a miss, the final outputs are stored before they are answered. This holds for a
nested ensemble's run too, as Triton looks up every request an ensemble is sent.

An ensemble with a decoupled step is decoupled (its config says so, as Triton fills it in): each
response of that step goes on through the later steps in a branch of its own (ensemble_run.py),
and each branch that makes the outputs is one response on the client's stream, written into the
broker's arena and put on the request's response ring as a worker's stream response is. A
response made when no step is left in flight carries the final flag (``LAST_RESPONSE``), as in
Triton; the slot's completion ends the stream after the last (zero responses: the flag alone). A decoupled
step's responses come on a ring in our own segment; ``max_inflight_requests`` bounds each step's
calls in flight (ensemble_plan.py), and while a call made from a response waits for that bound,
the step's later responses stay on its ring, so its model's ``send`` waits once the ring is full.

``EnsemblePlan`` (ensemble_plan.py) is the config's DAG, ``EnsembleRun`` (ensemble_run.py) one
request through it, and ``Ensembles`` the broker's part that runs them.
"""
from __future__ import annotations

import collections
import os
import time
from pathlib import Path
from typing import Any

import posix_ipc

from shmserve.batching import Pending
from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm.answer import (AnswerCorrupt, AnswerDescriptor, ErrorCode, OutputTensor, answer_room, decode_answer,
                                 write_answer)
from shmserve.shm import space
from shmserve.shm.arena import free_block, no_room_text
from shmserve.shm.cache_entry import Output
from shmserve.shm.channel import NOTIFY_BROKER, BrokerSegment, ClientSegment
from shmserve.shm.copying import copy_into
from shmserve.shm.descriptor import SEQUENCE_END, SEQUENCE_START, InputTensor
from shmserve.shm.extents import GrowthRefused, OutputArenas
from shmserve.shm.liveness import BROKER_TICKET
from shmserve.shm.names import object_name
from shmserve.shm.protocol import (CANCELLED_STATUS, EXTENT_SHIFT, LAST_RESPONSE, RECORD, ROLE_BROKER,
                                   ROLE_MASK, SLOT_DONE, SLOT_FREE, SLOT_PENDING, STREAM_CAPACITY, cancelled_error,
                                   no_block_text, role_word)
from shmserve.shm.response_cache import CacheStore
from shmserve.shm.region_io import StaleRegion, output_room_text
from shmserve.shm.ring import Ring, RingCorrupt
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import from_buffer, serialize_bytes
from shmserve.signature import InvalidRequest, ModelSignature
from shmserve.workers.classification import ClassificationError, classify, load_labels, unsupported_type

from .catalog import Catalog
from .clients import Clients
from .ensemble_cache import EnsembleCache
from .ensemble_plan import Step
from .ensemble_run import Branch, EnsembleRun, StepCall
from .ensemble_shapes import converted_shape
from .instances import Instances
from .models import Client, ModelVersion
from .scheduler import Scheduler

OWN_SLOTS = 4096  # ensemble steps in flight at once
OWN_ARENA_BYTES = 1 << 20  # the broker's own client segment: decoupled steps' response rings, tensors stay where they are
RING_POOL = 256  # decoupled steps in flight at once
RING_BYTES = Ring.nbytes(STREAM_CAPACITY, RECORD)
RETRY_S = 0.002  # how soon to look again when responses wait for room on a client's ring,
SLOW_RETRY_S = 0.05  # and once it has taken none for SLOW_READER_S
SLOW_READER_S = 1.0
LABELS_KEPT = 256  # step versions whose labels are kept read (see Ensembles._step_labels)


class Ensembles:
    """Runs ensemble requests: the broker is itself a client of the step models.

    It owns a client segment (``own``) whose slots the step models' workers complete and which
    rings the broker's doorbell, so a step's answer arrives like any worker message. A decoupled
    step's responses come on a ring in that segment (one of ``RING_POOL``, set aside at start).
    """

    def __init__(self, server_id: str, seg: BrokerSegment, answers: OutputArenas, catalog: Catalog, clients: Clients,
                 scheduler: Scheduler, instances: Instances, cache: CacheStore | None) -> None:
        self.seg = seg
        self.answers = answers  # the broker's output arena, which grows (shm/extents.py)
        self.catalog = catalog
        self.clients = clients
        self.scheduler = scheduler
        # a step version's labels by its load (ModelVersion.weights_key), for classifying an
        # ensemble output with no label file of its own; emptied past LABELS_KEPT loads
        self._labels_read: dict[str, dict[str, list[str]]] = {}
        self.instances = instances
        name = object_name(server_id, "client", "broker")
        self.own = Client(name=name, ticket=BROKER_TICKET, pid=os.getpid(),
                          seg=ClientSegment.create(name, OWN_ARENA_BYTES, BROKER_TICKET, slots=OWN_SLOTS,
                                                   notify=NOTIFY_BROKER))
        clients.by_name[name] = self.own  # answered, dropped and closed like any client
        self.free = collections.deque(range(OWN_SLOTS))
        self.inflight: dict[int, StepCall] = {}  # own slot -> the step call it carries
        assert self.own.seg.arena is not None
        pool = self.own.seg.arena.alloc(RING_POOL * RING_BYTES)  # held for the broker's life
        if pool < 0:  # (its pages could not be taken: main says so in one line)
            raise space.NoRoom(f"/dev/shm is full: {name} could not take its {space.mib(RING_POOL * RING_BYTES)} "
                               f"of response rings; {space.HOW_TO_RAISE}")
        self.rings = [pool + i * RING_BYTES for i in range(RING_POOL)]
        self.free_rings = collections.deque(range(RING_POOL))
        self.runs: set[EnsembleRun] = set()
        self.segments = SegmentCache()  # where step outputs and the clients' regions lie
        self.cache = EnsembleCache(cache, self.segments) if cache is not None else None

    # -- the broker's loop ----------------------------------------------------------------------
    def start(self, mv: ModelVersion, client: Client, slot: int, entry: BatchEntry, priority: int = 0) -> None:
        self._begin(EnsembleRun(mv, client, slot, entry, priority))

    def live_runs(self) -> list[EnsembleRun]:
        return list(self.runs)

    def active(self) -> bool:
        return bool(self.runs or self.inflight)

    def has_completions(self) -> bool:
        """A step answered, or a decoupled step's response waits to be taken (not while it is held
        back: its final waits for its responses)."""
        states = self.own.seg.slot_states
        return any(states[slot] == SLOT_DONE if call.ring is None else
                   call.taking() and (states[slot] == SLOT_DONE or call.ring.pending())
                   for slot, call in self.inflight.items())

    def next_timer(self) -> float | None:
        """Responses wait for room on a client's ring: look again soon (less soon once that client
        has not read for a while)."""
        now = time.monotonic()
        waits = [RETRY_S if now - run.full_since < SLOW_READER_S else SLOW_RETRY_S for run in self.runs if run.outbox]
        return min(waits) if waits else None

    def on_completions(self) -> None:
        """Pass on what waits for a client's ring, take the responses of decoupled steps, and
        the answers of finished steps; advance their runs."""
        for run in [r for r in self.runs if r.outbox or r.ending]:
            self._flush(run)
        states = self.own.seg.slot_states
        for slot, call in list(self.inflight.items()):
            if self.inflight.get(slot) is not call:
                continue  # answered meanwhile (its slot may carry another call now)
            if call.ring is not None:
                self._take_responses(call)
                if not call.taking() or call.ring.pending():
                    continue  # its final comes after its responses
            if states[slot] == SLOT_DONE:
                self._on_answer(call)

    def cancel(self, client: Client, slot: int) -> None:
        """The client gave up on its request in ``slot`` (a closed stream, a cancelled call)."""
        for run in list(self.runs):
            if run.client is client and run.slot == slot:
                self._fail_run(run, None, CANCELLED_STATUS, cancelled_error(run.entry.get("id", "")), "CANCELED")
                self._settle(run, run.root)
                return

    def drop_client(self, client: Client) -> None:
        """The client is gone: nobody reads its runs' answers; their steps are cancelled."""
        for run in [r for r in self.runs if r.client is client]:
            self._give_up(run)
            self._settle(run, run.root)

    # -- starting steps -------------------------------------------------------------------------
    def _begin(self, run: EnsembleRun) -> None:
        """Answer from the response cache when the ensemble enables it and holds this request's
        answer, without running a step; otherwise start the steps."""
        if self.cache is not None and self.cache.applies_to(run.version):
            looked_up = time.monotonic_ns()
            run.cache_key = self.cache.key(run.version, run.entry, self.catalog)
            stored = self.cache.lookup(run.cache_key, run.wanted()) if run.cache_key is not None else None
            run.lookup_ns = time.monotonic_ns() - looked_up
            if stored is not None:
                if self._reply(run, stored):
                    run.version.stats.cache_hit(run.entry.get("sent_ns") or 0, looked_up, run.lookup_ns)
                return
            if run.cache_key is not None:  # a miss counts at its lookup, whatever the run's outcome (Triton's)
                run.version.stats.cache_miss(run.lookup_ns)
        self.runs.add(run)
        self._made(run, run.root, set(run.root.tensors), None)

    def _made(self, run: EnsembleRun, branch: Branch, made: set[str], origin: StepCall | None) -> None:
        """``made`` are new in ``branch``: answer if they complete the outputs, start the steps
        they make ready, and end the branch if nothing is left to do in it."""
        self._answer_if_complete(run, branch, made)
        for step in branch.ready_steps(run.plan):
            if run.answered:
                break
            branch.started.add(step.index)
            branch.busy += 1
            call = StepCall(run, branch, step, origin)
            plan = run.plan
            if plan.limit and plan.inflight[step.index] >= plan.limit:
                plan.waiting[step.index].append(call)  # its limit: it waits, in order, for a call to end
                if origin is not None:
                    origin.stalled += 1  # and the responses behind the one that made it wait too
            else:
                self._send(call)
        self._settle(run, branch)

    def _send(self, call: StepCall) -> None:
        """Send a step call to its model (or run it here: a nested ensemble)."""
        run, step = call.run, call.step
        try:
            mv = self.catalog.find_version(step.model, step.version, inference=True)
            assert mv.signature is not None
            request = self._step_request(call, mv.signature)
            # Counted as Triton's core counts a step's inputs: one fed by an absent tensor
            # (ensemble_run.py) reaches the model, which judges it, while the count fits.
            batch = mv.signature.check_inputs([InputTensor(t["name"], t["datatype"], t["shape"], t["size"])
                                               for t in request["inputs"]], request.get("id", ""), counted_only=True)
            call.batch = batch if mv.signature.max_batch_size > 0 else 0
        except InvalidRequest as e:  # in Triton's words, which the ensemble passes on as Triton does
            call.branch.busy -= 1
            self._fail_run(run, None, e.status, f"in ensemble '{run.plan.name}', {e}")
            return
        if not self.free:
            self._unsent(call, 503, "too many ensemble steps in flight; retry later")
            return
        if (mv.config_dict.get("model_transaction_policy") or {}).get("decoupled"):
            if not self.free_rings:
                self._unsent(call, 503, "too many decoupled ensemble steps in flight; retry later")
                return
            call.ring_index = self.free_rings.popleft()
            call.ring = Ring(self.own.seg.seg.buf, self.rings[call.ring_index], STREAM_CAPACITY, RECORD)
            call.ring.reset()
            request["stream"] = {"seg": self.own.name, "off": self.rings[call.ring_index]}
        slot = call.slot = self.free.popleft()
        request.update(client=self.own.name, ticket=BROKER_TICKET, slot=slot)
        self.own.seg.uncancel(slot)
        self.own.seg.set_target(slot, 0)  # (set once a decoupled step's first response names its worker)
        self.own.seg.set_slot_state(slot, SLOT_PENDING)
        self.inflight[slot] = call
        run.calls.add(call)
        run.plan.inflight[step.index] += 1
        if mv.ensemble is not None:
            # A nested ensemble has no instances to queue on: it runs here, and its answer
            # (or error) completes this step's slot in our own segment.
            request["sent_ns"] = call.sent_ns = time.monotonic_ns()
            nested = EnsembleRun(mv, self.own, slot, request, run.priority)
            nested.traced = run.traced  # (every step request carries stamps, for the statistics)
            self._begin(nested)
        else:
            call.sent_ns = request["sent_ns"]
            # Triton passes the client's priority to each step, whose batcher maps it to a level
            self.scheduler.enqueue(mv, Pending(self.own, slot, 0, request, batch, time.monotonic(),
                                               priority=run.priority, timeout_us=request.get("timeout_us", 0)))

    def _unsent(self, call: StepCall, status: int, message: str) -> None:
        """A call that could not be sent fails its run (its branch is settled by the caller)."""
        call.branch.busy -= 1
        self._fail_run(call.run, call.step, status, message)

    def _step_request(self, call: StepCall, signature: ModelSignature) -> BatchEntry:
        """The request a step's model gets: its inputs are ensemble tensors, wherever they live,
        shaped for the model's batching."""
        run, step, branch = call.run, call.step, call.branch
        inputs = []
        batching = signature.max_batch_size > 0
        for model_input, tensor in step.input_map.items():
            t = branch.tensors[tensor]
            if t is None:  # absent (ensemble_run.py): the step runs without this input, as in Triton
                continue
            spec = signature.inputs.get(model_input)
            shape = t["shape"] if spec is None else \
                converted_shape(spec.dims, batching, branch.batch_sizes[tensor], t["shape"])
            inputs.append({**t, "name": model_input, "shape": shape})
        entry = run.entry
        # Timed as a traced request is (its answer's stamps): the step's compute counts in the
        # ensemble's statistics (EnsembleRun.add_compute). Sent now: the step model counts its
        # queue time and duration from here, as Triton counts a step request's.
        now = time.monotonic_ns()
        request: BatchEntry = {
            "id": entry.get("id", ""), "parameters": entry.get("parameters"),
            "sequence_id": entry.get("sequence_id", 0), "sequence_flags": entry.get("sequence_flags", 0),
            "inputs": inputs, "outputs": [{"name": n} for n in step.output_map],
            "sent_ns": now, "trace_queued_ns": now}
        if entry.get("timeout_us"):  # Triton gives each step the client's timeout (request.timeout())
            request["timeout_us"] = entry["timeout_us"]
        return request

    # -- what steps answer ----------------------------------------------------------------------
    def _owner(self, role: int, num: int) -> Any:
        """The segment a step's answer lies in: the broker's (a nested ensemble's), or its worker's."""
        if role & ROLE_MASK == ROLE_BROKER:
            return self.answers.segment(role >> EXTENT_SHIFT)
        return self.instances.answer_segment(num, role, self.segments)

    def _take_responses(self, call: StepCall) -> None:
        """A decoupled step's responses, in order, each through the later steps in a branch of its
        own. Taking stops while a call made from one waits for its step's limit, or while the
        run's responses wait for room on its client's ring: the rest stay on the ring, and the
        model's ``send`` waits once it is full (Triton's backpressure)."""
        run = call.run
        assert call.ring is not None
        while call.taking():
            try:
                record = call.ring.take()
            except RingCorrupt as e:
                call.ring.resync()
                self._fail_run(run, call.step, 500, f"its response ring: {e}")
                continue
            if record is None:
                return
            status, role, off, length, num = record
            call.received += 1
            call.last_taken = bool(role & LAST_RESPONSE)
            if role & ROLE_MASK != ROLE_BROKER and not self.own.seg.target(call.slot):
                # Its worker is known now: should it die, the call fails with it (Supervisor),
                # even after its batch is done and while its model still sends.
                self.own.seg.set_target(call.slot, num + 1)
            owner = self._owner(role, num)
            if owner is None:
                self._fail_run(run, call.step, 500, "the instance that ran this step is gone")
                continue
            if run.answered:
                free_block(owner.buf, off)
                continue
            answer, data_start = _step_answer(owner.buf, off, off + length)
            if status != 200 or answer.error is not None:
                free_block(owner.buf, off)
                self._step_error(run, status, answer)
                continue
            branch = call.branch.child()
            branch.blocks.append((owner.buf, off))
            self._made(run, branch, self._outputs_of(call, branch, owner, answer, data_start), call)

    def _on_answer(self, call: StepCall) -> None:
        """A step call's slot is complete: a plain step's answer, or a decoupled step's final."""
        run, branch = call.run, call.branch
        slot = call.slot
        _, status, role, num, off, length, _ = self.own.seg.read_slot(slot)
        self.own.seg.set_slot_state(slot, SLOT_FREE)
        del self.inflight[slot]
        self.free.append(slot)
        run.calls.discard(call)
        if call.ring is not None:
            self.free_rings.append(call.ring_index)
            call.ring = None
        branch.busy -= 1
        made: set[str] = set()
        owner = self._owner(role, num)
        if owner is None:
            self._fail_run(run, call.step, 500, "the instance that ran this step is gone")
        elif not off:  # answered without a block: its producer had no room even for an error
            self._fail_run(run, call.step, status, no_block_text(length))
        else:
            answer, data_start = _step_answer(owner.buf, off, off + length)
            run.add_compute(answer.trace)
            if run.traced:
                run.add_step_trace(call, answer, time.monotonic_ns())
            if status != 200 or answer.error is not None:
                free_block(owner.buf, off)
                self._step_error(run, status, answer)
            elif answer.final:  # a decoupled step's end: its responses were all taken
                free_block(owner.buf, off)
                if answer.responses != call.received:
                    self._fail_run(run, call.step, 500, f"{answer.responses - call.received} of its responses "
                                   f"were lost (the ensemble stopped taking them for too long)")
            elif run.answered:
                free_block(owner.buf, off)
            else:
                branch.blocks.append((owner.buf, off))
                made = self._outputs_of(call, branch, owner, answer, data_start)
        self._step_ended(call)
        self._made(run, branch, made, call.origin)

    def _outputs_of(self, call: StepCall, branch: Branch, owner: Any, answer: AnswerDescriptor, data_start: int
                    ) -> set[str]:
        """Put a step answer's outputs into ``branch`` as the ensemble tensors they map to."""
        made = set()
        for o in answer.outputs:
            name = call.step.output_map.get(o.name)
            if name and not o.in_region:
                branch.tensors[name] = {"name": name, "datatype": o.datatype, "shape": list(o.shape),
                                        "seg": owner.name, "off": data_start + o.offset, "size": o.size}
                branch.batch_sizes[name] = call.batch
                made.add(name)
        # Triton takes an output the step did not return as absent: made, so that the steps and
        # outputs waiting for it go on without it (it would otherwise wait for good).
        for name in call.step.output_map.values():
            if name not in made:
                branch.tensors[name] = None
                branch.batch_sizes[name] = call.batch
                made.add(name)
        return made

    def _step_ended(self, call: StepCall) -> None:
        """A call of a step is done: the first call waiting for the step's limit goes."""
        plan, index = call.run.plan, call.step.index
        plan.inflight[index] -= 1
        waiting = plan.waiting[index]
        while waiting and plan.inflight[index] < plan.limit:
            nxt = waiting.popleft()
            if nxt.origin is not None:
                nxt.origin.stalled -= 1
            if nxt.run.answered:
                nxt.branch.busy -= 1
            else:
                self._send(nxt)
            if nxt.branch is not call.branch:
                self._settle(nxt.run, nxt.branch)

    # -- answering ------------------------------------------------------------------------------
    def _answer_if_complete(self, run: EnsembleRun, branch: Branch, made: set[str]) -> None:
        """Triton's rule: a branch answers when a tensor just made is a wanted output and every
        wanted output is there. A stream gets each such answer as a response; a single-answer
        request the first, once the run has ended. As in Triton, a stream's response carries the
        final flag when no step is left to run (none is ready in ``branch``, the run is quiet):
        a client that reads until the final flag sees it with the last data, and no empty final
        response follows it (otherwise the run's end sends the flag alone)."""
        wanted = run.wanted()
        if run.answered or not made.intersection(wanted) or not all(n in branch.tensors for n in wanted):
            return
        if not run.streaming:
            if run.answer is None:
                run.answer = branch
            return
        outputs = self._outputs(run, branch)
        if outputs is None:
            return
        self._store(run, outputs)  # (a cached ensemble is never decoupled: its one answer)
        block = self._answer_block(run, outputs)
        if block is not None:
            run.sent += 1
            if run.sent == 1:
                arrived, now = run.entry.get("sent_ns") or 0, time.monotonic_ns()
                run.version.stats.first_response(now - arrived if 0 < arrived <= now else 0)
            if not run.outbox:
                run.full_since = time.monotonic()
            run.outbox.append((200, *block, not branch.ready_steps(run.plan) and run.quiet()))
            self._flush(run)

    def _outputs(self, run: EnsembleRun, branch: Branch) -> list[Output] | None:
        """The wanted outputs of ``branch``, shaped as the ensemble declares them (an absent one
        left out, as Triton leaves it out of the response)."""
        outputs: list[Output] = []
        signature = run.version.signature
        assert signature is not None
        try:
            for name in run.wanted():
                t = branch.tensors[name]
                if t is None:
                    continue
                spec = signature.outputs.get(name)
                shape = t["shape"] if spec is None else \
                    converted_shape(spec.dims, run.plan.batching, branch.batch_sizes[name], t["shape"])
                outputs.append((name, t["datatype"], shape, self._tensor_bytes(t)))
        except (ValueError, OSError, posix_ipc.Error) as e:  # an input in a region its client truncated
            self._fail_run(run, run.plan.steps[-1], 400 if isinstance(e, StaleRegion) else 500, str(e))
            return None
        return outputs

    def _settle(self, run: EnsembleRun, branch: Branch) -> None:
        """End ``branch`` if nothing is left to do in it, then its parents; the run with its root."""
        while not branch.busy and not branch.ended:
            branch.ended = True
            parent = branch.parent
            if parent is None:
                self._end_run(run)
                return
            if branch is run.answer:
                run.kept.extend(branch.blocks)  # read when the run ends
            else:
                for buf, off in branch.blocks:
                    free_block(buf, off)
            branch.blocks.clear()
            parent.busy -= 1
            branch = parent

    def _end_run(self, run: EnsembleRun) -> None:
        """Nothing is left to run: a stream's end, once its responses are on its ring; a
        single answer's outputs (stored in the response cache first, after a miss), or Triton's
        deadlock error when no branch made them. Then what the run holds is freed."""
        if run.ended:
            return
        if run.outbox and not run.answered:
            run.ending = True  # ``_flush`` ends it once they are on the ring
            return
        run.ended, run.ending = True, False
        self.runs.discard(run)
        if not run.answered:
            if run.streaming:
                self._complete(run, AnswerDescriptor(final=True, responses=run.sent, steps=run.traces()))
            elif run.answer is None:
                request_id = run.entry.get("id", "") or "<id_unknown>"
                self._fail_run(run, None, 400, f"in ensemble '{run.plan.name}', [request id: {request_id}] unexpected "
                               f"deadlock, at least one output is not set while no more ensemble steps can be made")
            else:
                self._finish_single(run, run.answer)
        for buf, off in [*run.root.blocks, *run.kept]:
            free_block(buf, off)
        run.root.blocks.clear()
        run.kept.clear()

    def _finish_single(self, run: EnsembleRun, branch: Branch) -> None:
        """Answer a single-answer request with ``branch``'s outputs."""
        outputs = self._outputs(run, branch)
        if outputs is None:
            return
        self._store(run, outputs)
        if self._reply(run, outputs):
            arrived, now = run.entry.get("sent_ns") or 0, time.monotonic_ns()
            run.version.stats.succeed(now - arrived if 0 < arrived <= now else 0, run.batch_size, *run.compute)
            run.version.stats.first_response(now - arrived if 0 < arrived <= now else 0)

    def _store(self, run: EnsembleRun, outputs: list[Output]) -> None:
        """After a cache miss: store the answer under the request's key."""
        if run.cache_key is not None and self.cache is not None:
            inserting = time.monotonic_ns()
            self.cache.insert(run.version, run.cache_key, outputs)
            run.version.stats.cache_inserted(time.monotonic_ns() - inserting)
            run.cache_key = None

    def _client_gone(self, run: EnsembleRun) -> bool:
        """Whether nobody reads the run's answers any more (its client left: its segment is closed)."""
        return run.client is not self.own and self.clients.by_name.get(run.client.name) is not run.client

    def _complete(self, run: EnsembleRun, answer: AnswerDescriptor, status: int = 200) -> None:
        """Complete the client's slot: the run's last word."""
        run.answered = True
        if status == 200 and run.streaming:
            arrived, now = run.entry.get("sent_ns") or 0, time.monotonic_ns()
            run.version.stats.succeed(now - arrived if 0 < arrived <= now else 0, run.batch_size, *run.compute)
        if not self._client_gone(run):
            self.clients.reply(run.client, run.slot, status, answer)

    def _flush(self, run: EnsembleRun) -> None:
        """Put a stream's waiting responses on its client's ring, as far as there is room."""
        if run.answered or self._client_gone(run):
            self._drop_outbox(run)
        else:
            ring = Ring(run.client.seg.seg.buf, run.entry["stream"]["off"], STREAM_CAPACITY, RECORD)
            put = 0
            while run.outbox:
                status, extent, off, length, last = run.outbox[0]
                word = role_word(ROLE_BROKER, extent) | (LAST_RESPONSE if last else 0)
                if not ring.put(status, word, off, length, 0):
                    break
                run.outbox.popleft()
                put += 1
            if put:
                run.client.seg.waker.notify()
                run.full_since = time.monotonic()
        if run.ending and not run.outbox:
            self._end_run(run)

    def _drop_outbox(self, run: EnsembleRun) -> None:
        while run.outbox:
            _, extent, off, _, _ = run.outbox.popleft()
            self.answers.free(extent, off)

    def _give_up(self, run: EnsembleRun) -> None:
        """The run answers nothing more: its steps in flight are cancelled (their models see
        ``is_cancelled()``), those waiting for a step's limit are dropped, and what waits for
        the client's ring is freed."""
        run.answered = True
        for call in run.calls:
            self.own.seg.cancel(call.slot)
        for index, waiting in enumerate(run.plan.waiting):
            mine = [c for c in waiting if c.run is run]
            if mine:
                run.plan.waiting[index] = collections.deque(c for c in waiting if c.run is not run)
                for c in mine:
                    if c.origin is not None:
                        c.origin.stalled -= 1
                    c.branch.busy -= 1
                    self._settle(run, c.branch)
        self._drop_outbox(run)

    def _step_error(self, run: EnsembleRun, status: int, answer: AnswerDescriptor) -> None:
        """A step answered an error: the ensemble answers it as Triton does, the step's text after
        "in ensemble 'E', " and the model's own error code, if it gave one."""
        self._fail_run(run, None, status if status != 200 else 500,
                       f"in ensemble '{run.plan.name}', {answer.error or 'failed'}", code=answer.code)

    def _fail_run(self, run: EnsembleRun, step: Step | None, status: int, message: str,
                  reason: str = "BACKEND", code: ErrorCode | None = None) -> None:
        """Answer the run's error (once) and give up on the rest: a failure the broker saw itself
        is named after the ensemble and the step that failed; a text that says it all (a step's
        own error, a classification refused) comes without a step. What it holds is freed as its
        branches end (the caller settles them)."""
        if run.answered:
            return
        arrived, now = run.entry.get("sent_ns") or 0, time.monotonic_ns()
        run.version.stats.fail(reason, 1, now - arrived if 0 < arrived <= now else 0)  # (its duration, as Triton's)
        text = message if step is None else f"in ensemble '{run.plan.name}', step '{step.model}' failed: {message}"
        self._complete(run, AnswerDescriptor(error=text, code=code, version=run.version.version, steps=run.traces()),
                       status)
        self._give_up(run)

    def _classified(self, run: EnsembleRun, outputs: list[Output]) -> list[Output]:
        """The outputs with those the request asked classification of replaced by their top
        classes, as a model's worker answers them (workers/classification.py), labelled as in
        Triton: by the ensemble's own label file, else by that of the step output it comes from."""
        classes = {o["name"]: o["class"] for o in run.entry.get("outputs") or () if "class" in o}
        if not classes:
            return outputs
        out: list[Output] = []
        for name, datatype, shape, data in outputs:
            if name in classes:
                if datatype == "BYTES":  # refused before its strings are decoded
                    raise unsupported_type(datatype)
                try:
                    arr = from_buffer(memoryview(data), datatype, shape)
                except (ValueError, KeyError, TypeError) as e:  # a shape its bytes do not fill
                    raise ClassificationError(f"output '{name}': {e}") from None
                labels = run.plan.labels.get(name) or self._step_labels(run.version, name)
                top = classify(name, arr, classes[name], run.plan.batching, labels)
                datatype, shape, data = "BYTES", list(top.shape), serialize_bytes(top)
            out.append((name, datatype, shape, data))
        return out

    def _step_labels(self, ensemble: ModelVersion, tensor: str) -> list[str] | None:
        """The labels of the step output that makes ensemble ``tensor`` (nested ensembles
        followed down), read once per load of that step's model."""
        assert ensemble.ensemble is not None
        for step in ensemble.ensemble.steps:
            produced = next((out for out, t in step.output_map.items() if t == tensor), None)
            if produced is None:
                continue
            try:
                mv = self.catalog.find_version(step.model, step.version)
            except InvalidRequest:
                return None
            if mv.ensemble is not None:
                return mv.ensemble.labels.get(produced) or self._step_labels(mv, produced)
            key = mv.weights_key  # (one per load of a version)
            if key not in self._labels_read:
                if len(self._labels_read) >= LABELS_KEPT:
                    self._labels_read.clear()
                try:
                    self._labels_read[key] = load_labels(mv.config_dict, Path(mv.model_dir))
                except ValueError:  # gone since its load read it
                    self._labels_read[key] = {}
            return self._labels_read[key].get(produced)
        return None

    def _tensor_bytes(self, t: dict) -> Any:
        """A tensor's bytes: a view of a step's output in its worker's arena; a copy of an
        ensemble input that lies in a client's region (its client may change or truncate it
        while the steps run: ``shm/region_io.py``)."""
        if "ino" in t:
            return memoryview(self.segments.regions.read(t))
        return self.segments.get(t["seg"]).buf[t["off"]:t["off"] + t["size"]]

    def _reply(self, run: EnsembleRun, outputs: list[Output]) -> bool:
        """Answer a single-answer request with ``outputs`` and complete the client's slot; False
        when the run failed instead (its error answered)."""
        block = self._answer_block(run, outputs)
        if block is None:
            return False
        run.answered = True
        if self._client_gone(run):
            self.answers.free(block[0], block[1])
        else:
            run.client.seg.complete(run.slot, 200, role_word(ROLE_BROKER, block[0]), 0, block[1], block[2])
            run.client.seg.waker.notify()
        return True

    def _answer_block(self, run: EnsembleRun, outputs: list[Output]) -> tuple[int, int, int] | None:
        """Copy the outputs into one answer in the broker's output arena (or into the client's
        regions): its (extent, offset, length); None when the run failed instead (its error answered)."""
        placed = {o["name"]: o for o in run.entry.get("outputs") or () if "seg" in o}
        try:
            outputs = self._classified(run, outputs)
        except ClassificationError as e:
            self._fail_run(run, None, 400, str(e))
            return None
        outs: list[OutputTensor] = []
        chunks, pos = [], 0
        for name, datatype, shape, data in outputs:
            size = len(data)
            target = placed.get(name)
            if target is not None:
                if size > target["size"]:
                    self._fail_run(run, None, 400, output_room_text(name, target["size"], size))
                    return None
                try:
                    if "ino" in target:  # a region (region_io.py: its pages taken, or NoRoom)
                        self.segments.regions.write(target, data)
                    else:  # room the client reserved in its request's block (bounds checked at intake)
                        copy_into(self.segments.get(target["seg"]).buf[target["off"]:target["off"] + size], data)
                except (ValueError, OSError, posix_ipc.Error) as e:  # (/dev/shm full: a 503, as elsewhere)
                    self._fail_run(run, run.plan.steps[-1], 503 if isinstance(e, space.NoRoom) else 400, str(e))
                    return None
                outs.append(OutputTensor(name, datatype, tuple(shape), 0, size, True))
            else:
                outs.append(OutputTensor(name, datatype, tuple(shape), pos, size))
                chunks.append(data)
                pos += size
        steps = () if run.streaming else run.traces()  # (a stream's go with its end, once)
        body = AnswerDescriptor(outs, run.version.version, _sequence_params(run.entry), steps=steps).encode()
        room = answer_room(len(body))
        try:
            extent, off = self.answers.alloc(room + pos, run.client.ticket, run.client.uid)
            refused, status = "", 503
        except GrowthRefused as e:
            extent, off, refused, status = 0, -1, str(e), e.status
        if off < 0:
            why = refused or no_room_text(self.answers.first, "the broker's arena is full")
            self._fail_run(run, None, status, f"no room for the {room + pos}-byte response of ensemble "
                                              f"'{run.plan.name}': {why}")
            return None
        buf = self.answers.buf(extent)
        at = write_answer(buf, off, body)
        for chunk in chunks:
            buf[at:at + len(chunk)] = chunk
            at += len(chunk)
        return extent, off, room + pos


def _sequence_params(entry: Any) -> dict[str, Any]:
    """The parameters of an ensemble's response: Triton's ensemble echoes the request's sequence
    id and flags (and nothing else) in each response it sends."""
    flags = entry.get("sequence_flags", 0)
    return {"sequence_id": entry.get("sequence_id", 0), "sequence_start": bool(flags & SEQUENCE_START),
            "sequence_end": bool(flags & SEQUENCE_END)}


def _step_answer(buf: Any, off: int, end: int) -> tuple[AnswerDescriptor, int]:
    """A step's answer (a worker's block, or a nested ensemble's in our arena), checked: one that
    cannot be read fails the step."""
    try:
        return decode_answer(buf, off, end)
    except AnswerCorrupt as e:
        return AnswerDescriptor(error=f"its answer is unreadable: {e}"), 0
