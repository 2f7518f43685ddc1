"""The frontend's part of Triton's trace extension: the endpoints, sampling, and writing records.

The broker owns the settings (server/broker/tracing.py) and publishes them in the trace segment;
each frontend follows them on its loop's tick, and at once when a request finds the published
settings newer than its own (one integer of the trace segment read: a change made through another
frontend applies to the next request here too, as Triton's one process applies it). When
``Tracer.on``, the infer path (asgi.py) samples requests
(a local counter per setting object for ``rate``; the trace count and id under the shared lock,
so they are exact across frontends), stamps the HTTP and request times, lets the worker (and
the broker, for the requests it queues) add theirs to the response, and writes one record when
the response is sent. The gRPC frontend (server/grpc/infer.py) traces ModelInfer calls the same
way, with Triton's GRPC_* names for the frontend's own stamps. Streamed requests (each request
on a ModelStreamInfer stream, HTTP generate and generate_stream: app.py) take the same path,
with a SEND pair for each response (``timed_sends``) and the worker's timestamps on the final
answer (workers/stream.py). See shm/trace.py for the file format and Triton's sources.
"""
from __future__ import annotations

import logging
import threading
import time
from contextlib import aclosing
from typing import Any, AsyncGenerator, TypeVar

import orjson

from shmserve.shm import trace as tr
from shmserve.shm.answer import NO_VERSION, AnswerDescriptor, StepTrace
from shmserve.shm.descriptor import InferRequest
from shmserve.shm.names import pid_alive
from shmserve.shm.trace import FileWriter, TraceShared

log = logging.getLogger("shmserve.trace")
# Positions in Trace.ns. A record names the frontend's own four (RECV_*, SEND_*) HTTP_* or GRPC_*.
(RECV_START, RECV_END, REQUEST_START, QUEUE_START, COMPUTE_START, COMPUTE_INPUT_END,
 COMPUTE_OUTPUT_START, COMPUTE_END, REQUEST_END, RESPONSE_COMPLETE, SEND_START, SEND_END) = range(len(tr.STAMPS))


# A step trace's stamps (shm/answer.py StepTrace), by name.
STEP_STAMP_NAMES = tr.STAMPS[REQUEST_START:REQUEST_END + 1]
T = TypeVar("T")
# The ASGI scope's key for when a request's body began to arrive and was read (asgi.py), while
# tracing is on: the HTTP_RECV stamps of a request Starlette's routes answer (generate).
RECEIVED = "shmserve.received"


class Setting:
    """One setting object as published; ``n`` counts its requests in this process (for rate)."""

    __slots__ = ("slot", "serial", "rate", "file", "fslot", "fserial", "log_frequency", "mode", "url", "otel", "n")

    def __init__(self, doc: dict[str, Any]) -> None:
        self.slot, self.serial = doc["slot"], doc["serial"]
        self.rate = doc["rate"]
        self.file, self.fslot, self.fserial = doc["file"], doc["fslot"], doc["fserial"]
        self.log_frequency = doc["log_frequency"]
        self.mode, self.url = doc["mode"], doc["url"]
        self.otel: tuple[tuple[str, str], ...] = tuple(map(tuple, doc.get("otel") or ()))  # (resource, bsp_...)
        self.n = 0


