"""The worker process: one instance of one model version, fed through its shared-memory inbox
and its clients' lanes.

The loop sleeps on its semaphore (or polls a moment, see ``serve``), takes batch entries the
broker wrote and requests clients put straight on their lanes (checked in requests.py), builds
numpy views of the inputs over the clients' shared memory, runs the backend, writes each answer
into its own arena or the region the client named (answers.py), completes the clients' slots and
tells the broker the instance is free, ringing the broker only if it waits.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import orjson
import posix_ipc

from shmserve.batching import DynamicBatcher, Pending, batches_on_worker
from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm import liveness, logs, truncation_guard
from shmserve.shm.access import server_readers
from shmserve.shm.answer import NO_VERSION, AnswerDescriptor
from shmserve.shm.arena import Arena, free_block
from shmserve.shm.channel import MESSAGES_BYTES, REGION_HOLDS_BYTES, BrokerSegment, ClientSegment, WorkerSegment
from shmserve.shm.extents import worker_arenas
from shmserve.shm.names import object_name, pid_alive
from shmserve.shm.protocol import CANCELLED_STATUS, REQ_POLLING, W_BATCH, W_CONFIG, W_DONE, W_LOAD_FAILED, W_READY, \
    W_CHECK_READY, W_MORE, W_STOP, cancelled_error, read_manifest
from shmserve.shm.region_table import RegionTable
from shmserve.shm.tensors import BytesFraming
from shmserve.shm.truncation_guard import Repairs
from shmserve.shm.ring import RingCorrupt
from shmserve.shm.untrusted import LANE_KINDS, Fault, Garbage, Record, check_record, read_request
from shmserve.shm.segment import SegmentCache
from shmserve.shm.stats import ARENA_BYTES, BUSY_SINCE, DIRECT_DONE, DIRECT_TAKEN, EXECUTING, StatsWriter
from shmserve.shm.waker import READ_ONLY_WAKE_BOUND_S, SpinPolicy, fence

from . import custom_metrics
from .answers import Answers, ModelInfo
from .backend import Backend, CancelFlag, Instance, InstanceContext, Model, ModelContext, Request, Response, \
    ModelLoadError, load_backend
from .classification import load_labels
from .late_answers import CANCEL_CHECK_S, Deferred, Kept, LateAnswers
from . import cuda
from .cuda import CudaError
from .input_views import InputViews
from .readiness import ReadinessCheck
from .region_holds import RegionHolds
from .requests import DecoupledOnly, RequestError, check_request, read_inputs
from .reshape import Reshapes
from .response_cache import ResponseCache
from .sequence import SequenceSupport
from shmserve.signature import InvalidRequest, ModelSignature, request_tag
from .stream import StreamSender
from .warmup import run_warmup

log = logging.getLogger("shmserve.worker")
LANE_WARNING_EVERY_S = 10.0  # the least time between two warnings about one lane (Worker._lane_warning)


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.server_id: str = spec["server_id"]
        self.num: int = spec["num"]
        self.model: str = spec["model"]
        self.version: int = spec["version"]
        self.instance_name: str = spec["instance_name"]
        self.broker_pid: int = spec["broker_pid"]
        self.poll_s: float = spec["poll_us"] / 1e6  # --poll-us
        self.seg = WorkerSegment.attach(object_name(self.server_id, "worker", self.num), readers=server_readers())
        self.seg.restamp_lanes()  # (a lanes object its user truncated before we mapped it was grown back bare)
        self.seg.set_pid(os.getpid())
        self.stats = StatsWriter(self.seg.stats, spec.get("latency_buckets"))
        self.signature: ModelSignature | None = None
        self.output_names: list[str] = []
        self.sequence: SequenceSupport | None = None
        self.decoupled = False
        self.stream_lock = threading.Lock()  # streams finish on the model's threads: their counting
        self.arena = Arena(self.seg.seg.buf, self.seg.arena_offset, self.seg.arena_size, self.seg.seg.populate)
        self.messages = self.seg.messages()
        self.broker = BrokerSegment.attach(self.server_id)
        liveness.watch(self.server_id)  # whether clients live: their tickets, not pids (another namespace)
        self.regions = RegionTable(self.broker.regions)  # for requests naming regions on direct lanes
        # The regions its lane requests use, published so that the broker can defer unregisters.
        self.holds = RegionHolds(self.regions, self.seg.region_holds, REGION_HOLDS_BYTES)
        self._lane_names: dict[int, tuple[str, int]] = {}
        self._refused: set[int] = set()  # cookies of lane holders that wrote garbage (the broker disconnects them)
        self._lane_warned: dict[int, float] = {}  # lane -> when a warning about it was last logged
        self._lane_writers = len(server_readers())  # the other users whose clients may write lanes of theirs
        self.segments = SegmentCache()
        self.clients: dict[str, ClientSegment] = {}
        # Answers go to the arena's first extent (``self.arena``, which also carries messages to
        # the broker) and to extents it grows into, up to the cap (shm/extents.py).
        arenas = worker_arenas(self.arena, self.seg, self.server_id, self.num, spec.get("arena_cap", 0) or
                               self.seg.arena_size, spec.get("arena_growth", 0), self.instance_name)
        self.answers = Answers(self.num, ModelInfo(self.version, self.instance_name), arenas, self.segments,
                               self.broker.waker)
        self.backend: Backend | None = None
        self.model_state: Model | None = None
        self.instance: Instance | None = None
        self.input_views: InputViews | None = None  # large inputs as copy-on-write views (input_views.py)
        self.reshapes: Reshapes | None = None  # the config's ``reshape``s, when the backend leaves them to us
        self.readiness: ReadinessCheck | None = None  # the model's is_ready(), if it has one
        self.running = True
        # Requests from our lanes waiting for a batch, when this instance batches them itself.
        self.batcher: DynamicBatcher | None = None
        self.cache: ResponseCache | None = None  # the server's response cache, if this model uses it
        self.late = LateAnswers(self.seg.waker)  # requests a model answers after execute returned
        self._late_checked = 0.0  # when kept requests were last checked for cancellation

    # -- start-up -------------------------------------------------------------------------------
    def load(self) -> None:
        spec = self.spec
        ctx = ModelContext(name=self.model, version=self.version, model_dir=Path(spec["model_dir"]),
                           config=spec["config"], strict_config=spec.get("strict", False),
                           server_id=self.server_id, weights_key=spec.get("weights_key", ""),
                           default_max_batch_size=spec.get("default_max_batch_size", 4))
        try:
            custom_metrics.REGISTRY.attach(self.seg.custom_metrics)
            self.backend = load_backend(spec["backend"])
            if not ctx.strict_config:
                ctx.config = self.backend.auto_complete_config(ctx)
                self._post(W_CONFIG, 0, orjson.dumps(ctx.config))
            self.model_state = self.backend.create_model(ctx)
            ictx = InstanceContext(name=self.instance_name, index=spec["instance_index"], kind=spec["kind"],
                                   device_id=spec.get("device_id", 0))
            self.instance = self.model_state.create_instance(ictx)
            if self.instance.writable_inputs:
                self.input_views = InputViews.open(self.segments)
            self.signature = ModelSignature(self.model, ctx.config)
            self.output_names = list(self.signature.outputs)
            if ctx.config.get("sequence_batching"):
                self.sequence = SequenceSupport(ctx.config, ctx.model_dir)
            if batches_on_worker(ctx.config, spec.get("instances", 0)):  # the broker decides alike
                self.batcher = DynamicBatcher(ctx.config)
            self.decoupled = bool((ctx.config.get("model_transaction_policy") or {}).get("decoupled"))
            self.cache = ResponseCache.open(spec, ctx.config, self.segments)
            reshapes = Reshapes(ctx.config)
            self.reshapes = reshapes if reshapes and not self.instance.reshapes_itself else None
            self.answers.model = ModelInfo(self.version, self.instance_name, self.signature.max_batch_size > 0,
                                           self.decoupled, load_labels(ctx.config, ctx.model_dir),
                                           self.reshapes, frozenset(self.output_names))
            if ctx.config.get("model_warmup"):
                runs = run_warmup(self.instance, ctx.config, ctx.model_dir, self.signature, self.instance_name)
                log.info("warm-up done: %d execution(s)", runs)
        except BaseException as e:  # noqa: BLE001 - any failure of user code is a load failure
            refused = isinstance(e, ModelLoadError)  # (its text says it all: no class name, no traceback)
            detail = str(e) if refused else "".join(traceback.format_exception_only(type(e), e)).strip()
            log.error("failed to load '%s' version %d: %s%s", self.model, self.version, detail,
                      "" if refused else "\n" + traceback.format_exc())
            self._post(W_LOAD_FAILED, 0, detail.encode()[:64 << 10])
            raise SystemExit(3) from None
        custom_metrics.REGISTRY.flush()  # families the model made in initialize() show before its first request
        check = self.instance.readiness_check()
        self.readiness = ReadinessCheck(self.seg, check, self.instance_name) if check is not None else None
        self._post(W_READY, 0, b"")

    def _post(self, kind: int, status: int, payload: bytes) -> None:
        """A message to the broker, its payload in the control object (no client can rewrite it
        there), in parts of at most a quarter of that room (a config may be any size: each part
        waits for the broker to have taken the ones before); start-up messages always ring its
        doorbell."""
        part = MESSAGES_BYTES // 4
        pieces = [payload[i:i + part] for i in range(0, len(payload), part)] or [b""]
        for i, piece in enumerate(pieces):
            self._post_part(kind if i == len(pieces) - 1 else W_MORE, status, piece)

    def _post_part(self, kind: int, status: int, piece: bytes) -> None:
        off = 0
        if piece:
            deadline = time.monotonic() + 60.0
            while (off := self.messages.alloc(len(piece))) < 0:
                if time.monotonic() > deadline or not pid_alive(self.broker_pid):
                    raise RuntimeError("the broker takes no more of this worker's messages")
                self.broker.waker.notify()
                time.sleep(0.001)
            assert self.seg.control is not None
            self.seg.control.buf[off:off + len(piece)] = piece
        while not self.seg.outbox.put(kind, status, off, len(piece), 0):
            time.sleep(0.001)
        self.broker.waker.notify()

    # -- serving --------------------------------------------------------------------------------
    def serve(self) -> None:
        """The loop. After a round that served a client polling for its answers (its requests
        carry REQ_POLLING), the worker polls for that client's next request for up to --poll-us
        before it sleeps, while such polls pay and a core is idle (SpinPolicy): a closed loop of
        quick calls then crosses no sleep in either direction, and a busy host is not polled on."""
        seg = self.seg
        inbox = seg.inbox
        late = self.late
        has_work = lambda: inbox.pending() > 0 or seg.bells_rung() or late.has_finished()  # noqa: E731
        batcher = self.batcher
        checked = time.monotonic()
        departures = int(self.broker.departures[0])
        log_settings = logs.Follower(self.broker.settings)
        spin = SpinPolicy(self.poll_s)
        polled = False  # the last round served a client that polls for its answers
        repairs = Repairs()  # truncations of what it maps undone (shm/truncation_guard.py)
        check_every = 10.0  # (each second while a page replaced for want of room waits: truncation_guard.py)
        regions_seen = -1  # the region table's generation when we last let go of unregistered regions
        while self.running:
            # Long sleeps: the kernel signals us if the broker dies (PR_SET_PDEATHSIG); the check
            # below only covers systems without it.
            timeout = check_every if not self._lane_writers else min(check_every, READ_ONLY_WAKE_BOUND_S)
            if batcher is not None and len(batcher):
                timeout = min(timeout, batcher.next_timer(time.monotonic()) or 0.0)
            if late:
                timeout = min(timeout, CANCEL_CHECK_S)
            seg.waker.sleep(timeout, has_work, spin if polled else None)
            log_settings.check()  # POST /v2/logging: one integer read unless it changed
            if self.regions.current() != regions_seen:
                regions_seen = self.regions.current()
                self._close_unregistered_regions()
            if int(self.broker.departures[0]) != departures:
                departures = int(self.broker.departures[0])
                self._forget_departed_clients()
                seg.ring_pending_bells()  # a client killed between its put and its bell
            if time.monotonic() - checked > check_every:
                checked = time.monotonic()
                if undone := repairs.since_last():
                    log.warning("shared memory this worker maps was truncated by a client: %s (a local client of "
                                "a --local-client-users user may write these objects)", "; ".join(undone))
                    seg.restamp_lanes()  # (a user's lanes object grown back: its clients map it by its header)
                check_every = 1.0 if truncation_guard.waiting() else 10.0
                self.stats.counts[ARENA_BYTES] = self.answers.arena.in_use_now()  # (idle: what clients read is back)
                self.stats.flush()
                self._forget_departed_clients()
                seg.ring_pending_bells()  # (after the repairs: a page put back may hold records it missed)
                if not pid_alive(self.broker_pid):
                    log.error("broker %d is gone; worker exits", self.broker_pid)
                    return
            for kind, _, off, _, batch_id in inbox.drain():
                if kind == W_STOP:
                    self.running = False  # answer what is already on the lanes, then go
                    seg.ring_pending_bells()  # (other users' lanes too, which the broker did not wait for)
                elif kind == W_BATCH:
                    self._run_batch(off, batch_id)
                elif kind == W_CHECK_READY and self.readiness is not None:
                    self.readiness.ask()  # its own thread runs is_ready(): never in this loop
            lanes = seg.take_rung_lanes()
            if lanes:
                polled = False
                for lane in lanes:
                    polled = self._serve_lane(lane) or polled
            ran = bool(lanes)
            if batcher is not None and len(batcher):
                ran = self._run_local_batches(batcher, time.monotonic() if self.running else math.inf) > 0 or ran
            if late or late.has_finished():  # (also sends that came after their request was answered)
                ran = self._answer_late() or ran
            if ran:
                # Once per round: counters first, then the round's answers with one wake-up per
                # client (a round of several executions sends each one's answers before the next
                # runs: _execute).
                self._flush_counts()

    def _close_unregistered_regions(self) -> None:
        """Close the files and mappings of regions the clients unregistered (the broker's table
        lists those still registered), so their memory (/dev/shm, the device's) is not held here."""
        registered = self.regions.registered()
        if registered is not None:
            self.segments.regions.keep_only(registered)
        if cuda.loaded():
            closed = cuda.runtime().close_unlisted(self.regions.cuda_handles())
            if closed:
                log.debug("closed %d CUDA IPC mapping(s) of unregistered regions", closed)

    def _serve_lane(self, lane: int) -> bool:
        """Take the requests on one lane, each record checked before use (shm/untrusted.py);
        True if one asks us to poll (REQ_POLLING). Records of a holder that left, or that wrote
        garbage, are dropped; every record taken off counts in DIRECT_TAKEN, and in DIRECT_DONE
        once it is done (the broker's count of what is left on the lanes)."""
        counts = self.stats.counts
        ring = self.seg.lanes[lane]
        assert ring is not None  # (a worker maps every user's lanes)
        name, cookie = self._lane_holder(lane)
        try:
            raws = ring.drain()
        except RingCorrupt as e:
            ring.resync()  # (what lay there is skipped: neither taken nor done)
            self._garbage(lane, name, cookie, Garbage(Fault.RING, str(e)))
            return False
        counts[DIRECT_TAKEN] += len(raws)
        self.stats.publish(DIRECT_TAKEN)
        polled = False
        dropped = unbound = 0
        taken: list[tuple[ClientSegment, Record]] = []
        # Every record is checked and its slot taken before the first one runs: a model that does
        # not batch runs each in turn, and the client of one still waiting behind a long execution
        # must see it taken (else, finding it untaken with the lane empty, it puts it again).
        for raw in raws:
            if raw[4] != cookie or not name or cookie in self._refused or self.broker.lane_cookie(lane) != cookie:
                dropped += 1
                counts[DIRECT_DONE] += 1
                continue
            try:
                client = self._client(name)
            except (posix_ipc.Error, OSError, ValueError) as e:  # (gone, or a client put something else there)
                log.warning("slot %d of client %s not answered: its segment cannot be mapped (%s)", raw[1], name, e)
                counts[DIRECT_DONE] += 1
                continue
            try:
                rec = check_record(client.layout, raw, LANE_KINDS)
            except Garbage as e:
                self._garbage(lane, name, cookie, e, client, raw[1])
                counts[DIRECT_DONE] += 1
                continue
            if not client.take_bound(rec.slot, rec.off, rec.length, self.num):
                unbound += 1  # not its client's pending request to us, or taken already: replayed or forged
                counts[DIRECT_DONE] += 1
                continue
            taken.append((client, rec))
        for client, rec in taken:
            # Looked up again for each record: a holder that left (died, or was refused) while we
            # ran its earlier requests gets nothing more run (its cookie changed).
            if cookie in self._refused or self.broker.lane_cookie(lane) != cookie:
                dropped += 1
                counts[DIRECT_DONE] += 1
                continue
            polled = polled or bool(rec.flags & REQ_POLLING)
            if not self._take_request(lane, cookie, name, client, rec):
                counts[DIRECT_DONE] += 1
            # (else queued for a batch: counted when it runs)
        if unbound:
            # Every process of the holder's user may write its lanes: a record its holder's slots
            # do not bind is such a process's, or a repeat, and nobody waits for it.
            self._lane_warning(lane, "lane %d: dropped %d record(s) that name no request of its client %s waiting "
                                     "for this worker (repeated, or written by another process of its user)",
                               lane, unbound, name)
        if dropped and cookie not in self._refused:
            # Records of a client that left (its lane was given to another, or to no one): nobody
            # waits for them. Said, since a live client's lost request would hang its caller.
            self._lane_warning(lane, "lane %d: dropped %d record(s) of a client that left (the lane's holder: %r, "
                                     "cookie %d)", lane, dropped, name, cookie)
        return polled

    def _lane_warning(self, lane: int, text: str, *args: Any) -> None:
        """A warning about what lies on ``lane``, at most one a lane each LANE_WARNING_EVERY_S:
        a process writing there what no client writes, and ringing its bell, would flood the log
        with one a ring."""
        now = time.monotonic()
        if now - self._lane_warned.get(lane, -LANE_WARNING_EVERY_S) >= LANE_WARNING_EVERY_S:
            self._lane_warned[lane] = now
            log.warning(text, *args)

    def _garbage(self, lane: int, name: str, cookie: int, e: Garbage, client: ClientSegment | None = None,
                 slot: int | None = None) -> None:
        """The holder of ``lane`` wrote garbage there: the record is dropped, its request failed
        if its slot is a real one, and the broker is told (it disconnects the client); its later
        records are dropped unread."""
        if client is not None and slot is not None and slot < client.nslots:
            self._answer_error({"client": name, "ticket": client.ticket, "slot": slot}, 400,
                               f"the server disconnected this client: {e}", refused=True)
        if cookie in self._refused:
            return
        if not name:
            self._lane_warning(lane, "lane %d, which no client holds, holds garbage: %s", lane, e)
            return
        self._refused.add(cookie)
        log.warning("lane %d: client %s (pid %s) wrote garbage: %s; the broker disconnects it", lane, name,
                    client.process()[0] if client is not None else "?", e)
        self.seg.report_garbage(lane, cookie, e.fault)
        self.broker.waker.notify()

    def _lane_holder(self, lane: int) -> tuple[str, int]:
        """(client segment name, cookie) of a lane's holder; the name is decoded again only
        when the lane's cookie changed (a new holder)."""
        cookie = self.broker.lane_cookie(lane)
        held = self._lane_names.get(lane)
        if held is None or held[1] != cookie:
            held = self._lane_names[lane] = self.broker.lane_client(lane)
        return held

    def _run_batch(self, off: int, batch_id: int) -> None:
        """A batch the broker's scheduler formed (its manifest is in batches.0, the server's alone)."""
        batches = self.segments.get(object_name(self.server_id, "batches", 0))
        manifest = read_manifest(batches.buf, off)
        free_block(batches.buf, off)
        if self.sequence is not None and manifest.get("release"):
            self.sequence.forget(manifest["release"])
        if manifest["requests"]:
            self._execute(manifest["requests"])
        # Done before the answers are completed: the broker, asked anything by a client that has
        # its answer, then no longer counts the batch's regions as in use (Broker._control).
        while not self.seg.outbox.put(W_DONE, 0, 0, 0, batch_id):
            time.sleep(0.0005)
        fence()
        if self.seg.want_wakeup:  # the broker has work queued for this instance
            self.seg.want_wakeup = False
            self.broker.waker.notify()
        self._flush_counts()

    def _take_request(self, lane: int, cookie: int, client_name: str, client: ClientSegment, rec: Record) -> bool:
        """A request a client put on its lane: checked here instead of in the broker, then run,
        or queued for a batch (True) when this instance batches its lanes."""
        slot, off = rec.slot, rec.off
        entry: BatchEntry = {"client": client_name, "ticket": client.ticket, "slot": slot}
        assert self.signature is not None
        try:
            req, data_start = read_request(client.seg.buf, rec)
        except Garbage as e:
            self._garbage(lane, client_name, cookie, e, client, slot)
            return False
        try:
            self.holds.hold(req, entry)  # before its regions are looked up in the table
            batch = check_request(self.signature, self.regions, self.decoupled, client, req, data_start, entry)
        except (InvalidRequest, RequestError, ValueError, KeyError, TypeError) as e:
            # Refused before it was queued: counted nowhere, as in Triton
            self.holds.release(entry)
            self._answer_error(entry, getattr(e, "status", 400), str(e), refused=True)
            return False  # serve() flushes the counters and sends the answer
        if self.batcher is None:
            self._execute([entry])
            return False
        if self.cache is not None and not self._answer_cached([entry]):
            return False  # answered from the response cache: never queued
        now_ns = time.monotonic_ns()
        if "trace_queued_ns" in entry:
            entry["trace_queued_ns"] = now_ns  # traced: its QUEUE_START
        # It waited on the lane while we ran the previous batch: its delay and queue timeout count
        # from when the client sent it (the same monotonic clock in every process).
        arrived = min(req.sent_ns or now_ns, now_ns) / 1e9
        pending = Pending(client, slot, off, entry, batch, arrived, priority=req.priority, timeout_us=req.timeout_us)
        # (no QueueFull, no timeout: a model whose queue policy refuses or times out queues in
        # the broker, batches_on_worker)
        self.batcher.enqueue(pending, arrived)
        return True

    def _run_local_batches(self, batcher: DynamicBatcher, now: float) -> int:
        """Run every batch that is due (all of them when ``now`` is infinite: the worker is
        stopping). Each finished request counts as drained; returns how many finished."""
        done = 0
        stopping = math.isinf(now)
        while len(batcher):
            batch = batcher.next_batch(now if stopping else time.monotonic())
            if batch is None:
                break
            self._execute([p.entry for p in batch])
            done += len(batch)
            if not stopping:
                # What arrived meanwhile joins the queue before the next batch is formed: a higher
                # priority goes first.
                for lane in self.seg.take_rung_lanes():
                    self._serve_lane(lane)
        self.stats.counts[DIRECT_DONE] += done
        return done

    def _answer_cached(self, entries: list[BatchEntry]) -> list[BatchEntry]:
        """Answer the requests the response cache holds; returns the others, to run. Triton
        looks each request up on its own: a batch's hits are answered, its misses run together."""
        looking = {id(entry) for entry in entries if "cache_key" not in entry}  # (not looked up when queued)
        hits, misses = self.cache.split(entries)  # type: ignore[union-attr]
        counted = [entry["cache_lookup_ns"] for entry in misses
                   if id(entry) in looking and entry["cache_key"] is not None]
        if counted:  # a miss counts at its lookup, whatever the request's outcome (Triton's)
            with self.stream_lock:
                for ns in counted:
                    self.stats.cache_miss(ns)
        for entry, resp, looked_up, lookup_ns in hits:
            self.answers.phases = (looked_up, looked_up + lookup_ns, looked_up + lookup_ns)
            ok = self._answer(entry, resp)[1] == 200
            with self.stream_lock:
                self.stats.cache_hit(entry.get("sent_ns", 0), looked_up, lookup_ns, ok)
            self.holds.release(entry)
        return misses

    def _execute(self, entries: list[BatchEntry]) -> None:
        """Run one batch and answer each request; time its phases for the statistics. Answers
        an earlier execution of this round made go out first: a round of several executions
        (a queue drained, a lane of several requests) must not hold one answer for the others."""
        if self.answers.pending():
            self._flush_counts()
        if self.cache is not None:
            entries = self._answer_cached(entries)
            if not entries:
                return
        start = time.monotonic_ns()
        busy = self.seg.stats.scalars
        busy[BUSY_SINCE] = start  # the broker enforces execution_timeout_s against this
        busy[EXECUTING] = len(entries)  # no longer pending (nv_inference_pending_request_count)
        live: list[tuple[BatchEntry, Request]] = []
        for entry in entries:
            try:
                client = self._client(entry["client"])
                if client.cancelled(entry["slot"]):  # its owner gave up while it waited: never run
                    if self.sequence is not None:
                        self.sequence.skip(entry.get("sequence_id", 0), entry.get("sequence_flags", 0))
                    self._answer_error(entry, CANCELLED_STATUS, cancelled_error(entry.get("id", "")), queued=True)
                    with self.stream_lock:  # (a model's own threads count finished streams meanwhile)
                        self.stats.cancelled()
                    continue
                live.append((entry, self._build_request(entry, client, start)))
            except (RequestError, ValueError, OSError, posix_ipc.Error, CudaError) as e:
                # Its inputs could not be read (a region truncated, a CUDA handle refused, BYTES
                # whose lengths do not frame its shape): not run, and counted nowhere, as Triton's
                # frontend or core refuses it before it is queued.
                message = str(e)
                if isinstance(e, BytesFraming) and e.input_name:
                    message = e.for_input(request_tag(entry.get("id", "")), self.model, e.input_name)
                self._answer_error(entry, e.status if isinstance(e, RequestError) else 400, message)
        built = executed = time.monotonic_ns()
        ok: list[bool] = []
        raised = False
        kept: set[int] = set()  # id() of the entries answered later (late_answers.py)
        if live:
            if log.isEnabledFor(logging.DEBUG):  # --log-verbose 1: each execution, as Triton's core says it
                log.debug("model %s, instance %s, executing %d requests", self.model, self.instance_name, len(live))
            requests, rows = [r for _, r in live], None
            if self.sequence is not None and self.sequence.direct:  # (null requests fill its empty slots)
                requests, rows = self.sequence.with_null_requests([e.get("slot_index") for e, _ in live], requests,
                                                                  self.output_names)
            try:
                responses = self.instance.execute(requests)  # type: ignore[union-attr]
                if self.decoupled:
                    responses = [None] * len(live)  # decoupled models answer through their senders
                elif len(responses) != len(requests):
                    raise RuntimeError(f"model returned {len(responses)} responses for {len(requests)} requests")
                elif rows is not None:
                    responses = [responses[row] for row in rows]
            except (Exception, KeyboardInterrupt, SystemExit) as e:  # noqa: BLE001 - model code may raise
                # anything; as in Triton, even what would end a process fails only this execution
                executed = time.monotonic_ns()
                raised = True
                msg = self.instance.failure(self.instance_name, e)  # type: ignore[union-attr]
                log.error("%s\n%s", msg, traceback.format_exc())
                self.answers.phases = (start, built, executed)
                for entry, req in live:
                    if req.sender is not None:
                        req.sender.fail(500, msg)  # counted when the stream finishes
                    else:  # (it ran: its version and times, as Triton's trace has them)
                        self._deliver(entry, 500, AnswerDescriptor(error=msg, version=self.version,
                                                                   trace=self.answers.ran_stamps(entry)).encode(), [])
                        ok.append(False)
            else:
                executed = time.monotonic_ns()
                self.answers.phases = (start, built, executed)
                for (entry, req), resp in zip(live, responses):
                    if isinstance(resp, Deferred):
                        resp = self._keep(entry, req, resp)
                        if resp is None:
                            kept.add(id(entry))
                            continue
                    if req.sender is not None:
                        if resp is not None:  # a streaming call to a model that answers once
                            self._keep_state(entry, resp)
                            req.sender(resp, final=True)
                        continue
                    ok.append(self._answer_ran(entry, resp))
        if live:
            batched = self.signature is not None and self.signature.max_batch_size > 0
            sizes, arrivals, streamed = [], [], 0  # answered here; streamed ones count when they finish
            streamed_arrivals: list[int] = []
            # In the execution's batch size only: null requests, and the streams of an execute that
            # raised (each stream's failure counts as it ends; the execution counts, as Triton's)
            batch_only = len(requests) - len(live)
            for entry, req in live:
                size = next(iter(req.inputs.values())).shape[0] if batched and req.inputs else 1
                if req.sender is None and id(entry) not in kept:
                    sizes.append(size)
                    arrivals.append(entry.get("sent_ns", 0))
                elif not raised:
                    streamed += size
                    streamed_arrivals.append(entry.get("sent_ns", 0))
                else:
                    batch_only += size
            with self.stream_lock:  # streams may finish meanwhile on the model's threads (an async execute's loop)
                output_ns = time.monotonic_ns() - executed
                self.stats.executed(sizes, arrivals, start, built - start, executed - built, output_ns, ok, streamed,
                                    batch_only=batch_only)
                self.stats.stream_phases(streamed_arrivals, start, built - start, executed - built, output_ns)
        for _, req in live:
            if req.sender is not None:  # still open, it outlives the batch the broker forgets now
                req.sender.name_worker(self.num)
        for entry in entries:
            self.holds.release(entry)  # answered (a stream's hold went to its sender, a kept one's to late)
        busy[BUSY_SINCE] = busy[EXECUTING] = 0

    def _answer_ran(self, entry: BatchEntry, resp: Response) -> bool:
        """Answer a request the model ran: its sequence's state kept, the response cache filled
        (with outputs only). Whether it succeeded as Triton counts it: answered with its outputs,
        or with an error response the model returned itself; False if the backend failed it."""
        self._keep_state(entry, resp)
        status, answered = self._answer(entry, resp)
        if answered == 200:
            if self.cache is not None and entry.get("cache_key"):
                inserting = time.monotonic_ns()
                try:
                    self.cache.insert(entry, resp)
                except Exception:  # noqa: BLE001 - the request is answered: a store that failed only costs a hit
                    log.exception("storing an answer of '%s' in the response cache failed", self.model)
                else:
                    self.stats.cache_inserted(time.monotonic_ns() - inserting)
            return True
        if resp.model_error and answered == status:  # (not when no room was found for its error)
            self.stats.model_error()
            return True
        return False

    def _keep_state(self, entry: BatchEntry, resp: Response) -> None:
        """Keep a sequence's state outputs for its next request, out of the response (unless the
        request named them): on every path a response takes, unary or a stream's."""
        if self.sequence is not None and resp.error is None:
            asked = [o["name"] for o in entry.get("outputs") or ()]
            self.sequence.capture(resp.outputs, asked, entry.get("sequence_id", 0), entry.get("sequence_flags", 0))

    # -- answers after execute returned (workers/late_answers.py) ---------------------------------
    def _keep(self, entry: BatchEntry, req: Request, deferred: Deferred) -> Response | None:
        """Keep a request its model answers later; its response instead if that came already.
        A request the broker forwarded now names this worker in its slot, so that the broker
        fails it if this worker dies before answering (the broker forgets the batch now)."""
        kept = Kept(entry, deferred, req.sender, self.answers.phases)
        if not self.late.keep(kept):
            return deferred.response
        if req.sender is None:
            kept.held = self.holds.hand_to_sender(entry)
        client = self.clients.get(entry["client"])
        if client is not None and client.target(entry["slot"]) == 0:
            client.set_target(entry["slot"], self.num + 1)
        return None

    def _answer_late(self) -> bool:
        """Answer the kept requests their models finished, and those their clients cancelled
        (Triton's client sees its call end then, whatever the model does); True if any."""
        late = self.late
        finished = late.take_finished()
        for kept, resp in finished:
            if kept.sender is not None:
                self._keep_state(kept.entry, resp)
                kept.sender(resp, final=True)  # counted by the stream
                continue
            self.answers.phases = kept.phases
            ok = self._answer_ran(kept.entry, resp)
            self._count_late(kept, ok)
        cancelled: list[Kept] = []
        now = time.monotonic()
        if late and now - self._late_checked >= CANCEL_CHECK_S:  # at most every 50 ms, not every pass
            self._late_checked = now
            cancelled = late.take(self._cancelled)
        for kept in cancelled:
            message = cancelled_error(kept.entry.get("id", ""))
            if kept.sender is not None:
                kept.sender.fail(CANCELLED_STATUS, message)
                continue
            self._answer_error(kept.entry, CANCELLED_STATUS, message)
            self._count_late(kept, False)
        return bool(finished or cancelled)

    def _count_late(self, kept: Kept, ok: bool) -> None:
        self.holds.let_go(kept.held)
        with self.stream_lock:  # (a decoupled model's threads count finished streams meanwhile)
            self.stats.finished_stream(kept.entry.get("sent_ns", 0), ok, answered_once=kept.sender is None)

    def _cancelled(self, kept: Kept) -> bool:
        client = self.clients.get(kept.entry["client"])
        return client is not None and client.cancelled(kept.entry["slot"])

    def _drop_late(self, name: str) -> None:
        """Client ``name`` left: stop keeping its requests (nobody waits for their answers)."""
        for kept in self.late.take(lambda k: k.entry["client"] == name):
            if kept.sender is not None:  # its stream ends (and lets go of its regions) while still mapped
                kept.sender.fail(CANCELLED_STATUS, cancelled_error(kept.entry.get("id", "")))
            else:
                self._count_late(kept, False)

    def _fail_late(self, message: str) -> None:
        """The worker stops: answer what the models finished, and fail the rest with ``message``:
        a 500, as they ran (a 503 is retried by clients and balancers, and a stream may have had
        responses already)."""
        self._answer_late()
        for kept in self.late.take(lambda k: True):
            if kept.sender is not None:
                kept.sender.fail(500, message)
            else:
                self._answer_error(kept.entry, 500, message)
                self._count_late(kept, False)
        self._flush_counts()

    def _flush_counts(self) -> None:
        self.stats.counts[ARENA_BYTES] = self.answers.arena.bytes_in_use
        self.stats.flush()
        custom_metrics.REGISTRY.flush()
        if self.input_views is not None:  # before the clients may reuse the blocks the views show
            self.input_views.settle()
        self.answers.send_completions()

    def _build_request(self, entry: BatchEntry, client: ClientSegment, start: int) -> Request:
        """The model's request for ``entry``, its inputs read; ``start``: when its batch began."""
        inputs, own = read_inputs(entry, self.segments, self.instance.device_inputs,  # type: ignore[union-attr]
                                  self.input_views)
        if self.reshapes is not None:
            self.reshapes.model_inputs(inputs)
        if self.sequence is not None:
            self.sequence.augment(inputs, entry.get("sequence_id", 0), entry.get("sequence_flags", 0))
        wanted = entry.get("outputs")
        # No outputs named: the model is asked for every output its config declares (as Triton).
        names = [o["name"] for o in wanted] if wanted else self.output_names
        sender = None
        if "stream" in entry:
            sender = StreamSender(self.answers, client, entry, self.stats, self.stream_lock, self.holds)
            if "trace_queued_ns" in entry:  # traced: its compute began with the batch, and its inputs are read now
                sender.computing = (start, time.monotonic_ns())
        elif self.decoupled:
            raise DecoupledOnly()  # reached through the broker
        on_device = frozenset(o["name"] for o in wanted if "cuda" in o) if wanted else frozenset()
        # (inputs, requested_outputs, id, correlation_id, flags, parameters, sender, device_outputs, cancel,
        # own_inputs, timeout_us, traced): by position, a dataclass is built in half the time
        return Request(inputs, names, entry.get("id", ""), entry.get("sequence_id", 0), entry.get("sequence_flags", 0),
                       entry.get("parameters") or {}, sender, on_device, CancelFlag(client, entry["slot"]), own,
                       entry.get("timeout_us", 0), "trace_queued_ns" in entry)

    # -- answering ------------------------------------------------------------------------------
    def _forget_departed_clients(self) -> None:
        """Unmap the segments of clients that are gone, so their memory is not pinned here."""
        for name, client in list(self.clients.items()):
            # Gone: the process died, or it closed the connection (which unlinks the segment).
            if not liveness.consumer_alive(client.ticket) or not os.path.exists("/dev/shm" + name):
                if self.late:
                    self._drop_late(name)
                if self.batcher is not None and len(self.batcher):
                    queued = self.batcher.all()
                    self.batcher.drop_client(client)
                    kept = {id(p) for p in self.batcher.all()}
                    for p in queued:
                        if id(p) not in kept:
                            self.holds.release(p.entry)
                    self.stats.counts[DIRECT_DONE] += len(queued) - len(kept)
                self.clients.pop(name).close()
                self.segments.drop(name)
        # Arenas of clients this worker never answered are mapped through ``segments`` too (an
        # ensemble's first step reads its caller's inputs there): unmapped once they are gone.
        self.segments.drop_unlinked(object_name(self.server_id, "client", ""))
        # Likewise other workers' segments and retired extents (theirs, the broker's) an ensemble
        # step's inputs lay in.
        self.segments.drop_unlinked(object_name(self.server_id, "worker", ""))
        self.segments.drop_unlinked(object_name(self.server_id, "broker", "0.arena."))

    def _client(self, name: str) -> ClientSegment:
        client = self.clients.get(name)
        if client is not None and client.seg.zeroed:  # its client truncated it: mapped anew, as it is now
            del self.clients[name]
            client.close()
            client = None
        if client is None:
            client = ClientSegment.attach(name)
            self.clients[name] = client
        return client

    def _answer_error(self, entry: BatchEntry, status: int, message: str, refused: bool = False,
                      queued: bool = False) -> None:
        """Answer an error; ``refused``: before the model ran (shm.answer.refusal); ``queued``: by
        this version's scheduler, which a trace names (a request refused before it has none)."""
        answer = AnswerDescriptor(error=message, refused=refused, version=self.version if queued else NO_VERSION)
        self._deliver(entry, status, answer.encode(), [])

    def _answer(self, entry: BatchEntry, resp: Response) -> tuple[int, int]:
        """Deliver one response: (the status its response had, the status it was answered with:
        a 503 where the arena had no room for it)."""
        status, answer, tensors = self.answers.encode(entry, resp)
        return status, self._deliver(entry, status, answer, tensors)

    def _deliver(self, entry: BatchEntry, status: int, answer: bytes, tensors: list[tuple[int, Any]]) -> int:
        """Answer ``entry``; the status it got (a 503 where the arena had no room for the answer)."""
        try:
            client = self._client(entry["client"])
        except (posix_ipc.Error, OSError, ValueError):
            return status  # the client is gone; nothing to answer
        return self.answers.deliver(client, entry, status, answer, tensors)

    def close(self) -> None:
        try:
            if self.instance is not None:
                self.instance.finalize()  # (a model's finalize may join the threads that still send)
            if self.late:
                self._fail_late(f"model instance '{self.instance_name}' stopped before its model sent the "
                                f"request's final response")
            if self.model_state is not None:
                self.model_state.finalize()
            if self.backend is not None:
                self.backend.finalize()
        except Exception:  # noqa: BLE001
            log.exception("finalize failed")
        for client in self.clients.values():
            client.close()
        self.segments.clear()
        self.broker.close()


# How long a worker whose broker died may take to answer what is on its lanes and exit.
ORPHAN_GRACE_S = 5


def run(spec: dict[str, Any]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is for the broker to handle
    worker = Worker(spec)
    broker = spec["broker_pid"]

    def stop(signum: int, frame: Any) -> None:
        """SIGTERM comes when the broker dies (PR_SET_PDEATHSIG: we were given to another parent
        first), and then we go. While it lives, SIGTERM was sent to the whole server (its process
        group or cgroup: ``kill -- -PGID``, systemd's default KillMode) and is the broker's to act
        on: it drains, then stops us through our inbox; leaving now would fail what it still
        has queued for us."""
        if os.getppid() != broker:
            worker.running = False
            # Nobody is left to wait for a model stuck in execute(): if we are not gone soon,
            # the alarm's default action ends us (an orphan would keep the server's memory mapped).
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(ORPHAN_GRACE_S)

    signal.signal(signal.SIGTERM, stop)
    worker.load()
    try:
        worker.serve()
    finally:
        worker.close()
    return 0
