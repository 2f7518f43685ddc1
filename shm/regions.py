"""Client-side shared-memory regions: create one, or find the region an existing array lives in.

A region is a POSIX shared-memory object the client owns and registers with the server by name;
tensors inside it travel by (region, offset, size) with no byte copied.
"""
from __future__ import annotations

import mmap
from typing import Any

import numpy as np
import posix_ipc

from .access import grant
from .names import CLIENT_PREFIX, is_server_object
from .space import HOW_TO_RAISE, NoRoom, mib, take_pages


def created_key_prefix(ticket: int) -> str:
    """The key prefix of the regions ``Region.create`` makes for the client process holding
    liveness ``ticket`` (shm/liveness.py; a pid would repeat across PID namespaces): the server
    unlinks the ones a dead client registered as created (nobody else could any more)."""
    return f"/{CLIENT_PREFIX}{ticket}."


class Region:
    """A shared-memory object mapped here; ``array`` gives numpy views into it."""

    def __init__(self, name: str, key: str, size: int, mm: mmap.mmap | None, owner: bool, offset: int = 0) -> None:
        self.name = name
        self.key = key
        self.size = size
        self.offset = offset  # of this region within the object named by key
        self._mmap = mm
        self.buf: memoryview | None = memoryview(mm) if mm is not None else None
        self.owner = owner

    @classmethod
    def create(cls, name: str, size: int, key: str, readers: tuple[int, ...] = ()) -> "Region":
        """A new object of mode 0600 that ``readers`` (the server's user when it is not ours,
        access.py) may open too, its pages taken now (NoRoom where /dev/shm cannot hold them)."""
        if is_server_object(key):
            raise ValueError(f"key '{key}' is in the server's own namespace")
        shm = posix_ipc.SharedMemory(key, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            grant(shm.fd, readers)
            mm = mmap.mmap(shm.fd, size)
            if not take_pages(mm, key, 0, size):  # (its writes would be SIGBUS: space.py)
                mm.close()
                raise NoRoom(f"/dev/shm is full: region '{name}' could not take its {mib(size)}; {HOW_TO_RAISE}")
        except BaseException:
            shm.close_fd()
            shm.unlink()
            raise
        shm.close_fd()
        return cls(name, key, size, mm, owner=True)

    def array(self, dtype: Any, shape: tuple[int, ...] | list[int], offset: int = 0) -> np.ndarray:
        assert self.buf is not None
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at offset {offset} do not fit region '{self.name}' ({self.size} bytes)")
        return np.ndarray(tuple(shape), dtype=dt, buffer=self.buf, offset=offset)

    def locate(self, array: np.ndarray) -> int | None:
        """Offset of ``array``'s bytes in this region, if it is a contiguous view into it."""
        if self.buf is None or not array.flags.c_contiguous:
            return None
        base = np.frombuffer(self.buf, dtype=np.uint8).__array_interface__["data"][0]
        ptr = array.__array_interface__["data"][0]
        if base <= ptr and ptr + array.nbytes <= base + self.size:
            return ptr - base
        return None

    def close(self) -> None:
        """Let go of the region. Its mapping is never closed here: the arrays ``array`` made hold
        the mmap itself (numpy keeps it as their base, with no buffer export that would stop a
        close), and unmapping it under them would crash the reader; it goes when the last does."""
        if self.buf is not None:
            try:
                self.buf.release()
            except BufferError:
                pass  # a view of our memoryview lives on: it keeps the mapping too
            self.buf = None
        self._mmap = None
        if self.owner:
            try:
                posix_ipc.unlink_shared_memory(self.key)
            except posix_ipc.ExistentialError:
                pass


def find_shm_mapping(address: int) -> tuple[str, int] | None:
    """(key, offset) of the /dev/shm object mapped at ``address`` in this process, from
    /proc/self/maps: how an array or torch tensor that already lives in shm is recognised."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6:
                continue
            path = parts[5].strip()
            if not path.startswith("/dev/shm/"):
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address < end:
                if path.endswith(" (deleted)"):
                    raise ValueError(
                        "the array's shared-memory object has no name any more (it was unlinked, as torch's "
                        "default 'file_descriptor' sharing strategy does), so the server cannot open it: use "
                        "torch.multiprocessing.set_sharing_strategy('file_system') or Client.create_region()")
                return "/" + path[len("/dev/shm/"):], address - start + int(parts[2], 16)
    return None
