"""Which local user is on the other end of a TCP connection: the owner of the peer's socket.

A peer on this host has its own socket in the kernel's tables (``/proc/net/tcp`` and ``tcp6``)
with our address as its remote end; the table's ``uid`` column is the user that made it, as
identd-style lookups read it. Both network frontends use this to know who registers shared
memory (``shm_callers.py``). A peer on another host has no socket here: ``None``.
"""
from __future__ import annotations

from shmserve.server.tcp_table import TIME_WAIT, Address, normal_ip, socket_inodes, socket_rows


def peer_uid(peer_host: str, peer_port: int, server: tuple[str, int] | None = None) -> int | None:
    """The uid that owns the peer's end of our connection with ``peer_host:peer_port``, or None
    if no socket here is that end (a peer on another host) or the answer is not certain.

    ``server``: our end of the connection (HTTP knows it). Without it (gRPC does not say), our
    end is found as the local address of this process's own socket whose remote end is the peer.
    Only a socket a process still holds counts (an orphaned one shows uid 0), and two owners
    for one end is no answer.
    """
    try:
        peer: Address = (normal_ip(peer_host), int(peer_port))
        ours = {(normal_ip(server[0]), int(server[1]))} if server is not None else None
    except (ValueError, TypeError):
        return None
    rows = socket_rows(peer)
    if ours is None:
        mine = socket_inodes()
        ours = {r.local for r in rows if r.remote == peer and r.inode in mine}
    uids = {r.uid for r in rows
            if r.local == peer and r.remote in ours and r.inode != 0 and r.state != TIME_WAIT}
    return uids.pop() if len(uids) == 1 else None
