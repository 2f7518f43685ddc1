"""Each user's share of an output arena (``OutputArenas`` under --local-client-users): an answer
is refused for good (500) only when no retry could ever give it room, and one refused for now
(503) is served once room is back. Real extents in /dev/shm, the users named by number."""
from __future__ import annotations

import os
from typing import Iterator

import pytest

from shmserve.shm.arena import Arena
from shmserve.shm.extents import MIB, AnswerTooLarge, OutputArenas, Owner
from shmserve.shm.names import object_name
from shmserve.shm.segment import Segment

NAMED = (65533, 65534)  # two users named: three shares (the server's user counted)
USER = 65534


@pytest.fixture
def make_arenas() -> Iterator:
    made: list[tuple[OutputArenas, Segment]] = []
    server_id = f"ushare{os.getpid()}"

    def make(cap_mib: int) -> OutputArenas:
        first_seg = Segment.create(object_name(server_id, "worker", 1), 4 * MIB, (), taken=0)
        first = Arena(first_seg.buf, 0, 4 * MIB, first_seg.populate)
        owner = Owner("model instance 'x'", "the instance's output arena", "one instance's extents",
                      "--worker-arena-mb", "a hint", lambda k: object_name(server_id, "worker", f"1.arena.{k}"),
                      lambda k, size: None)
        arenas = OutputArenas(first, first_seg, server_id, cap_mib * MIB, MIB, owner, NAMED)
        made.append((arenas, first_seg))
        return arenas

    yield make
    for arenas, first_seg in made:
        arenas.close()
        first_seg.close()
        first_seg.unlink()
    assert not [n for n in os.listdir("/dev/shm") if server_id in n]


def test_a_share_is_whole_mib_so_an_answer_past_it_is_refused_for_good(make_arenas):
    """256 MiB in three shares is 85.33 MiB: an answer between 81 MiB and the share less the
    home extent (4 MiB) was a 503 on an idle arena for ever, since extents are made in whole MiB."""
    arenas = make_arenas(256)
    assert arenas.share_of(USER) == 85 * MIB
    assert arenas.share_of(os.geteuid()) == arenas.share_of(0) == 256 * MIB
    with pytest.raises(AnswerTooLarge, match="one user's share"):
        arenas.alloc(81 * MIB + 200_000, 1, USER)
    extent, off = arenas.alloc(80 * MIB, 1, USER)  # (what the share less its home holds is served)
    assert off >= 0


def test_an_answer_that_fits_the_home_extent_is_never_refused_for_good(make_arenas):
    """With a share (5 MiB) not much larger than the home extent (4 MiB), an answer that fits the
    home but not beside an answer kept there was a 500, never to be served; it is a 503 now, and
    served once the kept answer is read."""
    arenas = make_arenas(16)
    kept = arenas.alloc(3 * MIB, 1, USER)
    assert kept[1] >= 0
    assert arenas.alloc(2 * MIB, 1, USER)[1] < 0  # (no room now: retry)
    arenas.free(*kept)
    assert arenas.alloc(2 * MIB, 1, USER)[1] >= 0


def test_the_servers_users_answer_past_what_the_cap_leaves_is_refused_for_good(make_arenas):
    """The server's user's pool keeps its home extent too: an answer larger than the cap less
    every home extent was a 503 for ever."""
    arenas = make_arenas(32)
    with pytest.raises(AnswerTooLarge, match="--worker-arena-mb=32: raise it"):
        arenas.alloc(30 * MIB, 1, os.geteuid())
    assert arenas.alloc(20 * MIB, 1, os.geteuid())[1] >= 0
