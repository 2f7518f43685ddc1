"""Inference requests the frontend has parsed before, kept by the bytes of their JSON header.

tritonclient sends the same JSON header for every request of one shape (the binary tensor data
follows it), and a worker answers those requests with the same response descriptor. The frontend
keeps the descriptor it built from a header, and the response head it built from a worker's
descriptor, so a repeated request is neither parsed nor checked again and its answer is not
rebuilt: its tensors are cut from the body at the kept offsets, its descriptor is the kept bytes up
to the send time (no dict copied, nothing serialized), and the output bytes are joined behind the
kept head.

Only what the header fully decides is kept: requests whose tensors are all binary data or
shared-memory regions, and answers whose outputs are all binary data or regions (values written
as JSON would differ from one answer to the next).
"""
from __future__ import annotations

from typing import Any

from shmserve.shm.connection import Completion, Connection
from shmserve.shm.copying import PARALLEL_MIN_BYTES, joined
from shmserve.shm.protocol import DIRECT_TRAILER, read_manifest_raw

from .codec import build_request, build_response, split_body, wants_binary

LIMIT = 256  # headers kept; each keeps up to LIMIT answer shapes
LARGEST = 8192  # bytes of a header or answer document worth keeping (larger ones are rare and big)
DIRECT_LARGEST = 1 << 16  # the largest answer body a worker may write to the HTTP client itself
OK_LINE = b"HTTP/1.1 200 OK\r\n"


class Known:
    """One header: the parsed document (the answer reads it), the descriptor without its send
    time (as a dict, to route by: read it only, and as its bytes), where each tensor lies in the
    binary tail, and the answers built for it."""

    __slots__ = ("head", "doc", "req", "prefix", "route", "spans", "size", "tail", "answers", "direct", "direct_raw")

    def __init__(self, head: bytes, doc: dict, req: dict, spans: list[tuple[int, int]], tail: int) -> None:
        self.head = head  # the JSON header's bytes
        self.doc = doc
        self.req = req
        self.prefix = Connection.prepared_prefix(req)
        # What the connection routes by: (model, version) unless a tensor names a region, whose
        # publication it must check per request.
        named = any("region" in t for t in [*req["inputs"], *(req.get("outputs") or ())])
        self.route: dict | tuple[str, str] = req if named else (req["model"], req.get("version") or "")
        self.spans = spans
        self.size = sum(b - a for a, b in spans)  # the tensor bytes sent with the descriptor
        self.tail = tail
        # per answer descriptor: (the answer's JSON head, its length, the outputs' spans, the HTTP
        # headers (shared: read only), whether it is small enough for a plain join)
        self.answers: dict[bytes, tuple[bytes | memoryview, int, list[tuple[int, int]], list, bool]] = {}
        # What a worker needs to answer the next request on a keep-alive connection itself: the
        # last answer descriptor, then its HTTP head and JSON header (b"": none yet, or too big).
        self.direct = b""
        self.direct_raw = b""

    def direct_trailer(self, fd: int, ino: int) -> bytes:
        """The request block's direct-answer trailer for the HTTP connection on socket ``fd``."""
        return b"%b%b" % (self.direct, DIRECT_TRAILER.pack(fd, len(self.direct_raw),
                                                            len(self.direct) - len(self.direct_raw), 0, ino))


