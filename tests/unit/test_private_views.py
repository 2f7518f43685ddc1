"""Copy-on-write input views (workers/input_views.py) over a real POSIX segment, in this process:
a write stays in this process and is gone after settle; a kept view keeps its bytes when the
segment is rewritten, and its mapping is unmapped once the view dies; a view whose edge page
another view wrote in the same round is refused (the caller copies); small inputs are refused."""
from __future__ import annotations

import gc
import itertools
import mmap
import os

import numpy as np
import pytest

from shmserve.shm.segment import Segment, SegmentCache
from shmserve.workers.input_views import VIEW_MIN_BYTES, InputViews

PAGE = mmap.PAGESIZE
SIZE = VIEW_MIN_BYTES
N = SIZE // 4
_names = itertools.count()


@pytest.fixture
def arena():
    """(name, shared view as float32, InputViews) over a new segment of 4 views' room."""
    name = f"/shmserve_unit_views_{os.getpid()}_{next(_names)}"
    seg = Segment.create(name, 4 * SIZE + 4 * PAGE)
    segments = SegmentCache()
    views = InputViews.open(segments)
    assert views is not None, "this kernel lacks pagemap flags or MADV_POPULATE_WRITE"
    try:
        yield name, seg.buf, views
    finally:
        views.close()
        segments.clear()
        seg.close()
        seg.unlink()


def _fill(buf: memoryview, off: int, values: np.ndarray) -> None:
    np.ndarray([len(values)], np.float32, buf[off:off + 4 * len(values)])[:] = values


def _read(buf: memoryview, off: int, n: int = N) -> np.ndarray:
    return np.ndarray([n], np.float32, buf[off:off + 4 * n]).copy()


def _mappings_of(name: str) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(name))


def test_a_write_stays_private_and_is_gone_after_settle(arena):
    name, buf, views = arena
    off = 64
    _fill(buf, off, np.arange(N, dtype=np.float32))
    v = views.array(name, off, SIZE, "FP32", [N])
    assert v is not None and not v.flags.owndata
    v[::16384] = -1  # one page in 16
    assert (_read(buf, off) == np.arange(N)).all(), "the write reached the segment"
    del v
    views.settle()
    _fill(buf, off, np.full(N, 5, np.float32))  # the block's next request
    v = views.array(name, off, SIZE, "FP32", [N])
    assert (v == 5).all(), "a page written for an earlier request still shows"
    del v
    views.settle()


def test_a_kept_view_keeps_its_bytes_and_is_unmapped_when_it_dies(arena):
    name, buf, views = arena
    off = 64
    _fill(buf, off, np.arange(N, dtype=np.float32))
    kept = views.array(name, off, SIZE, "FP32", [N])
    views.settle()  # kept past the round: made private, its mapping retired
    _fill(buf, off, np.zeros(N, np.float32))
    assert (kept == np.arange(N)).all()
    again = views.array(name, off, SIZE, "FP32", [N])  # a new mapping shows the segment
    assert (again == 0).all()
    del again
    views.settle()
    with_kept = _mappings_of(name)  # the shared ones, the new private one, the retired one
    del kept
    gc.collect()
    assert _mappings_of(name) == with_kept - 1


def test_a_view_sharing_a_page_written_in_this_round_is_refused(arena):
    name, buf, views = arena
    first = views.array(name, 64, SIZE, "FP32", [N])
    first[-1] = 1  # its last page is also the next block's first
    assert views.array(name, 64 + SIZE, SIZE, "FP32", [N]) is None
    del first
    views.settle()
    assert views.array(name, 64 + SIZE, SIZE, "FP32", [N]) is not None
    views.settle()


def test_small_and_bytes_inputs_are_left_to_copy(arena):
    name, _, views = arena
    assert views.array(name, 64, SIZE - 4, "FP32", [N - 1]) is None
    assert views.array(name, 64, SIZE, "BYTES", [1]) is None


def test_a_zeroing_guard_hears_of_the_unmap_before_it(monkeypatch):
    """A client's segment another user may write is mapped here under a guard that zeroes the
    range at a truncation (shm/truncation_guard.c GUARD_ZEROED). mmap unmaps in its dealloc and only
    then calls back the weak reference that ends the guard, so without ``closing`` first the guard
    stays live, zeroing, over a range another mapping may take meanwhile: a fault there would
    replace that mapping by zero pages. The guard must hear ``closing`` before the unmap."""
    from shmserve.shm import truncation_guard

    if truncation_guard._lib is None:
        pytest.skip("the truncation guard library is not built")
    heard: list[tuple[str, int]] = []  # (what, the guard's slot)
    closing, release = truncation_guard.Guard.closing, truncation_guard.Guard.release
    monkeypatch.setattr(truncation_guard.Guard, "closing", lambda g: (heard.append(("closing", g._slot)), closing(g))[1])
    monkeypatch.setattr(truncation_guard.Guard, "release", lambda g: (heard.append(("release", g._slot)), release(g))[1])
    name = f"/shmserve.unitviews{os.getpid()}{next(_names)}.client.1-0"  # (a client's segment, by its name)
    seg = Segment.create(name, 4 * SIZE)
    os.chmod("/dev/shm" + name, 0o666)  # (others may write it: guarded, as another user's client's is)
    segments = SegmentCache()
    views = InputViews.open(segments)
    assert views is not None, "this kernel lacks pagemap flags or MADV_POPULATE_WRITE"
    try:
        v = views.array(name, 0, SIZE, "FP32", [N])
        assert v is not None
        mapping = views._maps[name]
        assert mapping.guard.guarded
        slot = mapping.guard._guard._slot
        del v, mapping
        views.settle()
        views.forget(name)
        gc.collect()
        assert [what for what, s in heard if s == slot][:2] == ["closing", "release"], heard
    finally:
        views.close()
        segments.clear()
        seg.close()
        seg.unlink()
