"""What the response cache holds under what key: the digest of a request and the layout of a
stored answer. Workers use it for their model's requests (``workers/response_cache.py``), the
broker for an ensemble's (``server/broker/ensemble_cache.py``), so both read and write entries
of one format in the one store (``shm/response_cache.py``).

The key is a digest of the model, its version and load, every input's name, datatype, shape and
bytes (inputs sorted by name, as Triton hashes them), and the names of the outputs asked for
(none named: all those the config declares, so a request naming them all is the same request).
Triton's key has no datatypes, shapes or output names; here two requests whose bytes agree but
whose shapes or requested outputs differ never share an answer. The load is part of the key, so
a reloaded model never answers with its predecessor's outputs. Request parameters are not (as in
Triton): a model whose answer depends on them should not enable the cache. The digest is SHA-256
cut to 16 bytes: a client cannot make two requests collide and so place an answer under another
request's key. Requests with inputs in CUDA regions (not cached, as in Triton) and streamed ones
(a gRPC stream's, generate's: Triton caches those of a model that is not decoupled) have no key.

A stored answer is an answer descriptor (shm/answer.py: the outputs and the response's
parameters) followed by each output's bytes in the wire layout (BYTES as 4-byte lengths and
bytes), each starting on an 8-byte boundary so numpy reads it in place. A payload that does not
read as one (the cache lives in memory every worker writes) is a miss.
"""
from __future__ import annotations

import hashlib
import operator
from typing import Any

import orjson
import posix_ipc

from .batch_entry import BatchEntry
from .answer import AnswerCorrupt, AnswerDescriptor, OutputTensor, answer_room, decode_answer
from .segment import SegmentCache

_ALIGN = 8
_name = operator.itemgetter("name")

Output = tuple[str, str, list[int], Any]  # name, datatype, shape, bytes (bytes or a one-dimensional byte view)


class RequestKeys:
    """The keys of one model version's load."""

    def __init__(self, model: str, version: int, load: int | list[int], outputs: list[str]) -> None:
        self.prefix = orjson.dumps([model, version, load])
        self.outputs = sorted(outputs)  # the config's outputs: what a request naming none asks for

    def key(self, entry: BatchEntry, segments: SegmentCache) -> bytes | None:
        """The digest of a request entry (its inputs where ``segments`` maps them), or None when
        it is not cacheable."""
        if "stream" in entry:
            return None
        inputs = sorted(entry["inputs"], key=_name)
        wanted = entry.get("outputs")
        asked = sorted(o["name"] for o in wanted) if wanted else self.outputs
        h = hashlib.sha256(self.prefix)
        h.update(orjson.dumps([[[t["name"], t["datatype"], t["shape"], t["size"]] for t in inputs], asked]))
        for t in inputs:
            if "cuda" in t:
                return None
            off, size = t["off"], t["size"]
            try:
                if "ino" in t:  # a registered region: in place where it is mapped (region_io.py), else a copy
                    in_place = segments.regions.view(t)
                    h.update(in_place if in_place is not None else segments.regions.read(t))
                else:
                    h.update(segments.get(t["seg"]).buf[off:off + size])
            except (OSError, ValueError, posix_ipc.Error):  # a region gone, say: the run that follows reports it
                return None
        return h.digest()[:16]


def pack(outputs: list[Output], parameters: dict | None) -> tuple[list, int]:
    """A stored answer as the parts ``CacheStore.insert`` copies in turn, and their length."""
    described: list[OutputTensor] = []
    chunks: list[Any] = []
    pos = 0
    for name, datatype, shape, data in outputs:
        pad = -pos % _ALIGN
        if pad:
            chunks.append(bytes(pad))
            pos += pad
        size = len(data)
        described.append(OutputTensor(name, datatype, tuple(shape), pos, size))
        chunks.append(data)
        pos += size
    raw = AnswerDescriptor(described, params=parameters or None).encode()
    room = answer_room(len(raw))
    return [raw.ljust(room, b"\0"), *chunks], room + pos


def unpack(payload: bytes) -> tuple[list[Output], dict | None] | None:
    """A stored answer's outputs (their bytes as views of ``payload``) and response parameters;
    None when the payload holds no answer."""
    view = memoryview(payload)
    try:
        answer, start = decode_answer(view, 0, len(view))
    except AnswerCorrupt:
        return None
    outputs = [(o.name, o.datatype, list(o.shape), view[start + o.offset:start + o.offset + o.size])
               for o in answer.outputs]
    return outputs, answer.params
