"""Who asks the broker to register or unregister a shared-memory region: the ``caller`` field a
network frontend adds to those control requests (the one definition both sides use).

A request without it comes from a local client (``shmserve.Client``), which the broker knows by
its connection. The field is trusted only from a client of the server's own user (the owner of
its segment; the frontends fill it in from the kernel, ``frontend/peer_uid.py``, and from the
restricted-API check, never from the request): the broker drops it from a local client of a
user named by ``--local-client-users`` (server/broker/control.py).
"""
from __future__ import annotations

from typing import TypedDict

FIELD = "caller"
ADMIN_GROUP = "shared-memory"  # the restricted-API group whose key makes a caller an admin


class CallerDoc(TypedDict):
    uid: int | None  # the peer's user; None: a peer with no socket on this host (--allow-remote-shm)
    admin: bool  # the request carried the key of a restricted 'shared-memory' group


def caller_doc(uid: int | None, admin: bool) -> CallerDoc:
    return {"uid": uid, "admin": admin}