class Trace:
    """One traced request: its id, setting and timestamps (0: not taken), named by ``names``
    (``tr.STAMPS`` over HTTP, ``tr.GRPC_STAMPS`` over gRPC; the same positions)."""

    __slots__ = ("id", "model", "version", "request_id", "setting", "names", "ns", "sends", "made", "unqueued",
                 "steps")

    def __init__(self, trace_id: int, model: str, setting: Setting, names: tuple[str, ...] = tr.STAMPS) -> None:
        self.id = trace_id
        self.model = model
        self.version: Any = -1
        self.request_id = ""
        self.setting = setting
        self.names = names
        self.ns = [0] * len(names)
        self.sends: list[int] = []  # a streamed request's: start, end, start, end... one pair per response
        self.made: list[int] = []  # and when each of its responses was made (INFER_RESPONSE_COMPLETE)
        self.unqueued = False  # refused before a version's scheduler had it: no record, as in Triton
        self.steps: tuple[StepTrace, ...] = ()  # an ensemble's: its composing models' requests

    def mark(self, req: InferRequest) -> None:
        """Just before the request is submitted: tag it, so the worker times it."""
        req.traced = True
        self.request_id = req.id
        self.ns[REQUEST_START] = req.sent_ns
        self.ns[QUEUE_START] = time.monotonic_ns()  # a direct request queues on the worker's lane now

    def collect(self, answer: AnswerDescriptor) -> None:
        """The answer arrived: the worker's (and the broker's) timestamps, and the version served."""
        self.ns[REQUEST_END] = time.monotonic_ns()
        if answer.version != NO_VERSION:
            self.version = answer.version
        self.unqueued = answer.refused and answer.version == NO_VERSION
        if answer.steps:
            self.steps = answer.steps
        stamps = answer.trace
        if len(stamps) == 5:
            queued, self.ns[COMPUTE_START], self.ns[COMPUTE_INPUT_END], self.ns[COMPUTE_OUTPUT_START], \
                self.ns[COMPUTE_END] = stamps
            if queued:
                self.ns[QUEUE_START] = queued  # the broker queued it

    def responded(self) -> None:
        """The answer's response is made, ready to send (Triton's INFER_RESPONSE_COMPLETE)."""
        self.ns[RESPONSE_COMPLETE] = time.monotonic_ns()

    def sending(self) -> None:
        """A streamed request's response is made, and about to be sent (each has its own
        INFER_RESPONSE_COMPLETE and SEND pair, as Triton's stream handlers record; the fixed
        slots are a single answer's)."""
        now = time.monotonic_ns()
        self.made.append(now)
        self.sends.append(now)

    def sent(self) -> None:
        """The response ``sending`` announced is sent (or, at a stream's end, given up on)."""
        if len(self.sends) % 2:
            self.sends.append(time.monotonic_ns())

    def stamps(self) -> list[tuple[str, int]]:
        """(name, ns) of every timestamp taken, in the order taken: a stream's response sends fall
        between the model's timestamps, as its responses come while the model runs."""
        out = [(name, ns) for name, ns in zip(self.names, self.ns) if ns]
        if self.sends:
            pair = (self.names[SEND_START], self.names[SEND_END])
            out += [(self.names[RESPONSE_COMPLETE], ns) for ns in self.made]
            out += [(pair[i % 2], ns) for i, ns in enumerate(self.sends)]
            out.sort(key=lambda stamp: stamp[1])  # (stable: a response is made, then sent)
        return out

    def record(self) -> bytes:
        try:
            version = int(self.version)
        except (TypeError, ValueError):
            version = -1
        doc: dict[str, Any] = {"id": self.id, "model_name": self.model, "model_version": version}
        if self.request_id:
            doc["request_id"] = self.request_id
        doc["timestamps"] = [{"name": name, "ns": ns} for name, ns in self.stamps()]
        return orjson.dumps(doc)

    def step_spans(self, first_id: int) -> list[tuple[int, str, int, int, list[tuple[str, int]]]]:
        """Its ensemble's steps as OpenTelemetry spans are made of them (server/edge/otel.py)."""
        return [(first_id + i, step.model, step.version, step.parent,
                 [(name, ns) for name, ns in zip(STEP_STAMP_NAMES, step.stamps) if ns])
                for i, step in enumerate(self.steps)]

    def step_records(self, first_id: int) -> list[bytes]:
        """The records of its ensemble's steps, ids from ``first_id`` on, each a child of this
        trace (or of the nested ensemble step that made it) by its ``parent_id``, as Triton writes
        a composing model's request."""
        out = []
        for step_id, model, version, parent, stamps in self.step_spans(first_id):
            doc: dict[str, Any] = {"id": step_id, "model_name": model, "model_version": version}
            if self.request_id:
                doc["request_id"] = self.request_id
            doc["parent_id"] = self.id if parent < 0 else first_id + parent
            doc["timestamps"] = [{"name": name, "ns": ns} for name, ns in stamps]
            out.append(orjson.dumps(doc))
        return out


