"""Triton's response cache as a worker uses it: requests looked up before they run, and the
outputs of a successful execution stored for the next identical request.

The key is a digest of the model, its version and load, every input's name, datatype, shape and
bytes (inputs sorted by name, as Triton hashes them), and the names of the outputs asked for
(none named: all those the config declares, so a request naming them all is the same request).
Triton's key has no datatypes, shapes or output names; here two
requests whose bytes agree but whose shapes or requested outputs differ never share an answer.
The load is part of the key, so a reloaded model never answers with its predecessor's outputs.
Request parameters are not (as in Triton): a model whose answer depends on them should not
enable the cache. The digest is SHA-256 cut to 16 bytes: a client cannot make two requests
collide and so place an answer under another request's key.

What is stored is the model's own outputs (those asked for, each as datatype, shape and bytes)
and its response parameters; a hit goes through the same encoding as an answer from the model,
so classification, outputs placed in regions and tracing behave alike. Not cached, as in
Triton: requests with inputs in CUDA regions, responses with outputs on the device, streamed
requests, and failures.
"""
from __future__ import annotations

import hashlib
import logging
import operator
import time
from typing import Any

import numpy as np
import orjson

from shmserve.shm.protocol import manifest_room, read_manifest_with_data
from shmserve.shm.response_cache import CacheStore
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import byte_view, from_buffer, serialize_bytes, wire_datatype

from . import device_tensors
from .backend import Response

log = logging.getLogger("shmserve.worker")

_ALIGN = 8  # tensor bytes in a stored payload start on 8-byte boundaries (numpy reads them in place)
_name = operator.itemgetter("name")


class ResponseCache:
    """The server's cache store, keyed for one model version's load."""

    def __init__(self, store: CacheStore, model: str, version: int, load: int, outputs: list[str],
                 segments: SegmentCache) -> None:
        self.store = store
        self.prefix = orjson.dumps([model, version, load])
        self.outputs = sorted(outputs)  # the config's outputs: what a request naming none asks for
        self.segments = segments
        self._too_large_said = False

    @classmethod
    def open(cls, spec: dict[str, Any], config: dict[str, Any], segments: SegmentCache) -> "ResponseCache | None":
        """The cache, when the server has one (the spec's ``cache_load``, nonzero) and the model's
        config enables it."""
        load = spec.get("cache_load", 0)
        if not load or not (config.get("response_cache") or {}).get("enable"):
            return None
        outputs = [o["name"] for o in config.get("output") or ()]
        return cls(CacheStore.attach(spec["server_id"]), spec["model"], spec["version"], load, outputs, segments)

    def split(self, entries: list[dict]) -> tuple[list[tuple[dict, Response, int, int]], list[dict]]:
        """Each request looked up on its own: ([(entry, cached response, lookup start, lookup ns)],
        the requests to run). A request looked up already (when it was queued) is not looked up
        again. Each entry to run keeps its key in ``ck`` (None: not cacheable) and its lookup time
        in ``cn``."""
        hits, misses = [], []
        for entry in entries:
            if "ck" in entry:
                misses.append(entry)
                continue
            start = time.monotonic_ns()
            key = self.key(entry)
            resp = self.lookup(key) if key is not None else None
            ns = time.monotonic_ns() - start
            if resp is not None:
                hits.append((entry, resp, start, ns))
            else:
                entry["ck"], entry["cn"] = key, ns
                misses.append(entry)
        return hits, misses

    def key(self, entry: dict) -> bytes | None:
        """The request's digest, or None when it is not cacheable."""
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
                seg = self.segments.get(t["seg"], t.get("ino", 0), off + size)
            except (OSError, ValueError):  # the run that follows reports it
                return None
            h.update(seg.buf[off:off + size])
        return h.digest()[:16]

    def lookup(self, key: bytes) -> Response | None:
        payload = self.store.lookup(key)
        if payload is None:
            return None
        view = memoryview(payload)
        doc, start = read_manifest_with_data(view, 0)
        outputs = {name: from_buffer(view[start + off:start + off + size], datatype, shape)
                   for name, datatype, shape, off, size in doc["o"]}
        return Response(outputs=outputs, parameters=doc.get("p"))

    def insert(self, entry: dict, resp: Response) -> None:
        """Store a successful response's outputs under the request's key (``ck``)."""
        wanted = entry.get("outputs")
        names = [o["name"] for o in wanted] if wanted else list(resp.outputs)
        described, chunks, pos = [], [], 0
        for name in names:
            arr = resp.outputs[name]
            if not isinstance(arr, np.ndarray) and device_tensors.is_tensor(arr):
                if arr.is_cuda:
                    return  # outputs on the device are not cached (as Triton)
                arr = device_tensors.host_array(arr)
            datatype = wire_datatype(arr)
            data = serialize_bytes(arr) if datatype == "BYTES" else byte_view(arr)
            pad = -pos % _ALIGN
            if pad:
                chunks.append(bytes(pad))
                pos += pad
            described.append([name, datatype, list(arr.shape), pos, len(data)])
            chunks.append(data)
            pos += len(data)
        doc: dict[str, Any] = {"o": described}
        if resp.parameters:
            doc["p"] = resp.parameters
        raw = orjson.dumps(doc)
        room = manifest_room(len(raw))
        if not self.store.fits(room + pos):
            if not self._too_large_said:  # (Triton logs an error for each one)
                self._too_large_said = True
                log.warning("a response of %d bytes does not fit in the response cache (%d bytes for entries): "
                            "such responses are not cached", room + pos, self.store.capacity)
            return
        head = len(raw).to_bytes(4, "little") + raw.ljust(room - 4, b"\0")  # read_manifest's layout
        self.store.insert(entry["ck"], [head, *chunks], room + pos)
