"""Who holds a TCP port: named in the launcher's "Address already in use" error, so an operator
sees at once which process (often a server of ours left running) to stop.

The kernel lists every socket in ``/proc/net/tcp`` and ``/proc/net/tcp6`` with its inode; a process
holding one has a descriptor that links to ``socket:[inode]``. Processes of other users may not be
readable: then the port is said to be held without a name.
"""
from __future__ import annotations

import os

LISTEN = "0A"  # the state column of a listening socket


def listening_inodes(port: int, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> set[int]:
    """The inodes of the sockets listening on ``port`` (any address)."""
    found: set[int] = set()
    for table in tables:
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != LISTEN:
                continue
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(int(fields[9]))
    return found


def holders(port: int) -> list[tuple[int, str]]:
    """(pid, command line as ``ps`` shows it, i.e. our process titles) of the processes holding a
    socket that listens on ``port``."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    out = []
    if not wanted:
        return out
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if not any(os.readlink(f"/proc/{entry}/fd/{fd}") in wanted for fd in fds):
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:  # gone meanwhile, or another user's
            continue
        out.append((int(entry), title))
    return sorted(out)


def describe(port: int) -> str:
    """`` (held by pid N: title; ...)`` for an error message, or "" when nobody can be named."""
    named = holders(port)
    if not named:
        return ""
    return " (held by " + "; ".join(f"pid {pid}: {title}" for pid, title in named) + ")"
