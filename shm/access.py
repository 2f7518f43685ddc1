"""Which other users may open a shared-memory object: a POSIX ACL entry for each, on an object
whose mode stays 0600.

By default no one: the server's objects are its user's, a client's are the client's. Two
containers of one pod may run as different users (docs/deploy.md). Then the server, started
with ``--local-client-users``, names those users ``readers`` of what local clients must open
(the broker's and workers' segments and their grown extents); and a local client of another user
names the server's user reader of its own objects (its segment or FIFO, and the
regions it creates). Neither names anyone else, so one client's objects stay closed to another
client. tmpfs keeps ACLs (``CONFIG_TMPFS_POSIX_ACL``, on in common kernels); where it does not,
granting fails with a clear error rather than opening the object wider.
"""
from __future__ import annotations

import os
import pwd
import stat
import struct
from typing import Collection, Iterable, Sequence

# The broker passes the server's readers to its workers in the environment (the launcher gives
# them to the broker in its options; frontends, mere clients of the broker, never get them).
READERS_ENV = "SHMSERVE_LOCAL_CLIENT_UIDS"

_XATTR = "system.posix_acl_access"
_VERSION = 2
_ENTRY = struct.Struct("<HHI")
_USER_OBJ, _USER, _GROUP_OBJ, _GROUP, _MASK, _OTHER = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20
_RW, _R, _W, _NONE = 6, 4, 2, 0
_UNDEFINED_ID = 0xFFFFFFFF


class GrantError(OSError):
    """The filesystem would not take the ACL (no ACL support): the object stays its owner's."""


def parse_users(text: str) -> list[int]:
    """``--local-client-users``: user names or uids, comma-separated. Raises ValueError naming
    one that this host's user database does not know (a bare uid need not be known)."""
    uids: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if item.isdigit():
            uids.append(int(item))
            continue
        try:
            uids.append(pwd.getpwnam(item).pw_uid)
        except KeyError:
            raise ValueError(f"unknown user '{item}' (give its uid)") from None
    return sorted(set(uids))


def others(uids: Iterable[int]) -> tuple[int, ...]:
    """``uids`` without this process's own user and root (who need no entry to open anything)."""
    me = os.geteuid()
    return tuple(sorted({u for u in uids if u not in (me, 0)}))


def server_readers() -> tuple[int, ...]:
    """The readers a server process (broker, worker) gives the objects local clients open."""
    return others(int(u) for u in os.environ.get(READERS_ENV, "").split(",") if u.strip().isdigit())


def readers_environment(uids: Sequence[int]) -> dict[str, str]:
    """The environment entry that makes ``uids`` a child's ``server_readers``."""
    return {READERS_ENV: ",".join(str(u) for u in uids)}


def acl(readers: Sequence[int], write: bool = True) -> bytes:
    """The ACL of a 0600 object that ``readers`` may also read and write (only read, without
    ``write``)."""
    perm = _RW if write else _R
    entries = [(_USER_OBJ, _RW, _UNDEFINED_ID)]
    entries += [(_USER, perm, uid) for uid in sorted(readers)]
    entries += [(_GROUP_OBJ, _NONE, _UNDEFINED_ID), (_MASK, perm, _UNDEFINED_ID), (_OTHER, _NONE, _UNDEFINED_ID)]
    return struct.pack("<I", _VERSION) + b"".join(_ENTRY.pack(*e) for e in entries)


def grant(target: int | str, readers: Sequence[int], write: bool = True) -> None:
    """Let ``readers`` open ``target`` (an open descriptor, or a path) for reading and writing
    (only for reading, without ``write``). Nothing to do without readers."""
    if not readers:
        return
    try:
        os.setxattr(target, _XATTR, acl(readers, write))
    except OSError as e:
        what = target if isinstance(target, str) else "a shared-memory object"
        raise GrantError(e.errno, f"cannot let users {list(readers)} open {what}: {e.strerror} (the "
                                  f"shared-memory filesystem must support POSIX ACLs for local clients of "
                                  f"another user)") from None


def readers_of(path: str) -> tuple[int, ...]:
    """The users an object's ACL names besides its owner (none without an ACL)."""
    try:
        raw = os.getxattr(path, _XATTR)
    except OSError:
        return ()
    return tuple(uid for tag, _, uid in _ENTRY.iter_unpack(raw[4:]) if tag == _USER)


