"""Who holds a TCP port: named in the launcher's "Address already in use" error, so an operator
sees at once which process (often a server of ours left running) to stop.

A listening socket is a row of the kernel's tables (``tcp_table.py``); a process holding it has a
descriptor that links to it. Processes of other users may not be readable: then the port is said
to be held without a name.
"""
from __future__ import annotations

import os

from shmserve.shm.names import title_of

from .tcp_table import LISTEN, socket_inodes, socket_rows


def holders(port: int) -> list[tuple[int, str]]:
    """(pid, command line as ``ps`` shows it, i.e. our process titles) of the processes holding a
    socket that listens on ``port``."""
    wanted = {r.inode for r in socket_rows() if r.state == LISTEN and r.local[1] == port}
    out = []
    if not wanted:
        return out
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or not wanted & socket_inodes(entry):
            continue
        title = title_of(entry)
        if title:  # ('' : gone meanwhile)
            out.append((int(entry), title))
    return sorted(out)


def describe(port: int) -> str:
    """`` (held by pid N: title; ...)`` for an error message, or "" when nobody can be named."""
    named = holders(port)
    if not named:
        return ""
    return " (held by " + "; ".join(f"pid {pid}: {title}" for pid, title in named) + ")"
