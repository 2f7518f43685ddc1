"""The unit tests' shared memory: real POSIX segments, each mapped twice (its creator's mapping
and a second one, as another process would have), all unlinked after the test, which checks that
none is left in /dev/shm. A module, not a conftest: a second ``conftest`` module would shadow the
suite's, which the tests import by that name."""
from __future__ import annotations

import itertools
import os
from typing import Callable, Iterator

import pytest

from shmserve.shm.segment import Segment

_names = itertools.count()


@pytest.fixture
def segment_pair() -> Iterator[Callable[[int], tuple[Segment, Segment]]]:
    """Makes (created, attached) mappings of a new segment of the given size."""
    made: list[tuple[Segment, Segment]] = []

    def make(size: int) -> tuple[Segment, Segment]:
        name = f"/shmserve.unit{os.getpid()}_{next(_names)}.test.0"
        created = Segment.create(name, size)
        try:
            attached = Segment.attach(name)
        except BaseException:
            created.close()
            created.unlink()
            raise
        made.append((created, attached))
        return created, attached

    yield make
    for created, attached in made:
        attached.close()
        created.close()
        created.unlink()
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"shmserve.unit{os.getpid()}_")]
    assert not left, f"shared memory left behind: {left}"
