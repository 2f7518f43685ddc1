"""The restricted-API group whose key makes a caller of the shared-memory API an admin: it may
unregister regions other callers registered (server/broker/region_access.py). The caller itself
travels in the control message (``NetworkCaller``, shm/control_messages.py): the frontends fill
it in from the kernel (``server/edge/peer_uid.py``) and from the restricted-API check, never from
the request, and the broker drops it from a local client of a user named by
``--local-client-users`` (server/broker/control.py).
"""
from __future__ import annotations

ADMIN_GROUP = "shared-memory"
