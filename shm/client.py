"""The local client library: call models of a server on this host through shared memory, with no
HTTP and no copy of tensor bytes where the caller's data already lives in shm.

    from shmserve import Client
    with Client("shmserve") as client:                 # the server's --id
        result = client.infer("add_sub", {"INPUT0": a, "INPUT1": b})
        print(result["OUTPUT0"])

Inputs are numpy arrays (or CPU torch tensors). An array that lies in a region this client created
or registered travels by reference; any other array is copied once into the connection's arena.
Outputs land, without a copy, in room reserved in the request's own block when their size is
known from the model's config, in a region the caller names, or else in the worker's arena; the
result's arrays are views valid while the result (or any of its arrays) is alive.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import math
import os
import queue
import threading
from collections.abc import Mapping
from typing import Any, Iterator

import numpy as np
import posix_ipc

from .answer import DECOUPLED_REFUSAL, AnswerDescriptor, ErrorCode
from .completion import Answer, Completion
from . import control_messages as control
from .connection import DEFAULT_POLL_US, Backpressure, Connection, NoServer, RequestTooLarge, ServerUnavailable
from .liveness import running_servers
from .descriptor import SEQUENCE_END, SEQUENCE_START, InferRequest, InputTensor, RequestedOutput
from .protocol import REQ_CONTROL
from .regions import Region, created_key_prefix, find_shm_mapping
from .results import InferResult
from .streams import Stream, StreamEvents
from .tensors import CONFIG_TO_WIRE, DTYPES, byte_view, from_buffer, serialize_bytes, wire_datatype

__all__ = ["Client", "InferResult", "InferenceServerError", "ErrorCode", "Region", "ServerUnavailable", "Backpressure",
           "RequestTooLarge"]


# A decoupled model called with ``infer`` (which takes one answer) is refused (501) so.
DECOUPLED_ONLY = ("this model uses the decoupled transaction policy: call it with Client.stream() or stream_aio(), "
                  "which take each of its responses, not with infer()")

class InferenceServerError(Exception):
    """The server refused or failed the call; ``status`` is the HTTP-equivalent status code, and
    ``code`` the code of an error the model answered itself (``ErrorCode``; None for the
    server's own errors)."""

    def __init__(self, status: int, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code

    def __reduce__(self) -> tuple:
        """Picklable as its three fields (a pool of processes hands errors back pickled)."""
        return type(self), (self.status, self.message, self.code)


class _Plan:
    """What one request reserved in its own block, to turn the response into arrays."""

    __slots__ = ("reserved", "given")

    def __init__(self) -> None:
        self.reserved: dict[str, int] = {}  # output -> offset relative to the data start
        self.given: dict[str, np.ndarray] = {}  # output -> caller's array in a region


class Client:
    """A connection to the server ``server_id`` on this host. ``poll_us``: how long, in
    microseconds, a synchronous call polls for its answer before it sleeps while answers come
    quickly (its requests then ask the worker to poll for the next one too); 0 never polls."""

    def __init__(self, server_id: str = "shmserve", arena_bytes: int = 64 << 20,
                 poll_us: int = DEFAULT_POLL_US) -> None:
        if poll_us < 0:
            raise ValueError(f"poll_us must be 0 or more (got {poll_us})")
        try:
            self._conn = Connection(server_id, arena_bytes=arena_bytes, poll_us=poll_us)
        except NoServer as e:
            # A wrong id is the usual cause (the default 'shmserve' for a server started with --id):
            # say which run here. (Only a local program is told: a frontend's 503 names no other server.)
            others = [i for i in running_servers() if i != server_id]
            if not others:
                raise
            raise NoServer(f"{e} (running here: {', '.join(repr(i) for i in others)}; pass the server's --id)") from None
        self._regions: dict[str, Region] = {}
        self._configs: dict[tuple[str, str], tuple[int, dict]] = {}  # -> (routes' generation, config)
        self._lock = threading.Lock()
        self._pid = os.getpid()
        _open_clients.add(self)

    # -- plumbing -------------------------------------------------------------------------------
    def _call(self, submit: Any, convert: Any) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def done(completion: Completion) -> None:
            try:
                fut.set_result(convert(completion))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                completion.release()
                fut.set_exception(e)

        submit(done)
        return fut

    @staticmethod
    def _check(completion: Completion) -> AnswerDescriptor:
        """The answer, or its error raised (a decoupled model's refusal of ``infer`` in this
        library's words, where the server says it in its HTTP frontend's)."""
        answer = completion.answer
        if completion.status != 200:
            error = answer.error or "request failed"
            raise InferenceServerError(completion.status, DECOUPLED_ONLY if error == DECOUPLED_REFUSAL else error,
                                       answer.code)
        return answer

    def _control(self, message: control.ControlMessage) -> Any:
        def convert(c: Completion) -> Any:
            try:
                return self._check(c).control_document()
            finally:
                c.release()

        fut = self._call(lambda cb: self._conn.submit(REQ_CONTROL, message, (), cb, waited=True), convert)
        self._conn.wait_for(fut.done, fut.exception)
        return fut.result()

    # -- health and metadata --------------------------------------------------------------------
    def is_server_ready(self) -> bool:
        return bool(self._control(control.ServerReady())["ready"])

    def is_model_ready(self, model: str, version: str | int = "") -> bool:
        return bool(self._control(control.ModelReady(model, str(version)))["ready"])

    def model_metadata(self, model: str, version: str | int = "") -> dict:
        return self._control(control.ModelMetadata(model, str(version)))

    def model_config(self, model: str, version: str | int = "") -> dict:
        """The model's config (Triton's JSON form), kept while the broker's routing table stays
        as it was: a reload (a new config, its outputs' sizes) publishes a new one."""
        key = (model, str(version))
        generation = self._conn.broker.routes.generation()  # (read first: a change meanwhile refetches)
        kept = self._configs.get(key)
        if kept is None or kept[0] != generation:
            kept = self._configs[key] = (generation, self._control(control.ModelConfig(model, str(version))))
        return kept[1]

    def model_statistics(self, model: str = "", version: str | int = "") -> dict:
        """The statistics extension's answer (``{"model_stats": [...]}``, as HTTP's
        ``/v2/models/<model>/stats``): every loaded version, one model's, or one version's."""
        return self._control(control.ModelStatistics(model, str(version)))

    # -- regions --------------------------------------------------------------------------------
    def create_region(self, name: str, byte_size: int) -> Region:
        """A new shm region owned by this client, registered under ``name``. Its object goes when
        the client closes, when the process exits, or (unlinked by the server) when it dies."""
        try:
            region = Region.create(name, byte_size, created_key_prefix(self._conn.ticket) + name, self._conn.readers)
        except posix_ipc.ExistentialError:  # (a client of this process made one of that name)
            raise InferenceServerError(409, f"shared memory region '{name}' already in manager") from None
        try:
            self._control(control.RegisterSystemRegion(name, region.key, byte_size, created=True))
        except BaseException:
            region.close()
            raise
        with self._lock:
            self._regions[name] = region
        return region

    def register_array(self, name: str, array: Any) -> Region:
        """Register the shm an existing array or CPU torch tensor lives in (e.g. one made with
        ``multiprocessing.shared_memory``, or a torch tensor shared under the 'file_system'
        strategy) and return its region. The object must still have a name in /dev/shm."""
        arr = _as_numpy(array)
        found = find_shm_mapping(arr.__array_interface__["data"][0])
        if found is None:
            raise ValueError("the array does not live in a POSIX shared-memory object (/dev/shm)")
        key, offset = found
        self._control(control.RegisterSystemRegion(name, key, arr.nbytes, offset))
        region = Region(name, key, arr.nbytes, None, owner=False, offset=offset)
        region.buf = memoryview(arr.reshape(-1).view(np.uint8))
        with self._lock:
            self._regions[name] = region
        return region

    def unregister_region(self, name: str) -> None:
        self._control(control.UnregisterSystemRegion(name))
        with self._lock:
            region = self._regions.pop(name, None)
        if region is not None:
            region.close()

    def _region_ref(self, arr: np.ndarray) -> tuple[str, int] | None:
        with self._lock:  # (another thread may register or unregister meanwhile)
            regions = list(self._regions.items())
        for name, region in regions:
            off = region.locate(arr)
            if off is not None:
                return name, off
        return None

    # -- inference ------------------------------------------------------------------------------
    def _build(self, model: str, inputs: Mapping[str, Any], outputs: Any, version: str,
               options: dict) -> tuple[InferRequest, list, int, _Plan]:
        """The request descriptor, the tensors to copy, the room reserved for outputs and the plan
        to read them back."""
        config = self.model_config(model, version)
        doc_inputs: list[InputTensor] = []
        chunks: list = []
        rel = 0
        batch = None
        for name, value in inputs.items():
            arr = _as_numpy(value)
            datatype = wire_datatype(arr)
            if batch is None and arr.ndim:
                batch = arr.shape[0]
            ref = self._region_ref(arr) if datatype != "BYTES" else None
            if ref is not None:
                doc_inputs.append(InputTensor(name, datatype, list(arr.shape), arr.nbytes, region=ref[0],
                                              offset=ref[1]))
            else:
                data = serialize_bytes(arr) if datatype == "BYTES" else np.ascontiguousarray(arr)
                size = len(data) if datatype == "BYTES" else data.nbytes
                doc_inputs.append(InputTensor(name, datatype, list(arr.shape), size, rel))
                chunks.append(data)
                rel += size
        plan = _Plan()
        doc_outputs: list[RequestedOutput] = []
        if isinstance(outputs, Mapping):
            wanted = list(outputs)
        elif outputs is None:
            wanted = [o["name"] for o in config.get("output", [])]
        else:
            wanted = list(outputs)
        out_cfg = {o["name"]: o for o in config.get("output", [])}
        reserve = 0
        for name in wanted:
            target = outputs.get(name) if isinstance(outputs, Mapping) else None
            if target is not None:
                arr = _as_numpy(target)
                ref = self._region_ref(arr)
                if ref is None:
                    raise ValueError(f"output '{name}': the destination array is not in a registered region")
                doc_outputs.append(RequestedOutput(name, region=ref[0], offset=ref[1], size=arr.nbytes))
                plan.given[name] = arr
                continue
            size = _known_size(out_cfg.get(name), config.get("max_batch_size", 0), batch)
            if size:
                pos = (rel + reserve + 63) & ~63
                reserve = pos - rel + size
                doc_outputs.append(RequestedOutput(name, size=size, data=pos))
                plan.reserved[name] = pos
            else:
                doc_outputs.append(RequestedOutput(name))
        # (a caller may name the version as a number, as the server accepts it)
        request = InferRequest(model, str(version or ""), doc_inputs, doc_outputs or None, **options)
        return request, chunks, reserve, plan

    def _submit_infer(self, model: str, inputs: Mapping[str, Any], outputs: Any, version: str,
                      options: dict, deliver: Any, on_response: Any = None) -> int:
        """Send the request; returns where its tensor bytes start (what ``Connection.cancel`` takes)."""
        doc, chunks, reserve, plan = self._build(model, inputs, outputs, version, options)
        box: dict[str, int] = {}
        ready = threading.Event()

        def on_done(completion: Completion) -> None:
            ready.wait()  # the data start is known once submit returned
            deliver(completion, plan, box["start"])

        streamed = None
        if on_response is not None:
            plan.reserved.clear()  # streamed responses each carry their own outputs
            doc.outputs = [RequestedOutput(o.name) for o in doc.outputs or ()] or None
            reserve = 0

            def streamed(completion: Completion) -> None:
                ready.wait()
                on_response(completion, plan, box["start"])

        box["start"] = self._conn.infer(doc, chunks, on_done, reserve, streamed)
        ready.set()
        return box["start"]

    def _result(self, completion: Completion, plan: _Plan, start: int) -> InferResult:
        answer = self._check(completion)
        arrays: dict[str, np.ndarray] = {}
        kept: set[str] = set()
        own = self._conn.seg.seg.buf
        for o in answer.outputs:
            name, datatype, shape = o.name, o.datatype, o.shape
            if name in plan.given:
                given = plan.given[name]
                if list(given.shape) == list(shape) and datatype != "BYTES" and given.dtype == DTYPES.get(datatype):
                    arrays[name] = given  # (the caller's own array, filled in place)
                else:  # what the server wrote there, as it says it wrote it (as tritonclient reads it)
                    arrays[name] = from_buffer(byte_view(given)[:o.size], datatype, shape)
                continue
            if o.in_region:
                if name not in plan.reserved:
                    raise InferenceServerError(500, f"the server placed output '{name}' where none was reserved")
                at = start + plan.reserved[name]
                view = own[at:at + o.size]
            else:
                view = completion.tensor(o)
            arrays[name] = from_buffer(view, datatype, shape)
            if datatype != "BYTES":  # BYTES outputs are copies of their own
                kept.add(name)
        return InferResult(completion, answer, arrays, frozenset(kept))

    def _read(self, completion: Completion, plan: _Plan, start: int) -> InferResult:
        """A synchronous call's result (its blocks given back if reading it fails)."""
        try:
            return self._result(completion, plan, start)
        except BaseException:
            completion.release()
            raise

    def infer_async(self, model: str, inputs: Mapping[str, Any], outputs: Any = None, *, version: str = "",
                    request_id: str = "", parameters: dict | None = None, sequence_id: int | str = 0,
                    sequence_start: bool = False, sequence_end: bool = False, priority: int = 0,
                    timeout: int = 0, _traced: bool = False) -> concurrent.futures.Future:
        """Submit now; the future resolves to an ``InferResult`` (or raises InferenceServerError).
        ``future.cancel()`` cancels the request on the server (Triton's semantics: dropped if it
        has not run, ``is_cancelled()`` for a model running it; its answer is given back unread).
        (``_traced``: the answer carries the request's trace stamps, for a traced model's BLS call.)"""
        options = _options(request_id, parameters, sequence_id, sequence_start, sequence_end, priority, timeout)
        options["traced"] = _traced
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def deliver(completion: Completion, plan: _Plan, start: int) -> None:
            if fut.cancelled():
                completion.release()
                return
            try:
                result = self._result(completion, plan, start)
            except BaseException as e:  # noqa: BLE001
                completion.release()
                if not fut.cancelled():
                    fut.set_exception(e)
                return
            try:
                fut.set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile: the result goes unread
                result.release()

        start = self._submit_infer(model, inputs, outputs, version, options, deliver)
        conn = self._conn
        fut.add_done_callback(lambda f: conn.cancel(start) if f.cancelled() else None)
        return fut

    def infer(self, model: str, inputs: Mapping[str, Any], outputs: Any = None, *, version: str = "",
              request_id: str = "", parameters: dict | None = None, sequence_id: int | str = 0,
              sequence_start: bool = False, sequence_end: bool = False, priority: int = 0,
              timeout: int = 0, client_timeout: float | None = None) -> InferResult:
        """Call and wait. The answer is taken on this thread when no other leads the connection's
        waiting (see Connection.wait_for): no future, event or thread hand-off on the way.

        ``timeout`` is Triton's: microseconds the server may queue the request. ``client_timeout``
        (seconds, as in tritonclient's gRPC ``infer``) bounds the caller's own wait: past it the
        call raises a 504 "Deadline Exceeded" and the request is cancelled on the server (see
        ``infer_async``)."""
        if client_timeout is not None:
            return self._infer_within(client_timeout, model, inputs, outputs, version=version,
                                      request_id=request_id, parameters=parameters, sequence_id=sequence_id,
                                      sequence_start=sequence_start, sequence_end=sequence_end,
                                      priority=priority, timeout=timeout)
        options = _options(request_id, parameters, sequence_id, sequence_start, sequence_end, priority, timeout)
        doc, chunks, reserve, plan = self._build(model, inputs, outputs, version, options)
        answer = Answer()
        start = self._conn.infer(doc, chunks, answer, reserve, waited=True)
        try:
            self._conn.wait_for(answer.done, answer.wait)
        except BaseException:  # interrupted (Ctrl-C): the request is cancelled, its answer freed unread
            try:
                self._conn.cancel(start)
            finally:
                answer.abandon()
            raise
        assert answer.completion is not None
        return self._read(answer.completion, plan, start)

    def _infer_within(self, client_timeout: float, model: str, inputs: Mapping[str, Any], outputs: Any,
                      **options: Any) -> InferResult:
        """``infer`` with a deadline for the caller: through a future, which holds a late answer
        until it is dropped (``InferResult`` gives its blocks back when it goes)."""
        if not client_timeout >= 0:
            raise ValueError(f"client_timeout must be a number of seconds, at least 0 (got {client_timeout!r})")
        future = self.infer_async(model, inputs, outputs, **options)
        try:
            return future.result(timeout=client_timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise InferenceServerError(504, f"Deadline Exceeded: no answer from '{model}' within "
                                            f"{client_timeout} s (the request was cancelled)") from None

    async def infer_aio(self, model: str, inputs: Mapping[str, Any], outputs: Any = None, **kwargs: Any) -> InferResult:
        """The asyncio form: awaits without blocking the loop (the model's config, which a call
        needs first, is fetched off the loop when it is not known yet)."""
        await self._config_off_loop(model, kwargs.get("version", ""))
        return await asyncio.wrap_future(self.infer_async(model, inputs, outputs, **kwargs))

    async def _config_off_loop(self, model: str, version: str | int) -> None:
        """Fetch ``model``'s config in a thread unless it is known (``model_config``): a call to
        the broker, which may be busy (loading models, say), must not hold the caller's loop."""
        kept = self._configs.get((model, str(version)))
        if kept is None or kept[0] != self._conn.broker.routes.generation():
            await asyncio.get_running_loop().run_in_executor(None, self.model_config, model, version)

    def stream(self, model: str, inputs: Mapping[str, Any], outputs: Any = None, *, version: str = "",
               request_id: str = "", parameters: dict | None = None, sequence_id: int | str = 0,
               sequence_start: bool = False, sequence_end: bool = False, priority: int = 0,
               timeout: int = 0, wait_s: float | None = None) -> Iterator[InferResult]:
        """Call a decoupled model: the request is sent now; the iterator yields each of its
        responses as it arrives (zero or more).

        An error response raises InferenceServerError and ends the stream. A caller that stops
        early (``break``, ``close()`` or ``cancel()``) cancels the request: its model sees
        ``is_cancelled()`` and may stop; what the stream holds and still sends is freed.
        """
        options = _options(request_id, parameters, sequence_id, sequence_start, sequence_end, priority, timeout)
        events = StreamEvents(queue.Queue())
        start = self._submit_infer(model, inputs, outputs, version, options,
                                   lambda c, plan, start: events.put(True, c, (plan, start)),
                                   lambda c, plan, start: events.put(False, c, (plan, start)))
        events.request = (self._conn, start)
        return Stream(events, self._stream_results(events, wait_s))

    def _stream_results(self, events: StreamEvents, wait_s: float | None) -> Iterator[InferResult]:
        """The results of ``events``; a reader that stops early (a ``break``, an error, ``close``)
        frees what the stream still holds and what it still sends (shm/streams.py)."""
        try:
            while True:
                final, completion, (plan, start) = events.events.get(timeout=wait_s)
                if final:
                    self._end_stream(completion)
                    return
                yield self._read(completion, plan, start)
        finally:
            events.close()

    def _end_stream(self, completion: Completion) -> None:
        """The final completion of a stream: raise if the request failed as a whole."""
        try:
            if completion.status != 200:
                self._check(completion)
        finally:
            completion.release()

    async def stream_aio(self, model: str, inputs: Mapping[str, Any], outputs: Any = None,
                         **kwargs: Any) -> Any:
        """The asyncio form of ``stream``: an async iterator of results."""
        loop = asyncio.get_running_loop()
        # The callbacks run on the connection's waiter thread. They queue each event themselves and
        # only wake the loop: an event handed to the loop instead would be lost, never released,
        # if the loop closed before running it (asyncio.run() ending with the stream left early).
        events = StreamEvents(queue.Queue())
        arrived = asyncio.Event()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(arrived.set)
            except RuntimeError:  # the loop is closed: the reader is gone, and close() frees the queue
                pass

        def on_event(final: bool) -> Any:
            def put(c: Completion, p: Any, s: Any) -> None:
                events.put(final, c, (p, s))
                wake()
            return put

        options = _options(kwargs.pop("request_id", ""), kwargs.pop("parameters", None),
                           kwargs.pop("sequence_id", 0), kwargs.pop("sequence_start", False),
                           kwargs.pop("sequence_end", False), kwargs.pop("priority", 0), kwargs.pop("timeout", 0))
        version = kwargs.pop("version", "")
        if kwargs:  # (a misspelt option must not be dropped without a word)
            raise TypeError(f"stream_aio() got unexpected keyword argument(s) {sorted(kwargs)}")
        await self._config_off_loop(model, version)
        start = self._submit_infer(model, inputs, outputs, version, options, on_event(True), on_event(False))
        events.request = (self._conn, start)
        try:
            while True:
                try:
                    final, completion, (plan, start) = events.events.get_nowait()
                except queue.Empty:
                    arrived.clear()
                    if events.events.empty():  # (an event queued since is announced by a later set)
                        await arrived.wait()
                    continue
                if final:
                    self._end_stream(completion)
                    return
                yield self._read(completion, plan, start)
        finally:
            events.close()

    def close(self) -> None:
        _open_clients.discard(self)
        if self._pid != os.getpid():
            return  # inherited through fork(): the parent's to close (its regions too)
        for name in list(self._regions):
            region = self._regions.pop(name)
            try:
                if self._conn.alive:
                    self._control(control.UnregisterSystemRegion(name))
            except (InferenceServerError, ServerUnavailable):
                pass
            region.close()
        self._conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_open_clients: "set[Client]" = set()  # not weak: an unclosed connection lives on in its waiter thread anyway


@atexit.register
def _close_at_exit() -> None:
    """A program that never closed its clients still leaves nothing in /dev/shm: its regions'
    objects are unlinked and its connections say goodbye (the server drops what they held).
    Not ``close()``: its unregister calls would wait on a server that may already be gone."""
    for client in list(_open_clients):
        if client._pid != os.getpid():
            continue  # inherited through fork(): the parent's to close, not this child's
        for region in client._regions.values():
            region.close()
        client._regions.clear()
        client._conn.close()


def _as_numpy(value: Any) -> np.ndarray:
    """A numpy view of an input or output array: numpy's, a CPU torch tensor's (bfloat16 ones as
    ml_dtypes' bfloat16, which numpy lacks and ``Tensor.numpy`` refuses), else ``np.asarray``."""
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor (CPU)
        value = value.detach()
        if str(value.dtype) == "torch.bfloat16":
            import torch  # (imported already: the caller made the tensor)

            return value.view(torch.int16).numpy().view(DTYPES["BF16"])
        return value.numpy()
    return np.asarray(value)


def _known_size(cfg: dict | None, max_batch_size: int, batch: int | None) -> int:
    """Bytes an output will take, when its config fixes every dimension (0 if unknown)."""
    if not cfg:
        return 0
    datatype = CONFIG_TO_WIRE.get(cfg.get("data_type", ""), "")
    if not datatype or datatype == "BYTES":
        return 0
    dims = list(cfg.get("dims") or [])
    if max_batch_size > 0:
        if batch is None:
            return 0
        dims = [batch] + dims
    if not dims or any(d < 0 for d in dims):
        return 0
    return math.prod(dims) * DTYPES[datatype].itemsize


def _options(request_id: str, parameters: dict | None, sequence_id: int | str, start: bool, end: bool,
             priority: int, timeout: int) -> dict[str, Any]:
    """``InferRequest``'s fields for a call's options (``timeout``: Triton's, in microseconds)."""
    return {"id": request_id, "parameters": parameters or None, "sequence_id": sequence_id or 0,
            "sequence_flags": (SEQUENCE_START if start else 0) | (SEQUENCE_END if end else 0),
            "priority": priority, "timeout_us": timeout}
