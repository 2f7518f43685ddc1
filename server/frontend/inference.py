"""The frontend's inference path: parse a POST .../infer, submit it to the broker, answer it.

Every request the HTTP protocol takes itself (protocol.py) runs through here, so this module is
compiled with mypyc (compiled-modules.txt) while the rest of the app, Starlette's routes and
their coroutines, stays interpreted (mypyc does not compile async generators). ``Frontend`` in
app.py holds one ``Inference`` and hands it the infer requests that reach the ASGI app too.
"""
from __future__ import annotations

import gzip
import logging
import time
import zlib
from typing import Any, Callable

import orjson

from shmserve.shm.connection import Completion, Connection
from shmserve.shm.protocol import REQ_CONTROL, REQ_INFER, SENT_ALL, SENT_REFUSED

from .codec import BadRequest, build_response
from .ingest import BodyIngest
from .known import JSON_HEADER, Known, KnownRequests, answer_headers
from .link import BrokerError, BrokerLink

log = logging.getLogger("shmserve.frontend")
# reply(status, body, headers, sent=0) of one inference (a large body is a memoryview:
# shm/copying.joined); ``sent`` bytes of the whole answer (its HTTP head, then the body) are already
# on the client's connection (a worker's direct answer; SENT_ALL: all of it)
Reply = Callable[..., None]
RERUN_REFUSED = -2  # ``Inference.rerun``: the broker refused the request (answered); the last one is over


class Parked:
    """A request sent with a direct trailer, as ``Inference.rerun`` needs it: its connection to
    the broker, the HTTP connection's socket, its kept header and trailer, and its send time."""

    __slots__ = ("conn", "socket", "model", "version", "known", "direct", "sent_ns")

    def __init__(self, conn: Connection | None, socket: tuple[int, int], model: str, version: str, known: Known,
                 sent_ns: int) -> None:
        self.conn = conn
        self.socket = socket
        self.model = model  # (a header may be kept for two models with the same inputs)
        self.version = version
        self.known = known
        self.direct = known.direct  # the answer it expected (the trailer's contents)
        self.sent_ns = sent_ns
Trace = Any  # tracing.Trace (interpreted; it imports app, which imports this module)


def _decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    if not encoding or encoding == "identity":
        return body
    try:
        if encoding == "gzip":
            d = zlib.decompressobj(16 + zlib.MAX_WBITS)
        elif encoding == "deflate":
            d = zlib.decompressobj()
        else:
            raise BadRequest(f"unsupported Content-Encoding '{encoding}'")
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise BadRequest(f"failed to decompress the request body ({encoding}): {e}") from None
    if len(out) > limit:
        raise BadRequest(f"the decompressed request body exceeds the {limit}-byte limit")
    return out


def too_large(size: int, limit: int) -> BadRequest:
    return BadRequest(f"the request body of {size} bytes exceeds the maximum allowed value of {limit} bytes; "
                      f"use --http-max-input-size to increase the threshold")


def _compress(body: bytes | memoryview, accept: str | None) -> tuple[bytes | memoryview, str | None]:
    if not accept:
        return body, None
    accepted = [a.split(";")[0].strip() for a in accept.split(",")]
    if "gzip" in accepted:
        return gzip.compress(body, compresslevel=1), "gzip"
    if "deflate" in accepted:
        return zlib.compress(body, 1), "deflate"
    return body, None


