"""Copies of large tensors, split across the cores this process may run on.

One core's memcpy does not reach the memory bandwidth of common hosts, least of all between
shared-memory mappings, which get no huge pages: a 16 MiB copy between two /dev/shm segments took
1.3 ms on one core of the 2-core development VM and 0.75 ms on two. Tensors of a few MiB and more
(outputs written into a client's region or arena, inputs copied into an arena) are therefore
copied in as many pieces as there are cores (at most four), by numpy, which releases the GIL while
it copies. Smaller copies are a plain slice assignment: a thread hand-off would cost more than it
saves.
"""
from __future__ import annotations

import concurrent.futures
import os
import threading
from typing import Any

import numpy as np

PARALLEL_MIN_BYTES = 4 << 20
MAX_PIECES = 4

_pieces = max(1, min(MAX_PIECES, len(os.sched_getaffinity(0))))
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _helpers() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = concurrent.futures.ThreadPoolExecutor(_pieces - 1, thread_name_prefix="shmserve-copy")
    return _pool


def copy_into(dst: memoryview, src: Any) -> None:
    """``dst[:] = src`` for a writable byte view ``dst`` and any buffer of the same length."""
    n = len(dst)
    if n < PARALLEL_MIN_BYTES or _pieces < 2:
        dst[:] = src
        return
    d = np.frombuffer(dst, dtype=np.uint8)
    s = np.frombuffer(src, dtype=np.uint8)
    if s.size != n:
        raise ValueError(f"copy of {s.size} bytes into {n}")
    step = -(-n // _pieces) + 63 & ~63  # whole cache lines per piece
    pool = _helpers()
    others = [pool.submit(np.copyto, d[at:at + step], s[at:at + step]) for at in range(step, n, step)]
    np.copyto(d[:step], s[:step])
    for f in others:
        f.result()


def joined(parts: list) -> bytes | memoryview:
    """``b"".join(parts)``, with large parts copied as ``copy_into`` does, into uninitialized
    memory (a bytearray would be zero-filled first: one more pass over every byte)."""
    total = sum(len(p) for p in parts)
    if total < PARALLEL_MIN_BYTES or _pieces < 2:
        return b"".join(parts)
    out = memoryview(np.empty(total, dtype=np.uint8))  # type: ignore[arg-type] # (numpy's stubs lack Buffer)
    pos = 0
    for p in parts:
        n = len(p)
        copy_into(out[pos:pos + n], p)
        pos += n
    return out
