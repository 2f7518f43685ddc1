"""The worker process: one instance of one model version, fed through its shared-memory inbox.

The loop sleeps on its semaphore, takes batch descriptors the broker wrote, builds numpy views of
the inputs straight over the clients' shared memory, runs the backend, writes the outputs into its
own arena (or into the region the client named), answers each client directly (one semaphore post
per client) and tells the broker the instance is free, ringing the broker only if it waits.
"""
from __future__ import annotations

import base64
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import orjson
import posix_ipc

from shmserve.shm import logs
from shmserve.shm.arena import Arena, free_block
from shmserve.shm.copying import copy_into
from shmserve.shm.channel import NOTIFY_BROKER, BrokerSegment, ClientSegment, WorkerSegment
from shmserve.shm.peer_fds import PeerSockets
from shmserve.shm.stats import ARENA_BYTES, BUSY_SINCE, DIRECT_DONE, HTTP_DIRECT, StatsWriter
from shmserve.shm.names import object_name, pid_alive
from shmserve.shm.protocol import (DIRECT_TRAILER, REQ_DIRECT, REQ_POLLING, SENT_ALL, SENT_REFUSED, ROLE_WORKER, W_BATCH, W_CONFIG, W_DONE, W_LOAD_FAILED, W_READY, W_STOP,
                          manifest_room, read_manifest, read_manifest_raw, write_manifest)
from shmserve.shm.region_table import RegionTable, locate
from shmserve.shm.segment import SegmentCache, StaleRegion
from shmserve.shm.tensors import byte_view, from_buffer, serialize_bytes, wire_datatype
from shmserve.shm.waker import SpinPolicy, fence

from shmserve.batching import DynamicBatcher, Pending, QueueFull, batches_on_worker

from . import custom_metrics
from .classification import ClassificationError, classify, load_labels
from .backend import Backend, Instance, InstanceContext, Model, ModelContext, Request, Response, load_backend
from .cuda import CudaError
from .cuda import runtime as cuda_runtime
from .sequence import SequenceSupport
from .descriptors import LIMIT as PLANS_LIMIT
from .descriptors import Kept, Plan, plan_of, split_send_time
from shmserve.signature import InvalidRequest, ModelSignature, queue_options
from .stream import StreamSender
from .warmup import run_warmup

log = logging.getLogger("shmserve.worker")
SPIN_S = float(os.environ.get("SHMSERVE_SPIN_US", "500")) / 1e6


_WIRE_TYPES: dict[Any, str] = {}  # numpy dtype -> wire datatype, as ``wire_datatype`` finds it


def _wire_type(arr: Any) -> str:
    datatype = wire_datatype(arr)
    _WIRE_TYPES[arr.dtype] = datatype
    return datatype


def _output_desc(name: str, datatype: str, shape: tuple[int, ...], size: int) -> dict[str, Any]:
    """An output's entry in an answer document, before its place ("off" or "region")."""
    return {"name": name, "datatype": datatype, "shape": list(shape), "size": size}


class RequestError(Exception):
    """A problem with one request (not the batch): answered as a 400 to that client only."""

    status = 400


class DecoupledOnly(RequestError):
    """A single-answer request to a decoupled model: Triton's UNSUPPORTED (501), with its text."""

    status = 501

    def __init__(self) -> None:
        super().__init__("HTTP end point doesn't support models with decoupled transaction policy")


class DirectSend:
    """An answer this worker writes to an HTTP client's socket itself (``PeerSockets.write``), and
    what it takes to write the usual response block instead if the send falls short (no block is
    written for a whole send: the frontend would only free it)."""

    def __init__(self, fd: int, ino: int, data: bytes, entry: dict, doc: bytes, tensors: list[tuple[int, Any]]) -> None:
        self.fd = fd
        self.ino = ino
        self.data = data
        self.entry = entry
        self.doc = doc
        self.tensors = tensors


