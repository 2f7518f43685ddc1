"""The FIFO arena allocator on its own (a pure data structure over a buffer): blocks come back in
order, a held block only delays the space behind it, and steady small traffic stays in the first
pages of a large arena instead of touching all of it."""
from __future__ import annotations

import pytest

from shmserve.shm.arena import BACKING_STEP, BLOCK_HEADER, SOFT_LIMIT, Arena, free_block


def test_steady_small_traffic_stays_below_the_soft_limit():
    size = 64 << 20
    buf = memoryview(bytearray(size))
    arena = Arena(buf, 0, size)
    in_flight: list[int] = []
    highest = 0
    for _ in range(200_000):  # ~100 MiB of 500-byte blocks: wraps the 64 MiB arena without the limit
        off = arena.alloc(500)
        assert off > 0
        highest = max(highest, off)
        in_flight.append(off)
        if len(in_flight) > 4:  # a few in flight, freed in order by their consumer
            free_block(buf, in_flight.pop(0))
    assert highest < SOFT_LIMIT + 4096
    assert arena.bytes_in_use <= 5 * 576


def test_held_block_delays_only_the_space_behind_it_and_large_blocks_still_fit():
    size = 4 << 20
    buf = memoryview(bytearray(size))
    arena = Arena(buf, 0, size)
    held = arena.alloc(100)
    blocks = [arena.alloc(64 << 10) for _ in range(40)]  # 2.5 MiB behind the held block
    assert all(b > 0 for b in blocks)
    for b in blocks:
        free_block(buf, b)
    big = arena.alloc(1 << 20)  # fits after the held block's neighbours, or at the end
    assert big > 0
    free_block(buf, big)
    assert arena.alloc(3 << 20) == -1  # the held block keeps the space behind it from coming back
    free_block(buf, held)
    assert arena.alloc(3 << 20) == BLOCK_HEADER  # everything free again: from the start
    assert arena.bytes_in_use >= 3 << 20


def test_a_block_held_through_steady_traffic_does_not_confine_it():
    """A request held while thousands of others come and go (one waiting through a reload) keeps
    the head from going back to the start behind it: the traffic goes on through the rest of the
    arena, where a wrap to the start would have left it the space before the held block only."""
    size = 64 << 20
    buf = memoryview(bytearray(size))
    arena = Arena(buf, 0, size)
    in_flight: list[int] = []
    held = -1
    for i in range(60_000):  # ~34 MiB of 500-byte blocks, a few in flight
        off = arena.alloc(500)
        assert off > 0, f"no room after {i} blocks with one held"
        if i == 100:  # held a little way in, as a request waiting through a reload would be
            held = off
            continue
        in_flight.append(off)
        if len(in_flight) > 4:
            free_block(buf, in_flight.pop(0))
    assert held > 100 * 500
    for off in in_flight:
        free_block(buf, off)
    free_block(buf, held)
    # Once the held block is back, steady traffic returns to the first pages.
    in_flight = []
    for _ in range(200_000):
        off = arena.alloc(500)
        in_flight.append(off)
        if len(in_flight) > 4:
            free_block(buf, in_flight.pop(0))
    assert max(in_flight) < SOFT_LIMIT + 4096


@pytest.mark.parametrize("late_every, held_for", [(50, 64), (100, 100)])
def test_large_bodies_completing_out_of_order_never_find_the_arena_full(late_every, held_for):
    """16 clients with 600 KB bodies (ResNet-50 images): about 10 MB in flight in a 256 MiB arena,
    and now and then a block freed generations late (a body still arriving while others are
    answered). The head goes back to the start only with room for many generations before the
    oldest block, so no allocation finds the arena full: a full arena means overload, not bad luck.
    (With the room for two generations this took, in 20,000 requests, 3,400 and 1,122 waits.)"""
    size = 256 << 20
    buf = memoryview(bytearray(size))
    arena = Arena(buf, 0, size)
    in_flight: list[int] = []
    late: list[tuple[int, int]] = []  # (freed after allocation number, offset), in that order
    full = 0
    for i in range(20_000):
        off = arena.alloc(602_304)
        while off < 0:  # time passes: the oldest answer comes back
            full += 1
            free_block(buf, in_flight.pop(0) if in_flight else late.pop(0)[1])
            off = arena.alloc(602_304)
        if i % late_every == 7:
            late.append((i + held_for, off))
        else:
            in_flight.append(off)
        if len(in_flight) > 16:
            free_block(buf, in_flight.pop(0))
        while late and late[0][0] <= i:
            free_block(buf, late.pop(0)[1])
    assert full == 0


def test_live_bytes_counts_only_the_blocks_still_held():
    """Behind a held block, freed blocks stay unreclaimed (FIFO) and count in ``bytes_in_use``;
    ``live_bytes`` tells a full arena from one cut by a single held block."""
    size = 1 << 20
    buf = memoryview(bytearray(size))
    arena = Arena(buf, 0, size)
    held = arena.alloc(1000)
    others = [arena.alloc(1000) for _ in range(10)]
    for off in others:
        free_block(buf, off)
    arena.alloc(0)  # an allocation reclaims what it can: nothing, the oldest block is held
    one = (BLOCK_HEADER + 1000 + 63) & ~63
    assert arena.bytes_in_use >= 11 * one
    assert arena.live_bytes() == one + BLOCK_HEADER + 64  # the held block and the last allocation
    free_block(buf, held)


def test_pages_are_taken_a_step_ahead_of_the_head_and_a_refusal_changes_nothing():
    """``backing`` (``Segment.populate`` in the product) is asked for the pages a block reaches
    before its header is written there; where it says no (/dev/shm full), the block is refused
    with ``starved`` set and the arena is as it was, and it goes on once pages come back."""
    size = 4 << 20
    buf = memoryview(bytearray(size))
    asked: list[tuple[int, int]] = []
    room = {"upto": 1 << 20}  # what the filesystem could still give: up to 1 MiB of the arena

    def backing(start: int, end: int) -> bool:
        asked.append((start, end))
        return end <= room["upto"]

    arena = Arena(buf, 0, size, backing)
    first = arena.alloc(1000)
    assert first == BLOCK_HEADER and asked == [(0, BACKING_STEP)] and not arena.starved
    assert arena.alloc(1000) > first and len(asked) == 1  # inside the pages taken: not asked again
    in_use = arena.bytes_in_use
    assert arena.alloc(2 << 20) == -1 and arena.starved  # its pages are not there
    assert arena.bytes_in_use == in_use and buf[in_use:in_use + 16].tobytes() == bytes(16)  # nothing written
    room["upto"] = size
    big = arena.alloc(2 << 20)
    assert big > 0
    assert asked[-1] == (BACKING_STEP, 3 * BACKING_STEP)  # from where it stopped, a step past the block
    assert arena.alloc(3 << 20) == -1 and not arena.starved  # (no room in the arena itself: said apart)
    free_block(buf, first)
    assert arena.alloc(100) > 0
