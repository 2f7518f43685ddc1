"""What a large input costs a Python model's worker: a private copy-on-write view
(``workers/input_views.py``) against the copy Triton's stub makes, in the worker's thread CPU time
(so a loaded host's waits do not count), with the "model" reading every byte in both.

Steady state: three blocks in turn, as in an arena whose pages the mapping has seen already;
first pass: a range seen for the first time (its pages fault in). Used to set ``VIEW_MIN_BYTES``::

    python -m shmserve.tools.bench_input_views
"""
from __future__ import annotations

import os
import time

import numpy as np

from shmserve.shm import heap
from shmserve.shm.segment import Segment, SegmentCache
from shmserve.workers.input_views import InputViews

SIZES = [256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20, 16 << 20]
ROUNDS = 25


def main() -> None:
    heap.keep_large_buffers()  # as a worker does
    name = f"/shmserve_bench_views_{os.getpid()}"
    seg = Segment.create(name, 3 * sum(SIZES) + (1 << 20))
    clock = time.thread_time_ns
    try:
        segments = SegmentCache()
        views = InputViews.open(segments)
        if views is None:
            raise SystemExit("this kernel lacks what the views need (pagemap flags, MADV_POPULATE_WRITE)")
        views.min_bytes = 0
        shared = segments.get(name).buf
        np.frombuffer(shared, np.uint8)[:] = 7
        base = 4096 + 64  # as request blocks: 64-byte aligned, not page aligned
        for size in SIZES:
            n = size // 4
            copy, view, first = [], [], []
            for rnd in range(ROUNDS):
                off = base + (rnd % 3) * size
                start = clock()
                a = np.ndarray([n], np.float32, shared[off:off + size]).copy()
                a.sum()
                del a
                copy.append(clock() - start)
                start = clock()
                a = views.array(name, off, size, "FP32", [n])
                assert a is not None
                a.sum()
                del a
                views.settle()
                (view if rnd >= 3 else first).append(clock() - start)
            print(f"{size >> 10:6d} KiB  copy {_median(copy):8.1f} us  view {_median(view):8.1f} us  "
                  f"view, first pass {_median(first):8.1f} us", flush=True)
            base += 3 * size
        views.close()
    finally:
        seg.close()
        seg.unlink()


def _median(ns: list[int]) -> float:
    return sorted(ns)[len(ns) // 2] / 1000


if __name__ == "__main__":
    main()