def _acl_entries(target: int | str) -> list[tuple[int, int, int]] | None:
    """(tag, permissions, id) of each entry of ``target``'s ACL (a descriptor or a path), in
    the order the kernel keeps them (by tag, then id); None without an ACL."""
    try:
        raw = os.getxattr(target, _XATTR)
    except OSError:
        return None
    return list(_ENTRY.iter_unpack(raw[4:len(raw) - (len(raw) - 4) % _ENTRY.size]))


def may_open(target: int | str, st: os.stat_result, uid: int, groups: Collection[int], want: int = _RW) -> bool:
    """Whether user ``uid``, a member of ``groups``, may open ``target`` (a descriptor or a
    path; ``st`` its ``fstat``) for ``want`` (4: read, 2: write), as the kernel decides
    (``acl_permission_check``): root anything; the owner by the owner's bits; where an ACL is in
    force (the mode's group bits, its mask, not 0) a named user's entry, else the owning and named
    groups' entries the user is in, each under the mask, else the others' entry; without one the
    group's bits for a member, else the others'."""
    if uid == 0:
        return True
    if uid == st.st_uid:
        return (st.st_mode >> 6) & want == want
    entries = _acl_entries(target) if st.st_mode & 0o070 else None
    if not entries:
        return ((st.st_mode >> 3) if st.st_gid in groups else st.st_mode) & want == want
    mask = next((perm for tag, perm, _ in entries if tag == _MASK), 7)
    for tag, perm, entry_id in entries:
        if tag == _USER and entry_id == uid:
            return perm & mask & want == want
    in_a_group = False
    for tag, perm, entry_id in entries:
        if (tag == _GROUP_OBJ and st.st_gid in groups) or (tag == _GROUP and entry_id in groups):
            in_a_group = True
            if perm & want == want:
                return perm & mask & want == want
    if in_a_group:
        return False
    return any(tag == _OTHER and perm & want == want for tag, perm, _ in entries)


def _acl_writers(target: int | str) -> list[tuple[int, int]] | None:
    """(tag, id) of each named user's or group's entry of ``target``'s ACL (a descriptor or a
    path) that lets it write, under a mask that keeps it; None without an ACL."""
    entries = _acl_entries(target)
    if entries is None:
        return None
    mask = next((perm for tag, perm, _ in entries if tag == _MASK), _RW)
    return [(tag, uid) for tag, perm, uid in entries if tag in (_USER, _GROUP_OBJ, _GROUP) and perm & mask & _W]


def writable_by_others(target: int | str) -> bool:
    """Whether the ACL of ``target`` (a descriptor or a path) lets a user besides the owner write
    it (a named user's entry with write, under a mask that keeps it)."""
    return any(tag == _USER for tag, _ in _acl_writers(target) or ())


def other_writers(target: int, st: os.stat_result, allowed: Iterable[int] = ()) -> str:
    """Why someone besides the owner of ``target`` (a descriptor, ``st`` its ``fstat``) and the
    users ``allowed`` could have written it; "" when no one could. The owner of an object says who
    made it only then: a user may hard-link a file of another's that it may write (the kernel's
    ``protected_hardlinks`` allows exactly that) under a name of its own, and the link's owner is
    the other user."""
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} names (a hard link)"
    if st.st_mode & 0o002:
        return f"its mode {st.st_mode & 0o777:o} lets any user write it"
    writers = _acl_writers(target)
    if writers is None:  # (with an ACL, the mode's group bits are its mask)
        return f"its mode {st.st_mode & 0o777:o} lets its group write it" if st.st_mode & 0o020 else ""
    for tag, uid in writers:
        if tag != _USER:
            return "its ACL lets a group write it"
        if uid not in allowed:
            return f"its ACL lets user {uid} write it"
    return ""


def not_ours_alone(st: os.stat_result) -> str:
    """Why a file (its ``fstat``) is not this user's alone, to be read or waited on as the
    server's own in a /dev/shm every user may write; "" when it is: a plain file of this user,
    one name, and a mode that gives no one else anything (which leaves no ACL entry in force:
    the mask shows as the group's bits)."""
    if not stat.S_ISREG(st.st_mode):
        return "it is not a plain file"
    if st.st_uid != os.geteuid():
        return f"its owner is uid {st.st_uid}"
    if st.st_mode & 0o077:
        return f"its mode {st.st_mode & 0o777:o} lets others open it"
    if st.st_nlink != 1:
        return f"it has {st.st_nlink} names (a hard link)"
    return ""
