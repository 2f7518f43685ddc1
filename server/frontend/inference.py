"""The frontend's inference path: parse a POST .../infer body, submit it to the broker link,
answer it.

``Inference.start`` takes a request's headers and body and a ``reply`` callback; the request is
checked and turned into a descriptor (edge/requests.py), submitted (edge/link.py), and ``reply(status, body,
headers)`` runs on the event loop once the answer is in (at once for a request refused here).
asgi.py calls it for every infer request. A large binary body may instead be copied into its
request block while it arrives (``begin_ingest``/``finish_ingest``, ingest.py).
"""
from __future__ import annotations

import asyncio
import gzip
import logging
import math
import re
import time
import zlib
from typing import Callable

import orjson

from shmserve.server.edge.header_forward import add_to_request, forwarded_params, http_headers
from shmserve.server.edge.link import ArenaWait, BrokerError, BrokerLink, when_room, Sent
from shmserve.server.edge.requests import BadRequest, build_request
from shmserve.server.edge.tracing import Trace
from shmserve.shm import control_messages as control
from shmserve.shm.completion import Completion
from shmserve.shm.protocol import REQ_CONTROL, REQ_INFER

from .codec import build_response, split_body
from .error_status import infer_error_status
from .ingest import BodyIngest
from .raw_binary import is_raw, raw_request_doc

log = logging.getLogger("shmserve.frontend")
JSON_HEADER = (b"content-type", b"application/json")
# Sent with every 503 (overloaded, the broker away, the server draining before it stops): a client
# that honours it retries after a second, which a drain's refusal sends to another replica.
RETRY_AFTER_S = 1
RETRY_AFTER_HEADER = (b"retry-after", b"%d" % RETRY_AFTER_S)
Headers = list[tuple[bytes, bytes]]
# reply(status, body, headers) of one inference (a large body is a memoryview: shm/copying.joined)
Reply = Callable[[int, "bytes | memoryview", Headers], None]


def answer_headers(json_len: int | None) -> Headers:
    """The HTTP headers of a successful answer: JSON, or binary data behind a JSON header."""
    if json_len is None:
        return [JSON_HEADER]
    return [(b"content-type", b"application/octet-stream"), (b"inference-header-content-length", b"%d" % json_len)]


def error_answer(status: int, message: str) -> tuple[int, bytes, Headers]:
    return status, orjson.dumps({"error": message}), [JSON_HEADER]


def too_large(size: int, limit: int, raw: bool = False) -> BadRequest:
    """Triton's refusal of a body over --http-max-input-size (a raw binary body is all tensor)."""
    if raw:
        return BadRequest(f"Raw input has a byte_size ({size} bytes) that exceeds the maximum allowed value of "
                          f"{limit} bytes. Use --http-max-input-size to increase the limit.")
    return BadRequest(f"request JSON size of {size} bytes exceeds the maximum allowed input size of {limit} bytes. "
                      f"Use --http-max-input-size to increase the limit.")


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


def _compress(body: bytes | memoryview, accept: str | None) -> tuple[bytes | memoryview, str | None]:
    """The body in the encoding ``Accept-Encoding`` weighs highest, as Triton chooses it."""
    used = accepted_encoding(accept) if accept else "identity"
    if used == "gzip":
        return gzip.compress(body, compresslevel=1), "gzip"
    if used == "deflate":
        return zlib.compress(body, 1), "deflate"
    return body, None


def accepted_encoding(accept: str) -> str:
    """Triton's choice among identity, deflate and gzip (its ``CompressionTypeUsed``): the one of
    highest ``q`` (1 when not given), the first of equal weights; one of weight 0 is never chosen.
    As Triton reads an entry: its name runs from the first non-space to ``;q=`` (or the end, so
    ``gzip ;q=1`` or ``gzip;level=1`` names no coding), and the weight is the number its text
    starts with (``0.5;x=1`` weighs 0.5); an entry whose weight starts with no number (``q=``,
    ``q=abc``) is skipped. 'identity' when none is chosen."""
    chosen, weight = "identity", 0.0
    for entry in accept.split(","):
        name, has_q, q = entry.lstrip(" ").partition(";q=")
        if not name:
            continue
        w = _leading_number(q) if has_q else 1.0
        if w is None:
            continue
        if name in ("identity", "deflate", "gzip") and w > weight:
            chosen, weight = name, w
    return chosen


