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

/dev/shm is world-writable and the keys are predictable, so the file and its lock file are the
server's user's alone: made 0600 with O_EXCL, and one found is used only if it is a regular file of
that user, 0600, with no other link (and, the weights, whole for this layout). Another's is removed
where the user may (root in a sticky /dev/shm), and its key used; else the next of ``candidates``
is tried, and after ``TRIES`` the instance keeps a private copy: another user can neither read the
weights, nor put its own in their place, nor make a load wait on a lock it holds.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import secrets
import struct
from typing import Any

from shmserve.shm import space
from shmserve.shm.access import not_ours_alone
from shmserve.shm.names import SHM_DIR, object_name

ALIGN = 64
HEADER = struct.Struct("<32sQ")  # layout digest, data bytes
TRIES = 8  # names tried for one load's file when another user's stand in the way


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


def candidates(key: str) -> list[str]:
    """The keys one load's instances try, in order: the broker's, then ``<key>~1``... for a name
    another user made first that this user may not remove (a sticky /dev/shm). Every instance
    walks the same list with the same checks, so they meet at the same file."""
    return [key] + [f"{key}~{i}" for i in range(1, TRIES)]


class Taken(OSError):
    """A name is another user's (or not a plain file) and this user may not remove it."""


def _ours_alone(fd: int) -> bool:
    """Whether the open file is a regular file of this user's that no one else may open or
    reach by another name: only then may its lock be waited on or its bytes be mapped."""
    return not not_ours_alone(os.fstat(fd))


def _remove(path: str, why: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        raise Taken(errno.EEXIST, f"shared weights name '{path}' {why} and cannot be removed ({e.strerror})") from None


def _open_existing(path: str) -> int | None:
    """A descriptor of the file at ``path`` if it is ours alone; None if nothing is there (what
    was there and was not ours is removed first). Never follows a link, never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError:  # a link (ELOOP), or what we may not open: not ours either way
        fd = -1
    if fd >= 0:
        if _ours_alone(fd):
            return fd
        os.close(fd)
    _remove(path, "is not a file of this user's alone")
    return None


def _lock_fd(path: str) -> int:
    """The lock file of a weights file, ours alone (0600, made with O_EXCL): another user's
    can never make a load wait."""
    for _ in range(2):  # (another user may make the name again between our removal and our make)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            os.fchmod(fd, 0o600)  # (not under the umask)
            return fd
        except FileExistsError:
            pass
        fd = _open_existing(path)
        if fd is not None:
            return fd
    raise Taken(errno.EEXIST, f"shared weights lock '{path}' is made again by another user as it is removed")


def _open_complete(path: str, size: int, digest: bytes) -> int | None:
    """A descriptor of the weights file at ``path`` if it is ours alone and was written whole
    for this layout (the header and the size); None when it must be written (a file that was
    not is removed)."""
    fd = _open_existing(path)
    if fd is None:
        return None
    if os.fstat(fd).st_size == ALIGN + size and os.pread(fd, HEADER.size, 0) == HEADER.pack(digest, size):
        return fd
    os.close(fd)
    _remove(path, "was written for another layout of this model")
    return None


def _write(path: str, tensors: list[tuple[str, Any]], offsets: list[int], size: int, digest: bytes) -> int:
    """Write the file under a name of its own (0600, O_EXCL), then link it to its final name,
    which must not exist: a reader sees all of it or nothing, and only ours. Returns its
    descriptor."""
    import torch

    for _ in range(TRIES):
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    else:
        raise Taken(errno.EEXIST, f"no free name to write '{path}' under")
    try:
        os.fchmod(fd, 0o600)  # (not under the umask)
        _fill(fd, tensors, offsets, size, digest, torch)
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        os.close(fd)
        raise Taken(errno.EEXIST, f"shared weights name '{path}' was made by another user as it was written") from None
    except BaseException:
        os.close(fd)
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)  # (/dev/shm full: no half-written file stays behind)
    return fd


def _fill(fd: int, tensors: list[tuple[str, Any]], offsets: list[int], size: int, digest: bytes, torch: Any) -> None:
    _pwrite_all(fd, HEADER.pack(digest, size), 0)
    os.ftruncate(fd, ALIGN + size)
    for (_, t), off in zip(tensors, offsets):
        _pwrite_all(fd, memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()), ALIGN + off)


def _pwrite_all(fd: int, data: Any, at: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, at)
        view, at = view[n:], at + n


def _shared_fd(server_id: str, key: str, tensors: list[tuple[str, Any]], offsets: list[int], size: int,
               digest: bytes) -> tuple[str, int]:
    """The path and descriptor of the load's file, written if this instance is the first; the
    first of ``candidates(key)`` whose names are ours, or can be made ours."""
    why = ""
    for candidate in candidates(key):
        path = weights_path(server_id, candidate)
        try:
            lock = _lock_fd(path + ".lock")
        except Taken as e:
            why = str(e)
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one writer; the others wait, then map what it wrote
            fd = _open_complete(path, size, digest)
            if fd is None:
                # Checked first, and written under the counting lock: the write would fail cleanly
                # when /dev/shm is full, but it could also take pages that the arenas' counted room
                # (shm/space.py) relies on.
                with space.counting(server_id):
                    space.check(server_id, ALIGN + size, "this model's shared copy of its weights",
                                " (parameter SHARE_WEIGHTS: \"no\" keeps a private copy per instance instead)")
                    fd = _write(path, tensors, offsets, size, digest)
            return path, fd
        except Taken as e:
            why = str(e)
        finally:
            os.close(lock)  # (closing lets go of the lock)
    raise Taken(errno.EEXIST, f"no name of {TRIES} for this model's shared copy of its weights is free: {why}")


def share(module: Any, server_id: str, key: str) -> int:
    """Point ``module``'s CPU weights at the load's shared copy (writing it if this instance is
    the first); returns the bytes now shared (0: nothing to share)."""
    import torch

    tensors = _tensors(module)
    if not tensors:
        return 0
    offsets, size, digest = _layout(tensors)
    path, fd = _shared_fd(server_id, key, tensors, offsets, size, digest)
    try:
        mapped = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    found, data_size = HEADER.unpack_from(mapped, 0)
    if found != digest or data_size != size:
        mapped.close()
        raise RuntimeError(f"shared weights '{path}' were written for another layout of this model")
    with torch.no_grad():
        for (_, t), off in zip(tensors, offsets):
            shared = torch.frombuffer(mapped, dtype=t.dtype, count=t.numel(), offset=ALIGN + off).view(t.shape)
            t.set_(shared)
    return size