class Worker:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.server_id: str = spec["server_id"]
        self.num: int = spec["num"]
        self.model: str = spec["model"]
        self.version: int = spec["version"]
        self.instance_name: str = spec["instance_name"]
        self.broker_pid: int = spec["broker_pid"]
        self.seg = WorkerSegment.attach(object_name(self.server_id, "worker", self.num))
        self.seg.set_pid(os.getpid())
        self.stats = StatsWriter(self.seg.stats)
        # Answers to complete after the counters are flushed: (client, slot, status, offset, length,
        # direct send or None). A direct send's response block is written only if the send falls short.
        self._notes: list[tuple[ClientSegment, int, int, int, int, DirectSend | None]] = []
        self._peers = PeerSockets()  # HTTP clients' sockets in the frontends, for direct answers
        self._alone = False  # the execution answering now ran a single request
        self.signature: ModelSignature | None = None
        self.labels: dict[str, list[str]] = {}  # output name -> its label_filename's lines
        self.output_names: list[str] = []
        self.sequence: SequenceSupport | None = None
        self.decoupled = False
        self.stream_lock = threading.Lock()
        self.arena = Arena(self.seg.seg.buf, self.seg.arena_offset, self.seg.arena_size)
        self.broker = BrokerSegment.attach(self.server_id)
        self.regions = RegionTable(self.broker.regions)  # for requests naming regions on direct lanes
        self._lane_names: dict[int, tuple[str, int]] = {}
        self._plans: dict[bytes, Plan] = {}  # checked descriptors by their bytes (descriptors.py)
        # the last direct request this worker ran in each client's slot, while it may come again
        self._kept: dict[tuple[str, int], Kept] = {}
        # answer documents by their outputs' names, dtypes and shapes (``_encode_plain``)
        self._plain_docs: dict[tuple, bytes] = {}
        self.segments = SegmentCache()
        self.clients: dict[str, ClientSegment] = {}
        self.backend: Backend | None = None
        self.model_state: Model | None = None
        self.instance: Instance | None = None
        self.running = True
        self._phases = (0, 0, 0)  # the batch's start, inputs built, executed: trace timestamps
        # Requests from our lanes waiting for a batch, when this instance batches them itself.
        self.batcher: DynamicBatcher | None = None

    # -- start-up -------------------------------------------------------------------------------
    def load(self) -> None:
        spec = self.spec
        ctx = ModelContext(name=self.model, version=self.version, model_dir=Path(spec["model_dir"]),
                           config=spec["config"], strict_config=spec.get("strict", False),
                           server_id=self.server_id)
        try:
            custom_metrics.REGISTRY.attach(self.seg.custom_metrics)
            self.backend = load_backend(spec["backend"])
            if not ctx.strict_config:
                ctx.config = self.backend.auto_complete_config(ctx)
                self._post(W_CONFIG, 0, orjson.dumps(ctx.config))
            self.model_state = self.backend.create_model(ctx)
            ictx = InstanceContext(name=self.instance_name, index=spec["instance_index"], kind=spec["kind"],
                                   device_id=0 if spec["kind"] == "GPU" else 0,
                                   physical_device_id=spec.get("device_id", 0))
            self.instance = self.model_state.create_instance(ictx)
            self.signature = ModelSignature(self.model, ctx.config)
            self.labels = load_labels(ctx.config, ctx.model_dir)
            self.output_names = list(self.signature.outputs)
            if ctx.config.get("sequence_batching"):
                self.sequence = SequenceSupport(ctx.config)
            if batches_on_worker(ctx.config, spec.get("instances", 0)):  # the broker decides alike
                self.batcher = DynamicBatcher(ctx.config)
            self.decoupled = bool((ctx.config.get("model_transaction_policy") or {}).get("decoupled"))
            if ctx.config.get("model_warmup"):
                runs = run_warmup(self.instance, ctx.config, ctx.model_dir, self.output_names)
                log.info("warm-up done: %d execution(s)", runs)
        except BaseException as e:  # noqa: BLE001 - any failure of user code is a load failure
            detail = "".join(traceback.format_exception_only(type(e), e)).strip()
            log.error("failed to load '%s' version %d: %s\n%s", self.model, self.version, detail,
                      traceback.format_exc())
            self._post(W_LOAD_FAILED, 0, detail.encode())
            raise SystemExit(3) from None
        custom_metrics.REGISTRY.flush()  # families the model made in initialize() show before its first request
        self._post(W_READY, 0, b"")

    def _post(self, kind: int, status: int, payload: bytes) -> None:
        """A message to the broker; start-up messages always ring its doorbell."""
        off = self.arena.alloc(len(payload)) if payload else 0
        if payload:
            self.seg.seg.buf[off:off + len(payload)] = payload
        while not self.seg.outbox.put(kind, status, off, len(payload), 0):
            time.sleep(0.001)
        self.broker.waker.notify()

    # -- serving --------------------------------------------------------------------------------
    def serve(self) -> None:
        seg = self.seg
        inbox = seg.inbox
        has_work = lambda: inbox.pending() > 0 or seg.bells_rung()  # noqa: E731
        batcher = self.batcher
        checked = time.monotonic()
        departures = int(self.broker.departures[0])
        log_settings = logs.Follower(self.broker.settings)
        spin = SpinPolicy(SPIN_S)
        polled = False  # the last round served a client that polls for its answers
        while self.running:
            # Long sleeps: the kernel signals us if the broker dies (PR_SET_PDEATHSIG); the check
            # below only covers systems without it.
            # (and no longer than the HTTP clients' sockets we write to may be kept: peer_fds.py)
            timeout = min(10.0, self._peers.release_due(time.monotonic()))
            if batcher is not None and len(batcher):
                timeout = min(timeout, batcher.next_timer(time.monotonic()) or 0.0)
            seg.waker.sleep(timeout, has_work, spin if polled else None)
            log_settings.check()  # POST /v2/logging: one integer read unless it changed
            if int(self.broker.departures[0]) != departures:
                departures = int(self.broker.departures[0])
                self._forget_departed_clients()
                seg.ring_pending_bells()  # a client killed between its put and its bell
            if time.monotonic() - checked > 10.0:
                checked = time.monotonic()
                self._forget_departed_clients()
                seg.ring_pending_bells()
                if not pid_alive(self.broker_pid):
                    log.error("broker %d is gone; worker exits", self.broker_pid)
                    return
            for kind, _, off, length, batch_id in inbox.drain():
                if kind == W_STOP:
                    self.running = False  # answer what is already on the lanes, then go
                elif kind == W_BATCH:
                    self._run_batch(off, batch_id)
            lanes = seg.take_rung_lanes()
            if lanes:
                polled = False
                for lane in lanes:
                    client, cookie = self._lane_holder(lane)
                    for kind, slot, off, length, record_cookie in seg.lanes[lane].drain():
                        polled = polled or bool(kind & REQ_POLLING)
                        if record_cookie != cookie or not client:
                            # A record of a client that left (its lane was given to another, or to
                            # no one): nobody waits for it. Said, since a live client's lost
                            # request would hang its caller.
                            log.warning("lane %d: dropped a record with cookie %d (the lane's holder: "
                                        "%r, cookie %d)", lane, record_cookie, client, cookie)
                        elif self._run_direct(client, slot, off, length if kind & REQ_DIRECT else 0):
                            continue  # queued for a batch: done when it runs
                        self.stats.counts[DIRECT_DONE] += 1  # lets the broker see this worker drained
            ran = bool(lanes)
            if batcher is not None and len(batcher):
                ran = self._run_local_batches(batcher, time.monotonic() if self.running else math.inf) > 0 or ran
            if ran:
                # Once per round, not per request: counters first, then every answer of the round
                # with one wake-up per client (under load a round holds several requests).
                self._flush_counts()

    def _lane_holder(self, lane: int) -> tuple[str, int]:
        """(client segment name, cookie) of a lane's holder; the name is decoded again only
        when the lane's cookie changed (a new holder)."""
        cookie = self.broker.lane_cookie(lane)
        held = self._lane_names.get(lane)
        if held is None or held[1] != cookie:
            held = self._lane_names[lane] = self.broker.lane_client(lane)
        return held

    def _run_batch(self, off: int, batch_id: int) -> None:
        """A batch the broker's scheduler formed (its descriptor is in the broker's arena)."""
        broker_seg = self.segments.get(object_name(self.server_id, "broker", 0))
        manifest = read_manifest(broker_seg.buf, off)
        free_block(broker_seg.buf, off)
        if self.sequence is not None and manifest.get("release"):
            self.sequence.forget(manifest["release"])
        if manifest["requests"]:
            self._execute(manifest["requests"])
        self._flush_counts()
        while not self.seg.outbox.put(W_DONE, 0, 0, 0, batch_id):
            time.sleep(0.0005)
        fence()
        if self.seg.want_wakeup:  # the broker has work queued for this instance
            self.seg.want_wakeup = False
            self.broker.waker.notify()

    def _run_direct(self, client_name: str, slot: int, off: int, direct_length: int = 0) -> bool:
        """A request a client put on its lane: validated and resolved here instead of the broker,
        then run, or queued for a batch (True) when this instance batches its lanes.
        ``direct_length``: the length of a block that ends with a direct-answer trailer."""
        try:
            client = self._client(client_name)
        except (posix_ipc.ExistentialError, ConnectionError, ValueError) as e:
            log.warning("slot %d of client %s not answered: its segment cannot be mapped (%s)", slot, client_name, e)
            return False  # the client is gone
        key = (client_name, slot)
        kept = self._kept.get(key)
        sent_ns = kept.send_time(client, client.seg, off, direct_length) if kept is not None else -1
        if sent_ns >= 0:  # a rerun
            assert kept is not None
            if not kept.viewed:  # (its first rerun: the slot is in use by a closed loop)
                kept.viewed = True
                templates = self._templates(kept.entry)
                if templates is not None:
                    kept.entry["views"] = templates
            entry = kept.entry_for(sent_ns)
            batch, priority, timeout_us = kept.batch, kept.priority, kept.timeout_us
        else:
            if kept is not None:
                del self._kept[key]
            entry = {"client": client_name, "pid": client.pid, "slot": slot}
            tail_len = self._take_trailer(entry, client, off + direct_length, direct_length) if direct_length else 0
            try:
                raw, data_start = read_manifest_raw(client.seg.buf, off)
                known = split_send_time(raw)
                plan = self._plans.get(known[0]) if known is not None else None
                if plan is not None and client.arena_offset <= data_start + plan.low and \
                        data_start + plan.high <= client.seg.size and \
                        (plan.regions is None or plan.regions == self.regions.current()):
                    batch, priority, timeout_us, sent_ns = plan.batch, plan.priority, plan.timeout_us, known[1]  # type: ignore[index]
                    plan.place(entry, client_name, data_start)
                    entry["t"] = sent_ns
                    if tail_len and plan.regions is None and known is not None:
                        # kept once its answer is sent whole, which a rerun of it needs (_send_completions)
                        entry["keep"] = Kept(client, client.seg, off, direct_length, len(known[0]), len(raw),
                                             tail_len, entry, batch, priority, timeout_us)
                else:
                    batch, priority, timeout_us, sent_ns = self._check_request(entry, client, orjson.loads(raw),
                                                                               data_start, known)
            except (InvalidRequest, RequestError, ValueError, KeyError, TypeError) as e:
                self.stats.rejected()
                self._answer_error(entry, getattr(e, "status", 400), str(e))
                return False  # serve() flushes the counters and sends the answer
        if self.batcher is None:
            self._execute([entry])
            return False
        now_ns = time.monotonic_ns()
        if "tr" in entry:
            entry["tr"] = now_ns  # traced: its QUEUE_START
        # It waited on the lane while we ran the previous batch: its delay and queue timeout count
        # from when the client sent it (the same monotonic clock in every process).
        arrived = min(sent_ns or now_ns, now_ns) / 1e9
        pending = Pending(client, slot, off, entry, batch, arrived, priority=priority, timeout_us=timeout_us)
        try:
            self.batcher.enqueue(pending, arrived)
        except QueueFull as e:
            self.stats.rejected()
            self._answer_error(entry, e.status, str(e))
            return False
        return True

    @staticmethod
    def _take_trailer(entry: dict, client: ClientSegment, end: int, length: int) -> int:
        """What a direct answer needs (``shm.protocol.DIRECT_TRAILER``): the HTTP client's socket in
        the frontend, the answer descriptor the frontend expects and the bytes to send before the
        outputs (a view into the request block, which lives until the frontend releases the answer).
        Returns the bytes the trailer and those take at the block's end (0: none)."""
        buf = client.seg.buf
        at = end - DIRECT_TRAILER.size
        if at < 0 or end > len(buf):
            return 0
        fd, raw_len, head_len, _, ino = DIRECT_TRAILER.unpack_from(buf, at)
        span = raw_len + head_len + DIRECT_TRAILER.size
        if span > length:
            return 0
        # (the expected descriptor as bytes: it is compared with the answer's, and a memoryview
        # compares item by item, ten times slower)
        entry["http"] = (fd, ino, client.seg.read(at - head_len - raw_len, at - head_len), buf[at - head_len:at])
        return span

    def _check_request(self, entry: dict, client: ClientSegment, doc: dict, data_start: int,
                       known: tuple[bytes, int] | None) -> tuple[int, int, int, int]:
        """Check a descriptor the full way and fill ``entry``; (batch, priority, timeout, send
        time). A descriptor that may be reused is kept under its bytes (see descriptors.py)."""
        if self.decoupled and "stream" not in doc:
            raise DecoupledOnly()  # before the inputs are looked at, as in Triton
        assert self.signature is not None
        regions = self.regions.current()  # a plan keeps region tensors resolved against one table
        batch = self.signature.check_inputs(doc["inputs"], doc.get("id", ""))
        self.signature.check_outputs(doc.get("outputs"))
        priority, timeout_us, sent_ns = queue_options(doc)
        entry.update(id=doc.get("id", ""), params=doc.get("params"), corr=doc.get("corr", 0),
                     flags=doc.get("flags", 0), t=sent_ns)
        if "tr" in doc:
            entry["tr"] = 0  # traced; no broker queue (the frontend's submit is its QUEUE_START)
        entry["inputs"] = [self._locate(client, t, data_start) for t in doc["inputs"]]
        outputs = doc.get("outputs")
        entry["outputs"] = [self._output(client, o, data_start) for o in outputs] if outputs else None
        if "stream" in doc:
            entry["stream"] = {"seg": client.name, "off": data_start + int(doc["stream"])}
            if not client.arena_offset <= entry["stream"]["off"] <= client.seg.size - 4096:
                raise RequestError("the response ring lies outside the client's arena")
        if known is not None:
            steady = regions == self.regions.generation  # (else a region changed while it was resolved)
            plan = plan_of(doc, entry, batch, priority, timeout_us, regions if steady else None)
            if plan is not None:
                if len(self._plans) >= PLANS_LIMIT:
                    self._plans.clear()
                self._plans[known[0]] = plan
        return batch, priority, timeout_us, sent_ns

    def _run_local_batches(self, batcher: DynamicBatcher, now: float) -> int:
        """Answer what timed out in our queue, then run every batch that is due (all of them when
        ``now`` is infinite: the worker is stopping). Each finished request counts as drained;
        returns how many finished."""
        expired = batcher.expire(time.monotonic())
        for p in expired:
            self.stats.timed_out()
            self._answer_error(p.entry, 503, "Request timeout expired")
        done = len(expired)
        while len(batcher):
            batch = batcher.next_batch(now)
            if batch is None:
                break
            self._execute([p.entry for p in batch])
            done += len(batch)
        self.stats.counts[DIRECT_DONE] += done
        return done

    def _output(self, client: ClientSegment, o: dict, data_start: int) -> dict:
        out = {"name": o["name"]} if "data" not in o and "region" not in o \
            else self._locate(client, o, data_start, "output")
        if "class" in o:
            out["class"] = o["class"]  # classification: answered as the top classes
        return out

    def _locate(self, client: ClientSegment, t: dict, data_start: int, what: str = "input") -> dict:
        size = int(t["size"])
        if "region" in t:  # a registered region, as the broker published it (shm/region_table.py)
            name = t["region"]
            region = self.regions.get(name)
            off = locate(name, region, int(t.get("offset", 0)), size, what, t["name"])  # RegionUseError: a 400
            assert region is not None
            out = {"name": t["name"], "seg": region.key, "ino": region.ino, "off": off, "size": size}
        else:
            off = data_start + int(t["data"])
            if size < 0 or off < client.arena_offset or off + size > client.seg.size:
                raise RequestError(f"tensor '{t['name']}' lies outside the client's arena")
            out = {"name": t["name"], "seg": client.name, "off": off, "size": size}
        if "datatype" in t:
            out.update(datatype=t["datatype"], shape=t["shape"])
        return out

    def _execute(self, entries: list[dict]) -> None:
        """Run one batch and answer each request; time its phases for the statistics."""
        start = time.monotonic_ns()
        busy = self.seg.stats.scalars
        busy[BUSY_SINCE] = start  # the broker enforces execution_timeout_s against this
        live: list[tuple[dict, Request]] = []
        for entry in entries:
            try:
                live.append((entry, self._build_request(entry)))
            except (RequestError, ValueError, OSError, posix_ipc.Error, CudaError) as e:
                self._answer_error(entry, e.status if isinstance(e, RequestError) else 400, str(e))
                self.stats.rejected()
        built = executed = time.monotonic_ns()
        self._alone = len(live) == 1
        ok: list[bool] = []
        raised = False
        if live:
            try:
                responses = self.instance.execute([r for _, r in live])  # type: ignore[union-attr]
                if self.decoupled:
                    responses = [None] * len(live)  # decoupled models answer through their senders
                elif len(responses) != len(live):
                    raise RuntimeError(f"model returned {len(responses)} responses for {len(live)} requests")
            except Exception as e:  # noqa: BLE001 - model code may raise anything
                executed = time.monotonic_ns()
                raised = True
                msg = f"Failed to process the request(s) for model instance '{self.instance_name}', " \
                      f"message: {type(e).__name__}: {e}"
                log.error("%s\n%s", msg, traceback.format_exc())
                for entry, req in live:
                    if req.sender is not None:
                        req.sender.fail(500, msg)  # counted when the stream finishes
                    else:
                        self._answer_error(entry, 500, msg)
                        ok.append(False)
            else:
                executed = time.monotonic_ns()
                self._phases = (start, built, executed)
                for (entry, req), resp in zip(live, responses):
                    if req.sender is not None:
                        if resp is not None:  # a streaming call to a model that answers once
                            req.sender(resp, final=True)
                        continue
                    if self.sequence is not None and resp.error is None:
                        asked = [o["name"] for o in entry.get("outputs") or ()]
                        self.sequence.capture(resp.outputs, asked, entry.get("corr", 0), entry.get("flags", 0))
                    ok.append(self._answer(entry, resp))
        if live:
            batched = self.signature is not None and self.signature.max_batch_size > 0
            sizes, arrivals, streamed = [], [], 0  # answered here; streamed ones count when they finish
            for entry, req in live:
                size = next(iter(req.inputs.values())).shape[0] if batched and req.inputs else 1
                if req.sender is None:
                    sizes.append(size)
                    arrivals.append(entry.get("t", 0))
                elif not raised:
                    streamed += size
            self.stats.executed(sizes, arrivals, start, built - start, executed - built,
                                time.monotonic_ns() - executed, ok, streamed)
        busy[BUSY_SINCE] = 0

    def stream_finished(self, sender: StreamSender) -> None:
        """A streamed request ended (possibly on another thread): count it."""
        with self.stream_lock:
            self.stats.finished_stream(sender.entry.get("t", 0), not sender.failed)
            self.stats.flush()

    def _flush_counts(self) -> None:
        self.stats.counts[ARENA_BYTES] = self.arena.bytes_in_use
        self.stats.flush()
        custom_metrics.REGISTRY.flush()
        self._send_completions()

    def _build_request(self, entry: dict) -> Request:
        views = entry.get("views")
        inputs = {name: template.view() for name, template in views} if views is not None else self._inputs(entry)
        if self.sequence is not None:
            self.sequence.augment(inputs, entry.get("corr", 0), entry.get("flags", 0))
        wanted = entry.get("outputs")
        # No outputs named: the model is asked for every output its config declares (as Triton).
        names = [o["name"] for o in wanted] if wanted else self.output_names
        sender = None
        if "stream" in entry:
            sender = StreamSender(self, entry)
        elif self.decoupled:
            raise DecoupledOnly()  # reached through the broker
        # (inputs, requested_outputs, id, correlation_id, flags, parameters, sender): by position,
        # a dataclass is built in half the time
        return Request(inputs, names, entry.get("id", ""), entry.get("corr", 0), entry.get("flags", 0),
                       entry.get("params") or {}, sender)

    def _inputs(self, entry: dict) -> dict[str, Any]:
        inputs = {}
        for t in entry["inputs"]:
            off, size = t["off"], t["size"]
            if "cuda" in t:  # device memory of a client: copied to host for the backend
                host = memoryview(bytearray(size))
                cuda_runtime().to_host(host, cuda_runtime().open(base64.b64decode(t["cuda"]), t["device"]) + off)
                inputs[t["name"]] = from_buffer(host, t["datatype"], t["shape"])
                continue
            seg = self.segments.get(t["seg"], t.get("ino", 0), off + size)
            inputs[t["name"]] = from_buffer(seg.buf[off:off + size], t["datatype"], t["shape"])
        return inputs

    def _templates(self, entry: dict) -> list[tuple[str, Any]] | None:
        """Arrays over a kept entry's numeric inputs in its client's block: a rerun's inputs are
        new views of them (a view costs a fifth of building the array again; each request gets its
        own, as a backend may reshape what it is given). None if any input is BYTES (decoded per
        request). (Kept entries name no regions, so every input lies in the client's block.)"""
        if any(t["datatype"] == "BYTES" for t in entry["inputs"]):
            return None
        try:
            return list(self._inputs(entry).items())
        except (ValueError, OSError, posix_ipc.Error):
            return None

    # -- answering ------------------------------------------------------------------------------
    def _forget_departed_clients(self) -> None:
        """Unmap the segments of clients that are gone, so their memory is not pinned here."""
        for name, client in list(self.clients.items()):
            # Gone: the process died, or it closed the connection (which unlinks the segment).
            if not pid_alive(client.pid) or not os.path.exists("/dev/shm" + name):
                if self.batcher is not None and len(self.batcher):
                    queued = len(self.batcher)
                    self.batcher.drop_client(client)
                    self.stats.counts[DIRECT_DONE] += queued - len(self.batcher)
                self._peers.forget(client.pid)
                for key in [key for key in self._kept if key[0] == name]:
                    del self._kept[key]  # (its views would keep the mapping)
                self.clients.pop(name).close()
                self.segments.drop(name)

    def _client(self, name: str) -> ClientSegment:
        client = self.clients.get(name)
        if client is None:
            client = ClientSegment.attach(name)
            self.clients[name] = client
        return client

    def _deliver(self, entry: dict, status: int, doc: bytes, tensors: list[tuple[int, Any]]) -> None:
        """Write one response block (JSON, then tensor bytes), or keep a direct answer to send;
        the client is woken after counting."""
        try:
            client = self._client(entry["client"])
        except (posix_ipc.ExistentialError, ConnectionError):
            return  # the client is gone; nothing to answer
        http = entry.get("http")
        # Not for the answers of a batch: one wake-up of the frontend answers them all, while
        # sending each here would load this process, a batching model's bottleneck.
        if http is not None and self._alone and status == 200 and http[2] == doc:
            # The answer the frontend expected: the HTTP head and JSON header it sent, then the
            # outputs' bytes (binary data, in order: what the frontend would have sent).
            send = DirectSend(http[0], http[1], b"".join([http[3], *[data for _, data in tensors]]), entry, doc, tensors)
            self._notes.append((client, entry["slot"], status, 0, 0, send))
            return
        override, off, total = self._write_block(entry, doc, tensors)
        self._notes.append((client, entry["slot"], override or status, off, total, None))

    def _send_completions(self) -> None:
        """Complete the answered slots, then wake each client once (not once per response).

        Runs after the counters are flushed, so a client that sees its answer also sees it
        counted in the metrics.
        """
        notes, self._notes = self._notes, []
        woken = []
        for client, slot, status, off, total, direct in notes:
            sent = 0 if direct is None else self._peers.write(direct.entry["pid"], direct.fd, direct.ino, direct.data)
            whole = direct is not None and sent == len(direct.data)
            if direct is not None and not whole:
                # Not sent, or only part of it: the frontend answers (the rest) from a block as usual.
                override, off, total = self._write_block(direct.entry, direct.doc, direct.tensors)
                status = override or status
            # (refused: the frontend stops asking, and answers this one itself)
            client.complete(slot, status, ROLE_WORKER, self.num, off, total,
                            SENT_ALL if whole else SENT_REFUSED if sent < 0 else sent, time.monotonic_ns() if whole else 0)
            if whole:
                self.stats.counts[HTTP_DIRECT] += 1
                keep = direct.entry.get("keep")  # type: ignore[union-attr]
                if keep is not None:
                    key = (direct.entry["client"], slot)  # type: ignore[union-attr]
                    if len(self._kept) >= PLANS_LIMIT and key not in self._kept:
                        self._kept.clear()
                    self._kept[key] = keep
                fence()  # our completion before its wake-up word (its ``want_wake``, reversed)
                if not client.wants_wake(slot):
                    continue  # answered in full: the frontend hears of it when it next looks
            if client not in woken:
                woken.append(client)
        for client in woken:
            (self.broker.waker if client.notify_kind == NOTIFY_BROKER else client.waker).notify()

    def _answer_error(self, entry: dict, status: int, message: str) -> None:
        self._deliver(entry, status, orjson.dumps({"error": message}), [])

    def _answer(self, entry: dict, resp: Response) -> bool:
        """Deliver one response; False if it carried (or became) an error."""
        status, doc, tensors = self._encode(entry, resp)
        self._deliver(entry, status, doc, tensors)
        return status == 200

    def _encode(self, entry: dict, resp: Response) -> tuple[int, bytes, list[tuple[int, Any]]]:
        """(status, JSON, tensor chunks) of a response; outputs placed in regions are written now."""
        if resp.error is not None:
            return resp.status, orjson.dumps({"error": resp.error}), []
        wanted = entry.get("outputs")
        if not resp.parameters and "tr" not in entry:
            plain = self._encode_plain(wanted, resp.outputs)
            if plain is not None:
                return plain
        names = [o["name"] for o in wanted] if wanted else list(resp.outputs)
        placed = {o["name"]: o for o in wanted or () if "seg" in o or "cuda" in o}
        classes = {o["name"]: o["class"] for o in wanted if "class" in o} if wanted else {}
        outs, tensors, pos = [], [], 0
        try:
            for name in names:
                if name not in resp.outputs:
                    if self.decoupled:
                        continue  # a streamed response may carry only some outputs
                    raise RequestError(f"output '{name}' was requested but the model did not produce it")
                arr = resp.outputs[name]
                if name in classes:
                    batched = self.signature is not None and self.signature.max_batch_size > 0
                    arr = classify(name, arr, classes[name], batched, self.labels.get(name))
                datatype = _WIRE_TYPES.get(arr.dtype) or _wire_type(arr)
                data = serialize_bytes(arr) if datatype == "BYTES" else byte_view(arr)
                n = len(data)
                desc = _output_desc(name, datatype, arr.shape, n)
                target = placed.get(name)
                if target is not None:
                    if n > target["size"]:
                        raise RequestError(f"shared memory region for output '{name}' holds "
                                           f"{target['size']} bytes but the output needs {n}")
                    if "cuda" in target:
                        ptr = cuda_runtime().open(base64.b64decode(target["cuda"]), target["device"])
                        cuda_runtime().to_device(ptr + target["off"], data)
                    else:
                        seg = self.segments.get(target["seg"], target.get("ino", 0), target["off"] + n)
                        copy_into(seg.buf[target["off"]:target["off"] + n], data)
                    desc["region"] = True
                else:
                    desc["off"] = pos
                    tensors.append((n, data))
                    pos += n
                outs.append(desc)
        except (RequestError, ValueError, TypeError, CudaError, OSError, posix_ipc.Error) as e:
            # OSError/posix_ipc: the segment to write into is gone (its client died): nobody to tell.
            status = 400 if isinstance(e, (RequestError, CudaError, StaleRegion, ClassificationError)) else 500
            return status, orjson.dumps({"error": str(e)}), []
        doc: dict[str, Any] = {"version": self.version, "outputs": outs}
        if resp.parameters:
            doc["params"] = resp.parameters
        if "tr" in entry:  # traced: QUEUE_START (0: direct), COMPUTE_START, _INPUT_END, _OUTPUT_START, _END
            doc["tr"] = [entry["tr"], *self._phases, time.monotonic_ns()]
        return 200, orjson.dumps(doc), tensors

    def _encode_plain(self, wanted: list[dict] | None, outputs: dict[str, Any]
                      ) -> tuple[int, bytes, list[tuple[int, Any]]] | None:
        """``_encode`` of an answer whose outputs all go as numeric bytes behind the document
        (none in a region, none classified, none BYTES), with the document kept for the same
        names, datatypes and shapes: a closed loop's answers all have one shape. None: the full
        way (``_encode``), which also answers what is wrong."""
        if wanted:
            names = []
            for o in wanted:
                if len(o) != 1:
                    return None  # placed in a region, or classified
                names.append(o["name"])
        else:
            names = list(outputs)
        shapes, tensors = [], []
        for name in names:
            arr = outputs.get(name)
            if arr is None:
                return None
            # (a dtype not seen yet, or one without a wire type, takes the full way, which
            # learns it or answers the error)
            datatype = _WIRE_TYPES.get(arr.dtype)
            if datatype is None or datatype == "BYTES":
                return None
            data = byte_view(arr)
            tensors.append((len(data), data))
            shapes.append((name, datatype, arr.shape))
        key = tuple(shapes)
        doc = self._plain_docs.get(key)
        if doc is None:
            outs, pos = [], 0
            for (name, datatype, shape), (n, _) in zip(shapes, tensors):
                desc = _output_desc(name, datatype, shape, n)
                desc["off"] = pos
                outs.append(desc)
                pos += n
            if len(self._plain_docs) >= PLANS_LIMIT:
                self._plain_docs.clear()
            doc = self._plain_docs[key] = orjson.dumps({"version": self.version, "outputs": outs})
        return 200, doc, tensors

    def _write_block(self, entry: dict, doc: bytes, tensors: list[tuple[int, Any]]) -> tuple[int, int, int]:
        """(status override or 0, offset, length) of a response block in our arena; (503, 0, 0) if
        not even an error fits: the slot is completed without a block, which its client reads as
        ``shm.protocol.NO_ROOM`` (no request is left unanswered)."""
        room = manifest_room(len(doc))
        total = room + sum(n for n, _ in tensors)
        off = self.arena.alloc(total, entry["pid"])
        status = 0
        if off < 0:
            doc = orjson.dumps({"error": f"model instance '{self.instance_name}' has no room for a "
                                         f"{total}-byte response in its output arena; retry later"})
            status, tensors = 503, []
            total = manifest_room(len(doc))
            off = self.arena.alloc(total, entry["pid"])
            if off < 0:
                log.error("output arena exhausted; request %s answered 503 without a block", entry.get("id"))
                return 503, 0, 0
        buf = self.seg.seg.buf
        pos = write_manifest(buf, off, doc)
        for n, data in tensors:
            copy_into(buf[pos:pos + n], data)
            pos += n
        return status, off, total

    def close(self) -> None:
        self._peers.close()
        try:
            if self.instance is not None:
                self.instance.finalize()
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


def run(spec: dict[str, Any]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is for the broker to handle
    worker = Worker(spec)

    def stop(signum: int, frame: Any) -> None:
        worker.running = False

    signal.signal(signal.SIGTERM, stop)
    worker.load()
    try:
        worker.serve()
    finally:
        worker.close()
    return 0