class Inference:
    """One frontend's infer requests: the limits they are checked against, the kept headers
    (known.py) and the broker link they go out on, and whether workers may answer directly."""

    def __init__(self, link: BrokerLink, known: KnownRequests, max_input_bytes: int, max_tensor_elements: int,
                 arena_bytes: int) -> None:
        self.link = link
        self.known = known  # parsed inference headers by their bytes (known.py)
        self.max_input_bytes = max_input_bytes
        self.max_tensor_elements = max_tensor_elements
        # Tensor bytes beyond this can never fit the frontend's arena: a client error, not a 503.
        self.max_request_bytes = arena_bytes - (64 << 10)
        # of the last two requests workers could have answered (``_several_clients``)
        self._last_socket: tuple[int, int] | None = None
        self._prior_socket: tuple[int, int] | None = None
        self.direct_refused = False  # a worker was refused our clients' sockets (shm/peer_fds.py)
        self._parked: dict[int, Parked] = {}  # by slot: the last request sent there with a direct trailer

    def start(self, model: str, version: str, headers: dict[bytes, bytes], body: bytes, reply: Reply,
                    trace: Trace | None = None, socket: tuple[int, int] | None = None) -> int:
        """Parse and submit one inference; ``reply(status, body, headers, sent)`` runs on the loop when it
        is answered (at once for a bad request). The hot path: no framework objects, no task, no future.

        ``socket``: (descriptor, inode) of the HTTP connection's socket, if the worker may write a
        successful answer to it itself (``sent`` bytes of it then); returns the request's slot if it
        may, else -1."""
        received = time.monotonic_ns()  # the request's duration in the statistics starts here
        try:
            if len(body) > self.max_input_bytes:
                raise too_large(len(body), self.max_input_bytes)
            encoding = headers.get(b"content-encoding")
            if encoding:
                body = _decompress(body, encoding.decode("latin-1").strip().lower(), self.max_input_bytes)
            header_len = headers.get(b"inference-header-content-length")
            doc, req, chunks, known = self.known.parse(model, version, body, header_len.decode("latin-1")
                                                       if header_len is not None else None, self.max_tensor_elements)
            size = known.size if known is not None else sum(len(c) for c in chunks)
            if size > self.max_request_bytes:
                raise BadRequest(f"the request's {size} bytes of tensor data exceed the frontend's shared-memory "
                                 f"arena (--frontend-arena-mb); send large tensors through shared memory")
        except BadRequest as e:
            self._refuse(model, version, e, reply)
            return -1
        finish = lambda completion: self._finish(  # noqa: E731
            model, version, doc, headers, completion, reply, trace, known)
        try:
            if known is not None and trace is None:  # a header seen before: its descriptor's bytes are kept
                if socket is not None and known.direct and not self.direct_refused and self._several_clients(socket):
                    slot = self.link.submit_prepared(known.prefix, known.route, chunks, size, finish, model, received,
                                                     known.direct_trailer(*socket))
                    self._parked[slot] = Parked(self.link.current(), socket, model, version, known, received)
                    return slot
                self.link.submit_prepared(known.prefix, known.route, chunks, size, finish, model, received)
            else:
                req = dict(req) if known is not None else req  # (a kept header's descriptor is shared)
                req["t"] = received
                if trace is not None:
                    trace.mark(req)
                self.link.submit(REQ_INFER, req, chunks, finish, model=model)
        except BrokerError as refused:  # (not ``e``: compiled, a name keeps the type of its first except)
            reply(refused.status, orjson.dumps({"error": str(refused)}), [JSON_HEADER])
        return -1

    def rerun(self, model: str, version: str, headers: dict[bytes, bytes], body: bytes, reply: Reply, slot: int,
              socket: tuple[int, int] | None) -> int:
        """``start`` of the next request on an HTTP connection whose last request, in ``slot``,
        went with a direct trailer: when its worker answered that one whole and nobody has
        completed it yet, and this one has the same JSON header and as many tensor bytes, it goes
        in the same slot and block (``Connection.rerun``): no completion, block or slot to handle,
        nothing parsed. Returns the slot, RERUN_REFUSED if the broker refused it (answered with
        ``reply``; the last request is over all the same), or -1, with nothing done: go the usual
        way (``start``)."""
        parked = self._parked.get(slot)
        if parked is None or parked.conn is None or parked.socket != socket or socket is None or self.direct_refused \
                or parked.model != model or parked.version != version or headers.get(b"content-encoding"):
            return -1
        known = parked.known
        head = known.head
        if known.direct is not parked.direct or known.size != known.tail or len(body) != len(head) + known.tail \
                or not body.startswith(head):
            return -1  # another answer expected, tensors not all in the body, or another header
        last, prior = self._last_socket, self._prior_socket
        if not self._several_clients(socket):
            return -1  # (and ``start`` finds the same)
        received = time.monotonic_ns()
        doc = known.doc
        finish = lambda completion: self._finish(  # noqa: E731
            model, version, doc, headers, completion, reply, None, known)
        try:
            sent = self.link.rerun(parked.conn, slot, memoryview(body)[len(head):],  # type: ignore[arg-type]
                                   known.prefix, known.route, finish, model, received, parked.sent_ns)
        except BrokerError as refused:
            del self._parked[slot]
            reply(refused.status, orjson.dumps({"error": str(refused)}), [JSON_HEADER])
            return RERUN_REFUSED
        if not sent:
            self._last_socket, self._prior_socket = last, prior
            return -1
        parked.sent_ns = received
        return slot

    def _several_clients(self, socket: tuple[int, int]) -> bool:
        """Whether one of the last two requests that could have been answered directly came on
        another connection: direct answers pay when the loop serves several clients (it is spared
        a wake-up and an answer per request), but a lone client in a closed loop is answered
        sooner by the loop polling for its answer (session 18: p50 0.54x Triton's against 0.65x).
        (Two, not one: among several clients in closed loops one often sends twice in a row,
        and its request then went the polled way, which had the worker poll after it too.)"""
        last, prior = self._last_socket, self._prior_socket
        self._last_socket, self._prior_socket = socket, last
        return (last is not None and last != socket) or (prior is not None and prior != socket)

    def begin_ingest(self, model: str, version: str, head: bytes, tail_len: int) -> BodyIngest | None:
        """A reserved block for a large body whose JSON header ``head`` has arrived and whose
        binary tail is still coming (ingest.py), or None: the body goes the ordinary way."""
        try:
            if tail_len > self.max_request_bytes:
                return None
            doc, req, known = self.known.parse_head(model, version, head, tail_len, self.max_tensor_elements)
            if any("data" in t for t in doc["inputs"]):
                return None  # JSON values take room in the block the tail does not fill
            conn, reservation = self.link.reserve(Connection.prepared_prefix(req), tail_len, req)
        except (BadRequest, BrokerError):
            return None
        return BodyIngest(conn, reservation, head, doc, known)

    def finish_ingest(self, model: str, version: str, headers: dict[bytes, bytes], ingest: BodyIngest,
                      reply: Reply) -> None:
        """``start`` for a body that ``begin_ingest`` took in: every byte is in its block."""
        doc, known = ingest.doc, ingest.known
        try:
            self.link.send_reserved(ingest.conn, ingest.reservation, lambda completion: self._finish(
                model, version, doc, headers, completion, reply, None, known), model)
        except BrokerError as e:
            reply(e.status, orjson.dumps({"error": str(e)}), [JSON_HEADER])

    def _refuse(self, model: str, version: str, e: BadRequest, reply: Reply) -> None:
        """Answer a request the frontend could not take. Triton looks the model up before the
        body, so a model or version the server does not have (404) or a version that does not
        serve (503) answers that even then: the broker is asked (on this error path only)."""
        def answer(completion: Completion) -> None:
            try:
                status = completion.status
                doc = completion.doc() if status in (404, 503) else None
            finally:
                completion.release()
            if doc is None:
                reply(e.status, orjson.dumps({"error": str(e)}), [JSON_HEADER])
            else:
                reply(status, orjson.dumps(doc), [JSON_HEADER])

        try:
            self.link.submit(REQ_CONTROL, {"op": "model_metadata", "model": model, "version": version}, (), answer)
        except BrokerError:
            reply(e.status, orjson.dumps({"error": str(e)}), [JSON_HEADER])

    def _finish(self, model: str, version: str, doc: dict, headers: dict[bytes, bytes], completion: Completion,
                      reply: Reply, trace: Trace | None = None, known: Known | None = None) -> None:
        sent = completion.sent  # bytes of the answer the worker wrote to the HTTP client itself
        if sent == SENT_REFUSED:
            self.direct_refused = True
            log.warning("a worker may not write answers to HTTP clients itself on this host (pidfd_getfd "
                        "refused); the frontend writes every answer")
            sent = 0
        if sent == SENT_ALL:
            completion.release()
            reply(200, b"", [], sent)
            return
        try:
            status, out, out_headers = Inference._response(model, version, doc, headers, completion, trace, known)
        except Exception as e:  # noqa: BLE001 - the client must get an answer whatever went wrong
            log.exception("building the response of '%s' failed", model)
            status, out, out_headers = 500, orjson.dumps({"error": f"internal error: {e}"}), [JSON_HEADER]
        reply(status, out, out_headers, sent)

    @staticmethod
    def _response(model: str, version: str, doc: dict, headers: dict[bytes, bytes], completion: Completion,
                  trace: Trace | None = None, known: Known | None = None) -> tuple[int, bytes | memoryview, list[tuple[bytes, bytes]]]:
        try:
            if known is not None and trace is None and completion.status == 200:
                status = 200
                out, json_len, out_headers = KnownRequests.answer(known, model, version, completion)
            else:
                result = completion.doc()
                if trace is not None:
                    trace.collect(result)
                status = completion.status
                if status != 200:
                    out, json_len = orjson.dumps({"error": result.get("error", "inference failed")}), None
                else:
                    served = str(result.get("version", version))
                    out, json_len = build_response(model, served, doc, result, completion.tensor)
                out_headers = answer_headers(json_len)
        finally:
            completion.release()
        accept = headers.get(b"accept-encoding")
        if accept and status == 200:
            out, used = _compress(out, accept.decode("latin-1"))
            if used:  # (a copy: a kept answer's headers are shared)
                out_headers = [*out_headers, (b"content-encoding", used.encode())]
        return status, out, out_headers
