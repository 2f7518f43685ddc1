"""Who a network peer is when it registers or unregisters shared memory, the same way for HTTP
and gRPC: the ``caller`` of the control message (``NetworkCaller``, shm/control_messages.py) the
broker checks the region against.

Registering is for peers on this host (loopback) unless ``--allow-remote-shm``; a peer on this
host is known by the user that owns its socket (``peer_uid.py``), and one whose socket cannot be
found is refused rather than guessed. A peer on another host, let in by ``--allow-remote-shm``,
has no user here: it registers with the server's own rights, which is what that flag accepts.
"""
from __future__ import annotations

import asyncio

from shmserve.shm.control_messages import NetworkCaller

from .metadata import is_loopback
from .peer_uid import peer_uid


class ShmRefused(Exception):
    """A registration refused before it reaches the broker (HTTP 403, gRPC PERMISSION_DENIED)."""

    status = 403


async def registering_caller(kind: str, host: str, port: int | None, server: tuple[str, int] | None,
                             allow_remote_shm: bool, admin: bool) -> NetworkCaller:
    """The caller of a register request from ``host:port`` (``server``: our end, if known);
    ``kind``: 'system' or 'CUDA', for the message. Raises ShmRefused."""
    loopback = is_loopback(host)
    if not loopback and not allow_remote_shm:
        raise ShmRefused(f"registering {kind} shared memory is only allowed from this host "
                         f"(start the server with --allow-remote-shm to change that)")
    uid = await _uid(host, port, server)
    if uid is None and loopback:
        raise ShmRefused(f"cannot register {kind} shared memory: the user of this connection could not be "
                         f"told (its socket is not in /proc/net/tcp or tcp6)")
    return NetworkCaller(uid, admin)


async def unregistering_caller(host: str, port: int | None, server: tuple[str, int] | None,
                               admin: bool) -> NetworkCaller:
    """The caller of an unregister request: the same user lookup, and nobody refused here (the
    broker lets each caller unregister only its own regions)."""
    return NetworkCaller(await _uid(host, port, server), admin)


async def _uid(host: str, port: int | None, server: tuple[str, int] | None) -> int | None:
    if port is None or not host:
        return None
    return await asyncio.to_thread(peer_uid, host, port, server)  # reads /proc: off the event loop