class KnownRequests:
    def __init__(self) -> None:
        self._known: dict[tuple[str, str, bytes], Known] = {}

    def parse(self, model: str, version: str, body: bytes, header_length: str | None,
              max_elements: int) -> tuple[dict, dict, list, Known | None]:
        """(the header document, the descriptor without its send time, the tensor chunks, the kept
        entry or None); raises BadRequest as ``build_request`` does. The descriptor of a kept
        entry is shared: copy it to change it."""
        n = -1  # not kept unless plain digits (str.isdigit also takes '²', and int() refuses 5000 digits)
        if header_length is not None and 0 < len(header_length) <= 18 and header_length.isascii() \
                and header_length.isdigit():
            n = int(header_length)
        key = None
        if 0 <= n <= min(len(body), LARGEST):
            key = (model, version, body[:n])
            known = self._known.get(key)
            if known is not None and known.tail == len(body) - n:
                view = memoryview(body)
                return known.doc, known.req, [view[n + a:n + b] for a, b in known.spans], known
        doc, tail = split_body(body, header_length)
        req, chunks = build_request(model, version, doc, tail, max_elements)
        return doc, req, chunks, self._keep(key, doc, req, len(tail))

    def parse_head(self, model: str, version: str, head: bytes, tail_len: int, max_elements: int
                   ) -> tuple[dict, dict, Known | None]:
        """``parse`` for a body whose binary tail (``tail_len`` bytes) is still arriving: (the header
        document, a fresh descriptor, the kept entry or None)."""
        key = (model, version, head) if len(head) <= LARGEST else None
        known = self._known.get(key) if key is not None else None
        if known is not None and known.tail == tail_len:
            return known.doc, dict(known.req), known
        doc, _ = split_body(head, None)
        req, _ = build_request(model, version, doc, tail_len, max_elements)
        return doc, req, self._keep(key, doc, req, tail_len)

    def _keep(self, key: tuple[str, str, bytes] | None, doc: dict, req: dict, tail_len: int) -> Known | None:
        if key is None or any("data" in t for t in doc["inputs"]):
            return None  # JSON values: the header holds them, so it is not kept
        spans, pos = [], 0
        for t in req["inputs"]:
            if "data" in t:  # binary data, in input order behind the header (as build_request cut it)
                spans.append((pos, pos + t["size"]))
                pos += t["size"]
        if len(self._known) >= LIMIT:
            self._known.clear()
        known = self._known[key] = Known(key[2], doc, dict(req), spans, tail_len)
        return known

    @staticmethod
    def answer(known: Known, model: str, version: str, completion: Completion
               ) -> tuple[bytes | memoryview, int | None, list[tuple[bytes, bytes]]]:
        """``build_response`` for a successful completion, with its HTTP headers, from the kept
        head when the worker's descriptor was seen before for this header (its headers are then
        the kept list: read it only)."""
        assert completion.buf is not None
        raw, data = read_manifest_raw(completion.buf, completion.offset)
        kept = known.answers.get(raw)
        if kept is None:
            result = completion.doc()
            out, json_len = build_response(model, str(result.get("version", version)), known.doc, result,
                                           completion.tensor)
            binary = wants_binary(known.doc)
            outputs = [o for o in result.get("outputs", ()) if not o.get("region")]
            headers = answer_headers(json_len)
            if json_len is not None and len(raw) <= LARGEST and \
                    all(binary.get(o["name"], binary["*"]) for o in outputs):
                if len(known.answers) >= LIMIT:
                    known.answers.clear()
                known.answers[raw] = (out[:json_len], json_len, [(o["off"], o["off"] + o["size"]) for o in outputs],
                                      headers, len(out) < PARALLEL_MIN_BYTES)
            return out, json_len, headers
        head, json_len, blobs, headers, small = kept
        if known.direct_raw != raw:
            size = json_len + sum(b - a for a, b in blobs)
            known.direct_raw = raw
            known.direct = raw + http_head(OK_LINE, headers, size, True) + bytes(head) if size <= DIRECT_LARGEST else b""
        buf = completion.buf
        parts: list[Any] = [head, *[buf[data + a:data + b] for a, b in blobs]]
        return b"".join(parts) if small else joined(parts), json_len, headers


JSON_HEADER = (b"content-type", b"application/json")


def http_head(status_line: bytes, headers: list[tuple[bytes, bytes]], length: int, keep_alive: bool) -> bytes:
    """An answer's status line and headers, as the protocol writes them."""
    parts = [status_line]
    for name, value in headers:
        parts += [name, b": ", value, b"\r\n"]
    parts.append(b"content-length: %d\r\n" % length)
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def answer_headers(json_len: int | None) -> list[tuple[bytes, bytes]]:
    """The HTTP headers of a successful answer: JSON, or binary data behind a JSON header."""
    if json_len is None:
        return [JSON_HEADER]
    return [(b"content-type", b"application/octet-stream"), (b"inference-header-content-length", b"%d" % json_len)]
