"""Triton's response cache as a worker uses it: requests looked up before they run, and the
outputs of a successful execution stored for the next identical request.

The key and the layout of a stored answer are ``shm/cache_entry.py``'s (the broker keys and
stores an ensemble's answers the same way). What is stored is the model's own outputs (those
asked for) and its response parameters; a hit goes through the same encoding as an answer from
the model, so classification, outputs placed in regions and tracing behave alike. Not cached, as
in Triton: requests with inputs in CUDA regions, responses with outputs on the device, streamed
requests, and failures.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm import cache_entry
from shmserve.shm.response_cache import CacheStore
from shmserve.shm.segment import SegmentCache
from shmserve.shm.tensors import byte_view, from_buffer, serialize_bytes, wire_datatype

from . import device_tensors
from .backend import Response

log = logging.getLogger("shmserve.worker")


class ResponseCache:
    """The server's cache store, keyed for one model version's load."""

    def __init__(self, store: CacheStore, model: str, version: int, load: int, outputs: list[str],
                 segments: SegmentCache) -> None:
        self.store = store
        self.keys = cache_entry.RequestKeys(model, version, load, outputs)
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

    def split(self, entries: list[BatchEntry]) -> tuple[list[tuple[BatchEntry, Response, int, int]], list[BatchEntry]]:
        """Each request looked up on its own: ([(entry, cached response, lookup start, lookup ns)],
        the requests to run). A request looked up already (when it was queued) is not looked up
        again. Each entry to run keeps its key in ``cache_key`` (None: not cacheable) and its lookup time
        in ``cache_lookup_ns``."""
        hits, misses = [], []
        for entry in entries:
            if "cache_key" in entry:
                misses.append(entry)
                continue
            start = time.monotonic_ns()
            key = self.key(entry)
            resp = self.lookup(key) if key is not None else None
            ns = time.monotonic_ns() - start
            if resp is not None:
                hits.append((entry, resp, start, ns))
            else:
                entry["cache_key"], entry["cache_lookup_ns"] = key, ns
                misses.append(entry)
        return hits, misses

    def key(self, entry: BatchEntry) -> bytes | None:
        """The request's digest, or None when it is not cacheable."""
        return self.keys.key(entry, self.segments)

    def lookup(self, key: bytes) -> Response | None:
        payload = self.store.lookup(key)
        if payload is None:
            return None
        entry = cache_entry.unpack(payload)
        if entry is None:  # not an answer (the cache lies in memory every worker writes): a miss
            self.store.forget(key)
            return None
        stored, parameters = entry
        return Response(outputs={name: from_buffer(data, datatype, shape) for name, datatype, shape, data in stored},
                        parameters=parameters)

    def insert(self, entry: BatchEntry, resp: Response) -> None:
        """Store a successful response's outputs under the request's key (``cache_key``)."""
        wanted = entry.get("outputs")
        names = [o["name"] for o in wanted] if wanted else list(resp.outputs)
        outputs: list[cache_entry.Output] = []
        for name in names:
            arr = resp.outputs.get(name)
            if arr is None:
                continue  # requested, but the model did not produce it: absent from the hit too, as in Triton
            if not isinstance(arr, np.ndarray) and device_tensors.is_tensor(arr):
                if arr.is_cuda:
                    return  # outputs on the device are not cached (as Triton)
                arr = device_tensors.host_array(arr)
            datatype = wire_datatype(arr)
            outputs.append((name, datatype, list(arr.shape),
                            serialize_bytes(arr) if datatype == "BYTES" else byte_view(arr)))
        parts, n = cache_entry.pack(outputs, resp.parameters)
        if not self.store.fits(n):
            if not self._too_large_said:  # (Triton logs an error for each one)
                self._too_large_said = True
                log.warning("a response of %d bytes does not fit in the response cache (%d bytes for entries): "
                            "such responses are not cached", n, self.store.capacity)
            return
        self.store.insert(entry["cache_key"], parts, n)