class Tracer:
    def __init__(self, server_id: str) -> None:
        self.server_id = server_id
        self._on = False
        self.shared: TraceShared | None = None
        self.global_: Setting | None = None  # None: OFF
        self.models: dict[str, Setting | None] = {}
        self._gen = -1
        self._stuck = False  # the shared lock stayed taken: no tracing until the settings change
        self._lock = threading.Lock()
        self._writer: FileWriter | None = None
        self._otel: Any = None

    # -- following the broker's settings -------------------------------------------------------------
    def start(self) -> None:
        self.refresh()

    def stop(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._otel is not None:
            self._otel.close()

    @property
    def on(self) -> bool:
        """Whether requests are sampled here: what every request reads. Settings published since
        this frontend last read them are followed first, so that a change made through another
        frontend (the gRPC one, another HTTP worker) is not left to this one's next tick: until
        then its stale setting objects would claim no trace, and requests would go untraced."""
        shared = self.shared
        if shared is not None and shared.doc.generation() != self._gen:
            self.follow()
        return self._on

    def follow(self) -> None:
        """The frontend's periodic look at the broker's settings (on its loop's tick, twice a
        second: no thread of its own to wake)."""
        try:
            self.refresh()
        except Exception:  # noqa: BLE001 - the broker is restarting: try again later
            log.debug("trace settings not readable yet", exc_info=True)

    def refresh(self) -> None:
        with self._lock:
            shared = self.shared
            if shared is not None and not pid_alive(shared.pid):
                self._on, self.shared, self._gen, self._stuck = False, None, -1, False  # its broker is gone
                shared = None
            if shared is None:
                try:
                    shared = TraceShared.attach(self.server_id)
                except Exception:  # noqa: BLE001 - no broker yet
                    return
                self.shared = shared
            if shared.doc.generation() == self._gen:
                return
            gen, raw = shared.doc.read()
            if not raw:
                return
            doc = orjson.loads(raw)
            old = {s.serial: s for s in (self.global_, *self.models.values()) if s is not None}

            def setting(d: dict[str, Any]) -> Setting | None:
                if d["level"] == "OFF" or (d["mode"] == "triton" and not d["file"]):
                    return None
                return old.get(d["serial"]) or Setting(d)

            self.global_ = setting(doc["global"])
            self.models = {m: setting(d) for m, d in doc["models"].items()}
            self._gen = gen
            self._stuck = False  # a settings change took the lock over (see TraceShared.take_over)
            self._on = self.global_ is not None or any(s is not None for s in self.models.values())

    # -- per request ----------------------------------------------------------------------------------
    def sample(self, model: str, names: tuple[str, ...] = tr.STAMPS) -> Trace | None:
        setting = self.models[model] if model in self.models else self.global_
        shared = self.shared
        if setting is None or shared is None:
            return None
        setting.n += 1
        if setting.n % setting.rate:
            return None
        trace_id = shared.claim(setting.slot, setting.serial)
        if trace_id < 0:
            if not self._stuck:
                log.error("the trace lock stayed taken (a process died holding it?); tracing pauses until "
                          "the trace settings change")
            self._stuck, self._on = True, False
            return None
        return Trace(trace_id, model, setting, names) if trace_id else None

    def finish(self, trace: Trace) -> None:
        """Write the record (or export the span) of a request whose response has been sent."""
        setting, shared = trace.setting, self.shared
        if trace.unqueued:
            return
        try:
            first = shared.child_ids(len(trace.steps)) if trace.steps and shared is not None else 0  # its steps' ids
            if setting.mode == "opentelemetry":
                self._exporter(setting.url, setting.otel).export(trace.id, trace.model, trace.version, trace.stamps(),
                                                   trace.step_spans(first) if first else ())
                return
            if shared is None:
                return
            if self._writer is None or self._writer.shared is not shared:
                if self._writer is not None:
                    self._writer.close()
                self._writer = FileWriter(shared)
            records = trace.step_records(first) if first else []
            # One trace with its children, as Triton writes them: log_frequency counts it once.
            group = b",\n".join((*records, trace.record()))
            self._writer.write(setting.fslot, setting.fserial, setting.file, setting.log_frequency, group)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            log.exception("cannot write trace %d", trace.id)

    def _exporter(self, url: str, settings: tuple[tuple[str, str], ...]) -> Any:
        if self._otel is None or (self._otel.url, self._otel.settings) != (url, settings):
            from .otel import OtelExporter

            if self._otel is not None:
                self._otel.close()
            self._otel = OtelExporter(url, settings)
        return self._otel


async def timed_sends(messages: AsyncGenerator[T, None], trace: Trace, tracer: Tracer) -> AsyncGenerator[T, None]:
    """A traced stream's ``messages`` as they are sent, each send timed (the server asks for the
    next message once the last one is sent: gRPC's stream handler and Starlette's streaming
    response both do); the trace is written when the stream ends, however it ends (its last
    message sent, the client gone, an error status)."""
    try:
        async with aclosing(messages):
            async for message in messages:
                trace.sending()
                yield message
                trace.sent()
    finally:
        trace.sent()  # a send the stream ended in the middle of
        tracer.finish(trace)
