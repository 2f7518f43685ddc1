"""One copy of a CPU model's weights for all its instances: every parameter and buffer of the
module is pointed at a read-only mapping of one shared-memory file, written by whichever instance
of the load gets there first, so N instances of an 8 GB model hold 8 GB, not N x 8 GB.

The file is ``/dev/shm/shmserve.<id>.weights.<key>``, where the broker's ``weights_key`` names one
load of one version (a reload writes a new file; the broker removes a version's file once the
version is gone, and every object of the server at exit). Instances of one load read the same
module, so they lay its tensors out in the same order; a layout digest in the file's header
guards that. A tensor shared by several names (tied weights) is stored once.

Each instance maps the file copy-on-write (``MAP_PRIVATE``): a model that writes into its own
parameters gets private copies of the pages it touches, and the other instances never see the
change. The parameter ``SHARE_WEIGHTS: "no"`` turns sharing off.
"""
from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
from typing import Any

from shmserve.shm import space
from shmserve.shm.names import SHM_DIR, object_name

ALIGN = 64
HEADER = struct.Struct("<32sQ")  # layout digest, data bytes


def weights_path(server_id: str, key: str) -> str:
    return SHM_DIR + object_name(server_id, "weights", key)


def _tensors(module: Any) -> list[tuple[str, Any]]:
    """Every parameter and buffer, each storage once (tied weights share one entry)."""
    out, seen = [], set()
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t is None or t.device.type != "cpu" or t.numel() == 0:
            continue
        ident = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        if ident in seen:
            continue
        seen.add(ident)
        out.append((name, t))
    return out


def _layout(tensors: list[tuple[str, Any]]) -> tuple[list[int], int, bytes]:
    """(offset of each tensor, total bytes, digest of names, dtypes and shapes)."""
    offsets, pos, digest = [], 0, hashlib.sha256()
    for name, t in tensors:
        offsets.append(pos)
        pos += (t.numel() * t.element_size() + ALIGN - 1) & ~(ALIGN - 1)
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
    return offsets, pos, digest.digest()


def _write(path: str, tensors: list[tuple[str, Any]], offsets: list[int], size: int, digest: bytes) -> None:
    """Write the file beside its final name, then rename: a reader sees all of it or nothing."""
    import torch

    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        _fill(tmp, tensors, offsets, size, digest, torch)
    except OSError:
        os.unlink(tmp)  # /dev/shm is full: no half-written file stays behind
        raise
    os.rename(tmp, path)


def _fill(tmp: str, tensors: list[tuple[str, Any]], offsets: list[int], size: int, digest: bytes, torch: Any) -> None:
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(digest, size))
        f.truncate(ALIGN + size)
        for (_, t), off in zip(tensors, offsets):
            f.seek(ALIGN + off)
            f.write(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))


def share(module: Any, server_id: str, key: str) -> int:
    """Point ``module``'s CPU weights at the load's shared copy (writing it if this instance is
    the first); returns the bytes now shared (0: nothing to share)."""
    import torch

    tensors = _tensors(module)
    if not tensors:
        return 0
    offsets, size, digest = _layout(tensors)
    path = weights_path(server_id, key)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others wait, then map what it wrote
        if not os.path.exists(path):
            # Checked first, and written under the counting lock: the write would fail cleanly
            # when /dev/shm is full, but it could also take pages that the arenas' counted room
            # (shm/space.py) relies on.
            with space.counting(server_id):
                space.check(server_id, ALIGN + size, "this model's shared copy of its weights",
                            " (parameter SHARE_WEIGHTS: \"no\" keeps a private copy per instance instead)")
                _write(path, tensors, offsets, size, digest)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    found, data_size = HEADER.unpack_from(mapped, 0)
    if found != digest or data_size != size:
        mapped.close()
        raise RuntimeError(f"shared weights '{path}' were written for another layout of this model")
    with torch.no_grad():
        for (_, t), off in zip(tensors, offsets):
            shared = torch.frombuffer(mapped, dtype=t.dtype, count=t.numel(), offset=ALIGN + off).view(t.shape)
            t.set_(shared)
    return size
