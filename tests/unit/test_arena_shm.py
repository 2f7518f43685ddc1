"""The FIFO arena over real shared memory: aligned blocks, back-pressure when full, reclaim
oldest-first only (a freed block behind a held one waits), wrap-around with the end space skipped,
blocks freed by a consumer over a second mapping, and blocks of a dead consumer taken back.
(tests/test_arena.py covers the soft limit over large arenas.)"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import time

import pytest

from shmserve.shm import liveness
from shmserve.shm.arena import ALIGN, BLOCK_HEADER, FREED, USED, Arena, free_block
from segments import segment_pair  # noqa: F401  (a fixture: real segments, mapped twice)

UNIT = 128  # what alloc(64) takes: the header and 64 bytes
BASE = 256  # the arenas here start inside their segment, as they do in the product


def arena_in(segment_pair, size: int, base: int = BASE):
    created, attached = segment_pair(base + size + 4096)
    return Arena(created.buf, base, size), created, attached


def test_offset_and_size_must_be_aligned():
    buf = memoryview(bytearray(4096))
    with pytest.raises(ValueError, match="64-byte aligned"):
        Arena(buf, 32, 1024)
    with pytest.raises(ValueError, match="64-byte aligned"):
        Arena(buf, 0, 1000)


def test_blocks_are_aligned_inside_the_arena_and_sized_with_their_header(segment_pair):
    arena, _, _ = arena_in(segment_pair, 4096)
    a, b, c = arena.alloc(1), arena.alloc(0), arena.alloc(65)
    assert a == BASE + BLOCK_HEADER
    assert [x % ALIGN for x in (a, b, c)] == [0, 0, 0]
    assert (b - a, c - b) == (UNIT, UNIT)  # 1 and 0 bytes both take one 64-byte unit
    assert arena.bytes_in_use == UNIT * 2 + 192 and arena.capacity == 4096


def test_a_full_arena_refuses_and_a_too_large_block_never_fits(segment_pair):
    arena, _, _ = arena_in(segment_pair, 1024)
    assert arena.alloc(1024) == -1  # with its header it is larger than the whole arena
    blocks = [arena.alloc(64) for _ in range(8)]
    assert all(b > 0 for b in blocks) and arena.bytes_in_use == 1024
    assert arena.alloc(1) == -1
    assert arena.bytes_in_use == 1024


def test_reclaim_is_oldest_first(segment_pair):
    arena, _, _ = arena_in(segment_pair, 1024)
    blocks = [arena.alloc(64) for _ in range(8)]
    for b in blocks[1:]:
        arena.free(b)  # all but the oldest
    assert arena.alloc(1) == -1  # the oldest still holds everything behind it
    arena.free(blocks[0])
    assert arena.alloc(1) == BASE + BLOCK_HEADER  # all reclaimed: from the start again
    assert arena.bytes_in_use == UNIT


def test_an_exactly_full_arena_wraps_to_the_start_without_skipped_space(segment_pair):
    arena, _, _ = arena_in(segment_pair, 1024)
    blocks = [arena.alloc(64) for _ in range(8)]  # ends exactly at the arena's end
    arena.free(blocks[0])
    assert arena.alloc(64) == blocks[0]
    assert arena.bytes_in_use == 1024


def test_wrap_around_skips_the_end_space_and_reclaims_it(segment_pair):
    arena, _, _ = arena_in(segment_pair, 1024)
    a, b, c = arena.alloc(320), arena.alloc(320), arena.alloc(64)  # 384 + 384 + 128: 128 left at the end
    arena.free(a)
    d = arena.alloc(192)  # 256 bytes: not at the end, so at the start, where a was
    assert d == a
    assert arena.bytes_in_use == 384 + 128 + 256  # the skipped end is in no one's use
    assert arena.alloc(64) == d + 256  # the rest of a's space, up to b
    assert arena.alloc(1) == -1
    for x in (b, c):
        arena.free(x)
    e = arena.alloc(320)  # b and c reclaimed, and the skipped end with them
    assert e == d + 256 + UNIT
    for x in (d, d + 256, e):
        arena.free(x)
    assert arena.alloc(900) == BASE + BLOCK_HEADER  # everything back: the whole arena again
    assert arena.bytes_in_use == 1024  # 900 bytes and the header, rounded up to 64


def test_a_consumer_over_a_second_mapping_reads_the_payload_and_frees_the_block(segment_pair):
    arena, created, attached = arena_in(segment_pair, 1024)
    blocks = [arena.alloc(64) for _ in range(8)]
    created.buf[blocks[3]:blocks[3] + 5] = b"hello"
    assert attached.read(blocks[3], blocks[3] + 5) == b"hello"
    for b in blocks:
        free_block(attached.buf, b)  # one store into the header, in the consumer's own mapping
    assert arena.alloc(1000 - BLOCK_HEADER) == BASE + BLOCK_HEADER


def test_an_arena_writes_nothing_outside_its_range(segment_pair):
    arena, created, _ = arena_in(segment_pair, 1024)
    total = len(created.buf)
    created.buf[:] = b"\x5a" * total
    for _ in range(50):
        blocks = [arena.alloc(100), arena.alloc(200), arena.alloc(64)]
        for b in blocks:
            assert b > 0
            arena.free(b)
    assert bytes(created.buf[:BASE]) == b"\x5a" * BASE
    assert bytes(created.buf[BASE + 1024:]) == b"\x5a" * (total - BASE - 1024)


@pytest.fixture
def tickets(tmp_path):
    """Liveness tickets on a file of their own (as the broker's segment file in a server)."""
    path = tmp_path / "tickets"
    path.touch()
    yield liveness.watch_file(str(path))
    liveness.stop_watching()


def held_ticket(path: str) -> subprocess.Popen:
    """A process that holds ticket 7 until its stdin closes; it says 'held' once it does."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys\nfrom shmserve.shm.liveness import Tickets\n"
                             f"t = Tickets({path!r}); assert t.hold(7); print('held', flush=True); sys.stdin.read()"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_blocks_of_a_dead_consumer_are_taken_back_once_room_runs_out(segment_pair, tickets):
    arena, _, _ = arena_in(segment_pair, 1024)
    holder = held_ticket(tickets.path)
    assert tickets.held(7)
    holder.stdin.close()
    holder.wait()  # gone: the kernel dropped its lock
    assert not tickets.held(7)
    held_by_dead = [arena.alloc(64, consumer=7) for _ in range(4)]
    mine = [arena.alloc(64, consumer=0) for _ in range(4)]  # 0: the owner's own, never taken back
    assert all(b > 0 for b in held_by_dead + mine)
    assert arena.alloc(UNIT * 4 - BLOCK_HEADER) == held_by_dead[0]  # the dead consumer's space
    assert arena.alloc(1) == -1  # the owner's own blocks stay until freed


def test_a_live_consumers_blocks_are_kept(segment_pair, tickets):
    arena, _, _ = arena_in(segment_pair, 1024)
    holder = held_ticket(tickets.path)  # in a process of its own: as a client in another container
    try:
        for _ in range(8):
            assert arena.alloc(64, consumer=7) > 0
        assert arena.alloc(1) == -1
    finally:
        holder.stdin.close()
        holder.wait()


def test_a_free_is_one_store_that_a_producer_never_sees_half_done(segment_pair):
    """A consumer frees a block with one 4-byte store of FREED. ``struct.pack_into`` zeroes the
    field before it writes the value: a producer reading the state in between saw 0 (not USED),
    took the held block for free and reused it, and the late FREED then marked the block's next
    answer free while its reader still read it (a stream response read as corrupt, once in some
    300,000 under load). Here one process frees and re-marks a block as fast as it can while this
    one reads its state: never anything but USED or FREED."""
    arena, created, attached = arena_in(segment_pair, 1024)
    block = arena.alloc(64)
    header = created.buf[block - BLOCK_HEADER + 8:block - BLOCK_HEADER + 12].cast("I")
    child = os.fork()
    if child == 0:  # the consumer, over its own mapping
        try:
            mark = attached.buf[block - BLOCK_HEADER + 8:block - BLOCK_HEADER + 12].cast("I")
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                for _ in range(1000):
                    free_block(attached.buf, block)
                    mark[0] = USED  # (as the producer's next block there would)
        finally:
            os._exit(0)
    seen: set[int] = set()
    try:
        while not os.waitpid(child, os.WNOHANG)[0]:
            for _ in range(1000):
                seen.add(header[0])
    finally:
        header.release()
    assert seen <= {USED, FREED} and FREED in seen, seen


def test_a_header_a_consumer_scribbled_on_never_steers_the_reclaim(segment_pair):
    """A consumer can write anywhere in the arena, its blocks' headers included: a size of 0 there
    once made the producer loop for good, a state it does not know freed the block. The producer
    reclaims by its own record of the sizes, and only FREED frees."""
    arena, created, _ = arena_in(segment_pair, 1024)
    first, second = arena.alloc(64), arena.alloc(64)
    struct.pack_into("<QI", created.buf, first - BLOCK_HEADER, 0, FREED)  # size 0, "freed"
    struct.pack_into("<I", created.buf, second - BLOCK_HEADER + 8, 7)  # a state nobody writes
    third = arena.alloc(64)  # the first is taken back by its real size; the second stays held
    assert third == second + UNIT and arena.bytes_in_use == 2 * UNIT
    free_block(created.buf, second)
    free_block(created.buf, third)
    assert arena.alloc(1) == BASE + BLOCK_HEADER and arena.bytes_in_use == UNIT
