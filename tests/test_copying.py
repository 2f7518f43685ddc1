"""Large copies split across cores give the same bytes as a slice assignment, for any size."""
from __future__ import annotations

from multiprocessing import shared_memory

import numpy as np
import pytest

from shmserve.shm import copying


@pytest.mark.parametrize("size", [0, 1, 4095, copying.PARALLEL_MIN_BYTES - 1, copying.PARALLEL_MIN_BYTES,
                                  copying.PARALLEL_MIN_BYTES + 12345, 16 << 20])
def test_copy_into_shared_memory_matches_the_source(size):
    src = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    seg = shared_memory.SharedMemory(create=True, size=max(size + 100, 1))
    try:
        view = seg.buf
        view[:] = b"\xaa" * len(view)
        copying.copy_into(view[7:7 + size], memoryview(src))
        out = np.frombuffer(view, dtype=np.uint8)
        assert np.array_equal(out[7:7 + size], src)
        assert (out[:7] == 0xAA).all() and (out[7 + size:] == 0xAA).all()  # nothing outside the target
        del out
        view.release()
    finally:
        seg.close()
        seg.unlink()


def test_copy_into_refuses_a_length_mismatch():
    dst = bytearray(copying.PARALLEL_MIN_BYTES)
    with pytest.raises(ValueError):
        copying.copy_into(memoryview(dst), bytes(len(dst) - 1))


@pytest.mark.parametrize("sizes", [[], [10, 0, 5], [copying.PARALLEL_MIN_BYTES - 100, 99],
                                   [300, copying.PARALLEL_MIN_BYTES + 777, 0, 4096], [16 << 20]])
def test_joined_matches_bytes_join(sizes):
    rng = np.random.default_rng(len(sizes))
    parts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    views = [memoryview(p)[:] for p in parts]  # parts may be any buffer (views into shm, bytes)
    out = copying.joined(views)
    assert bytes(out) == b"".join(parts)
    assert isinstance(out, bytes) == (sum(sizes) < copying.PARALLEL_MIN_BYTES)  # large: no zero-fill
