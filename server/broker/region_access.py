"""Who may register a shared-memory region, and who may unregister it.

Registering makes the server read and write an object on the caller's behalf, so it is allowed
only for an object the caller could open itself for reading and writing, as ``shm_open(O_RDWR)``
would decide for that user: the object's owner, group, mode and ACL against the caller's uid and
groups (from the user database), uid 0 opening anything (shm/access.py). A key under ``/shmclient.<ticket>.`` is
the local client process's own (``Client.create_region``; the ticket is its liveness lock,
shm/liveness.py) and no one else may name it.

A region belongs to whoever registered it: a local client's connection, or a network caller's
uid. Only its owner unregisters it, or an admin (a request that carried the key of the
restricted 'shared-memory' group); an unregister-all unregisters what the caller may.
"""
from __future__ import annotations

import dataclasses
import os
import pwd
from typing import Any

from shmserve.shm import access
from shmserve.shm.names import CLIENT_PREFIX
from shmserve.shm.control_messages import NetworkCaller
from shmserve.signature import InvalidRequest

from .models import Client


class RegionDenied(InvalidRequest):
    """The caller may not do this to the region: 403 (gRPC PERMISSION_DENIED)."""

    status = 403




class ClientShmDisabled(InvalidRequest):
    status = 501


@dataclasses.dataclass(frozen=True)
class Owner:
    """Who registered a region. ``uid`` None: a peer on another host, which no one here can be
    told apart from (``--allow-remote-shm``); ``connection``: the local client's, else None."""

    uid: int | None
    connection: str | None = None


@dataclasses.dataclass(frozen=True)
class Caller:
    owner: Owner
    admin: bool = False
    ticket: int | None = None  # a local client's process's liveness ticket (shm/liveness.py)

    def may_unregister(self, owner: Owner) -> bool:
        return self.admin or owner == self.owner


def caller_of(named: NetworkCaller | None, client: Client) -> Caller:
    """The caller of a control request: the network caller a frontend named (its
    ``caller``), else the local client itself, as the owner of its segment when the broker
    attached it (the name's object now may be another: its owner may replace it)."""
    if named is not None:
        return Caller(Owner(named.uid), named.admin)
    return Caller(Owner(client.uid, client.name), False, client.ticket)


def check_client_key(name: str, key: str, caller: Caller) -> None:
    """A key under ``/shmclient.<ticket>.`` may be registered only by the local client process
    holding ``<ticket>`` (shm/liveness.py), not by its pid: pids repeat across PID namespaces."""
    bare = key.lstrip("/")
    if not bare.startswith(CLIENT_PREFIX):
        return
    ticket = bare[len(CLIENT_PREFIX):].partition(".")[0]
    if caller.owner.connection is None or str(caller.ticket) != ticket:
        raise InvalidRequest(f"cannot register shared memory region '{name}' with key '{key}' as the key "
                             f"contains the reserved prefix '{CLIENT_PREFIX}' (the objects of another "
                             f"local client)")


def check_may_open(key: str, fd: int, st: os.stat_result, caller: Caller) -> None:
    """Refuse an object (``fd`` open on it, ``st`` its ``fstat``) the caller could not open for
    reading and writing itself, its ACL included. A caller of unknown uid (a remote peer under
    --allow-remote-shm) has the server's rights."""
    uid = caller.owner.uid
    if uid is None or access.may_open(fd, st, uid, groups_of(uid)):
        return
    raise RegionDenied(f"Unable to open shared memory region: '{key}': permission denied (uid {uid} may not "
                       f"read and write it)")


def groups_of(uid: int) -> set[int]:
    """The user's primary and supplementary groups from the user database (none for a uid it
    does not know): the groups a login of that user would have."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return set()
    try:
        return set(os.getgrouplist(entry.pw_name, entry.pw_gid))
    except OSError:
        return {entry.pw_gid}


def owner_json(owner: Owner) -> dict[str, Any]:
    """What the journal keeps of a network caller's region (local clients' are not journaled)."""
    return {"uid": owner.uid}


def owner_from_json(saved: dict[str, Any]) -> Owner:
    uid = saved.get("uid")
    return Owner(uid if isinstance(uid, int) else None)