_DECIMAL = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_HEX = re.compile(r"[+-]?0[xX](?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][+-]?\d+)?")
_SPECIAL = re.compile(r"[+-]?(?:inf(?:inity)?|nan(?:\([0-9A-Za-z_]*\))?)", re.IGNORECASE)


def _leading_number(text: str) -> float | None:
    """The number ``text`` starts with, as C++'s ``std::stod`` reads it (leading white space
    skipped, the rest ignored); None where it starts with none, or one out of a double's range
    (where ``stod`` throws)."""
    text = text.lstrip(" \t\n\v\f\r")
    hexa = _HEX.match(text)
    if hexa:
        try:
            return float.fromhex(hexa.group())
        except OverflowError:  # out of range
            return None
    number = _DECIMAL.match(text) or _SPECIAL.match(text)
    if number is None:
        return None
    value = float(number.group())
    if math.isinf(value) and not _SPECIAL.match(text):
        return None  # out of range
    return value


class Inference:
    """One frontend's infer requests: the limits they are checked against and the broker link
    they go out on."""

    def __init__(self, link: BrokerLink, max_input_bytes: int, max_tensor_elements: int, arena_bytes: int,
                 header_forward: re.Pattern[str] | None = None) -> None:
        self.link = link
        self.header_forward = header_forward  # --http-header-forward-pattern (header_forward.py)
        self.max_input_bytes = max_input_bytes
        self.max_tensor_elements = max_tensor_elements
        # Tensor bytes beyond this can never fit the frontend's arena: a client error, not a 503.
        self.max_request_bytes = arena_bytes - (64 << 10)

    def header_params(self, scope: dict) -> dict[str, str]:
        """The request parameters the request's headers add under --http-header-forward-pattern."""
        return forwarded_params(self.header_forward, http_headers(scope)) if self.header_forward is not None else {}

    def start(self, model: str, version: str, headers: dict[bytes, bytes], body: bytes, reply: Reply,
              trace: Trace | None = None, received: int = 0, config: dict | None = None,
              forwarded: dict[str, str] | None = None) -> Sent | None:
        """Parse and submit one inference; ``reply`` runs on the loop when it is answered.
        Returns the request as sent (None: refused, answered already or soon). ``received``: when
        the request came in (its duration in the statistics starts there), if not now. ``config``:
        the model's, which a raw binary body needs (``start_when_room`` asks for it);
        ``forwarded``: parameters from its headers (``header_params``)."""
        received = received or time.monotonic_ns()
        header_len = headers.get(b"inference-header-content-length")
        try:
            if len(body) > self.max_input_bytes:
                raise too_large(len(body), self.max_input_bytes, is_raw(header_len))
            encoding = headers.get(b"content-encoding")
            if encoding:
                body = _decompress(body, encoding.decode("latin-1").strip().lower(), self.max_input_bytes)
            if is_raw(header_len):
                if config is None:
                    raise BadRequest("a raw binary request needs the model's configuration")
                doc, tail = raw_request_doc(model, config, body)
            else:
                doc, tail = split_body(body, header_len.decode("latin-1") if header_len is not None else None)
            req, chunks = build_request(model, version, doc, tail, self.max_tensor_elements)
            add_to_request(req, forwarded)
            size = sum(len(c) for c in chunks)
            if size > self.max_request_bytes:
                raise BadRequest(f"the request's {size} bytes of tensor data exceed the frontend's shared-memory "
                                 f"arena (--frontend-arena-mb); send large tensors through shared memory")
        except BadRequest as e:
            self._refuse(model, version, e, reply)
            return None
        req.sent_ns = received
        if trace is not None:
            trace.mark(req)
        try:
            return self.link.submit(REQ_INFER, req, chunks, lambda completion: self._finish(
                model, version, doc, headers, completion, reply, trace), model=model)
        except ArenaWait:
            raise  # the caller waits for room and starts it again (``start_when_room``)
        except BrokerError as e:
            reply(*error_answer(e.status, str(e)))
            return None

    async def start_when_room(self, model: str, version: str, headers: dict[bytes, bytes], body: bytes,
                              reply: Reply, trace: Trace | None = None,
                              forwarded: dict[str, str] | None = None) -> Sent | None:
        """``start``, waiting for room in a fragmented arena (``link.when_room``)."""
        received = time.monotonic_ns()  # a wait for room counts in the request's duration
        config = None
        if is_raw(headers.get(b"inference-header-content-length")):
            config = await self._raw_config(model, version, reply)
            if config is None:
                return None
        try:
            return await when_room(lambda: self.start(model, version, headers, body, reply, trace, received,
                                                      config, forwarded))
        except ArenaWait as e:
            reply(*error_answer(e.status, str(e)))
            return None

    async def _raw_config(self, model: str, version: str, reply: Reply) -> dict | None:
        """The model's config for a raw binary body (raw_binary.py); None once ``reply`` has
        answered why there is none (the model or version is not there: Triton's 404 or 503)."""
        try:
            status, config = await self.link.control(control.ModelConfig(model, version))
        except BrokerError as e:
            reply(*error_answer(e.status, str(e)))
            return None
        if status != 200:
            reply(status, orjson.dumps(config), [JSON_HEADER])
            return None
        return config

    def begin_ingest(self, model: str, version: str, head: bytes, tail_len: int,
                     loop: asyncio.AbstractEventLoop, forwarded: dict[str, str] | None = None) -> BodyIngest | None:
        """A reserved block for a large body whose JSON header ``head`` has arrived and whose
        binary tail is still coming (ingest.py), or None: the body goes the ordinary way."""
        try:
            if tail_len > self.max_request_bytes:
                return None
            doc, _ = split_body(head, None)
            req, _ = build_request(model, version, doc, tail_len, self.max_tensor_elements)
            add_to_request(req, forwarded)
            if any("data" in t for t in doc["inputs"]):
                return None  # JSON values take room in the block the tail does not fill
            conn, reservation = self.link.reserve(req, tail_len)
        except (BadRequest, BrokerError):
            return None
        return BodyIngest(conn, reservation, head, doc, loop)

    def finish_ingest(self, model: str, version: str, headers: dict[bytes, bytes], ingest: BodyIngest,
                      reply: Reply) -> Sent | None:
        """``start`` for a body that ``begin_ingest`` took in: every byte is in its block."""
        doc = ingest.doc
        try:
            return self.link.send_reserved(ingest.conn, ingest.reservation, lambda completion: self._finish(
                model, version, doc, headers, completion, reply, None), model)
        except BrokerError as e:
            reply(*error_answer(e.status, str(e)))
            return None

    def _refuse(self, model: str, version: str, e: BadRequest, reply: Reply) -> None:
        """Answer a request the frontend could not take. Triton looks the model up before the
        body, so a model or version the server does not have (404) or a version that does not
        serve (503) answers that even then: the broker is asked (on this error path only)."""
        def answer(completion: Completion) -> None:
            try:
                status = completion.status
                doc = completion.answer.control_document() if status in (404, 503) else None
            finally:
                completion.release()
            if doc is None:
                reply(*error_answer(e.status, str(e)))
            else:
                reply(status, orjson.dumps(doc), [JSON_HEADER])

        try:
            self.link.submit(REQ_CONTROL, control.ModelMetadata(model, version), (), answer)
        except BrokerError:
            reply(*error_answer(e.status, str(e)))

    def _finish(self, model: str, version: str, doc: dict, headers: dict[bytes, bytes], completion: Completion,
                reply: Reply, trace: Trace | None) -> None:
        try:
            status, out, out_headers = _response(model, version, doc, headers, completion, trace)
        except Exception as e:  # noqa: BLE001 - the client must get an answer whatever went wrong
            log.exception("building the response of '%s' failed", model)
            status, out, out_headers = error_answer(500, f"internal error: {e}")
        reply(status, out, out_headers)


def _response(model: str, version: str, doc: dict, headers: dict[bytes, bytes], completion: Completion,
              trace: Trace | None) -> tuple[int, bytes | memoryview, Headers]:
    """The HTTP answer (status, body, headers) to the request ``doc`` from its completion."""
    try:
        answer = completion.answer
        if trace is not None:
            trace.collect(answer)
        status = completion.status
        if status != 200:
            status = infer_error_status(completion)
            out, json_len = orjson.dumps({"error": answer.error or "inference failed"}), None
        else:
            out, json_len = build_response(model, answer.served_version(version), doc, answer, completion.tensor)
        out_headers = answer_headers(json_len)
    finally:
        completion.release()
    accept = headers.get(b"accept-encoding")
    if accept and status == 200:
        out, used = _compress(out, accept.decode("latin-1"))
        if used:
            out_headers.append((b"content-encoding", used.encode()))
    if trace is not None:
        trace.responded()
    return status, out, out_headers
