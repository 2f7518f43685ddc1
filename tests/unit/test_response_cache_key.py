"""The response cache's key as a worker computes it, over inputs in real shared memory: what
makes two requests the same (input bytes, datatypes, shapes, the outputs asked for, not the
order of the inputs or request parameters) and what is never cached (CUDA inputs, streams).
(tests/test_response_cache.py covers the same through a server, where a model's datatypes are fixed.)"""
from __future__ import annotations

import os

import numpy as np
import pytest

from shmserve.shm.response_cache import CacheStore
from shmserve.shm.segment import SegmentCache
from shmserve.workers.backend import Response
from shmserve.workers.response_cache import ResponseCache
from segments import segment_pair  # noqa: F401  (a fixture: real segments, mapped twice)


@pytest.fixture
def cache(segment_pair):
    """A ResponseCache for model 'm' over a real store, and a segment holding request inputs."""
    server_id = f"unitkey{os.getpid()}"
    store = CacheStore.create(server_id, 64 << 10)
    created, _ = segment_pair(4096)
    created.buf[:64] = bytes(range(64))
    segments = SegmentCache()
    yield ResponseCache(store, "m", 1, 1, ["Y", "Z"], segments), created.name
    segments.clear()
    store.close()
    store.unlink()


def entry(seg: str, *inputs: tuple[str, str, list[int], int, int], outputs: list[str] | None = None, **more) -> dict:
    """A request entry whose inputs (name, datatype, shape, offset, size) lie in ``seg``."""
    return {"inputs": [{"name": n, "datatype": dt, "shape": shape, "seg": seg, "off": off, "size": size}
                       for n, dt, shape, off, size in inputs],
            "outputs": [{"name": o} for o in outputs] if outputs is not None else None, **more}


def test_what_makes_two_requests_the_same(cache):
    rc, seg = cache
    base = rc.key(entry(seg, ("A", "FP32", [4], 0, 16), ("B", "INT32", [2], 16, 8)))
    assert base is not None and len(base) == 16
    same = [
        entry(seg, ("B", "INT32", [2], 16, 8), ("A", "FP32", [4], 0, 16)),  # inputs in another order
        entry(seg, ("A", "FP32", [4], 0, 16), ("B", "INT32", [2], 16, 8), params={"p": 1}),  # parameters
        entry(seg, ("A", "FP32", [4], 0, 16), ("B", "INT32", [2], 16, 8), outputs=["Z", "Y"]),  # all outputs
    ]
    assert all(rc.key(e) == base for e in same)
    different = [
        entry(seg, ("A", "FP32", [4], 32, 16), ("B", "INT32", [2], 16, 8)),  # other bytes
        entry(seg, ("A", "INT32", [4], 0, 16), ("B", "INT32", [2], 16, 8)),  # same bytes, other datatype
        entry(seg, ("A", "FP32", [2, 2], 0, 16), ("B", "INT32", [2], 16, 8)),  # same bytes, other shape
        entry(seg, ("A", "FP32", [4], 0, 16), ("B", "INT32", [2], 16, 8), outputs=["Y"]),  # fewer outputs
        entry(seg, ("X", "FP32", [4], 0, 16), ("B", "INT32", [2], 16, 8)),  # another input name
    ]
    keys = [rc.key(e) for e in different]
    assert base not in keys and len(set(keys)) == len(keys)


def test_requests_that_are_never_cached(cache):
    rc, seg = cache
    on_gpu = entry(seg, ("A", "FP32", [4], 0, 16))
    on_gpu["inputs"][0]["cuda"] = "handle"
    assert rc.key(on_gpu) is None
    assert rc.key(entry(seg, ("A", "FP32", [4], 0, 16), stream={"seg": seg, "off": 0})) is None


def test_stored_outputs_come_back_with_their_datatypes_shapes_and_parameters(cache):
    rc, seg = cache
    e = entry(seg, ("A", "FP32", [4], 0, 16))
    e["cache_key"] = rc.key(e)
    words = np.array([b"one", b"", b"three"], dtype=np.object_).reshape(1, 3)
    rc.insert(e, Response(outputs={"Y": np.arange(6, dtype=np.float16).reshape(2, 3), "Z": words},
                          parameters={"p": "v"}))
    got = rc.lookup(e["cache_key"])
    assert got is not None and got.parameters == {"p": "v"}
    np.testing.assert_array_equal(got.outputs["Y"], np.arange(6, dtype=np.float16).reshape(2, 3))
    assert got.outputs["Y"].dtype == np.float16
    assert got.outputs["Z"].shape == (1, 3) and got.outputs["Z"].tolist() == [[b"one", b"", b"three"]]
