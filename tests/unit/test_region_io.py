"""A client's region read and written through its descriptor, over real POSIX objects: a truncated
object fails the read or write (named), is never grown back by a refused write, serves again at
its full size; a key that names another object, or none, is refused, and a new registration
(another inode) opens the new object."""
from __future__ import annotations

import itertools
import os

import numpy as np
import pytest

from shmserve.shm.region_io import RegionFiles, StaleRegion

_names = itertools.count()


@pytest.fixture
def obj():
    """(key, fd) of a new 4 KiB object holding 0..255 repeated; unlinked after the test."""
    key = f"/shmserve_unit_region_io_{os.getpid()}_{next(_names)}"
    fd = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.pwrite(fd, bytes(range(256)) * 16, 0)
    yield key, fd
    os.close(fd)
    try:
        os.unlink("/dev/shm" + key)
    except FileNotFoundError:
        pass


def entry(key: str, fd: int, off: int, size: int) -> dict:
    return {"seg": key, "ino": os.fstat(fd).st_ino, "region": "r", "off": off, "size": size}


def test_truncated_object_fails_reads_and_writes_and_serves_again_once_extended(obj):
    key, fd = obj
    files = RegionFiles()
    t = entry(key, fd, 256, 1024)
    assert files.read(t).tobytes() == (bytes(range(256)) * 16)[256:1280]
    os.ftruncate(fd, 512)
    with pytest.raises(StaleRegion, match="shared memory region 'r' was truncated since it was registered"):
        files.read(t)
    with pytest.raises(StaleRegion, match="which holds 512 now"):
        files.write(t, bytes(1024))
    assert os.fstat(fd).st_size == 512  # the refused write did not grow it back
    os.ftruncate(fd, 4096)
    files.write(t, np.full(1024, 7, dtype=np.uint8))
    assert files.read(t).tobytes() == bytes([7]) * 1024


def test_key_naming_another_object_is_refused_and_a_new_registration_opens_it(obj):
    key, fd = obj
    files = RegionFiles()
    old = entry(key, fd, 0, 16)
    files.read(old)  # kept open
    os.unlink("/dev/shm" + key)
    with pytest.raises(StaleRegion, match="was removed since it was registered"):
        files.read(old)
    fd2 = os.open("/dev/shm" + key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.pwrite(fd2, bytes([9]) * 16, 0)
        with pytest.raises(StaleRegion, match="was replaced since it was registered"):
            files.read(old)  # the old object is still open here: not read either
        fresh = {**old, "ino": os.fstat(fd2).st_ino}  # registered again
        assert files.read(fresh).tobytes() == bytes([9]) * 16
        with pytest.raises(StaleRegion, match="was replaced since it was registered"):
            files.read(old)
    finally:
        os.close(fd2)
