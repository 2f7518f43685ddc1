"""Client shared-memory regions registered by name (the KServe system and CUDA shared-memory
extensions).

A region names a POSIX shared-memory key, an offset and a size. Every tensor that points into it
is checked against those bounds here, in the broker, before a worker ever maps the key. The
system regions are also published as a table on the broker segment, so that a worker can
resolve the regions of requests clients put on its lanes itself (``shm/region_table.py``).
"""
from __future__ import annotations

import base64
import binascii
import errno
import logging
import os
import re
from typing import Any

import posix_ipc

from shmserve.shm import region_table
from shmserve.shm.channel import REGIONS_BYTES, BrokerSegment
from shmserve.shm.names import reserved_prefix
from shmserve.shm.published import HEADER as PUBLISHED_HEADER
from shmserve.shm.region_table import EVERY_REGION, RegionEntry, RegionNotFound, RegionUseError, check_bounds, locate
from shmserve.signature import InvalidRequest

from .journal import Journal
from .region_access import Caller, Owner, RegionDenied, check_client_key, check_may_open, owner_from_json, owner_json

log = logging.getLogger("shmserve.broker")
_KEY_RE = re.compile(r"^/?[^/\0]{1,250}$")


class RegionError(InvalidRequest):
    pass


class RegionOpenFailed(RegionError):
    """A key no object answers to: Triton's INTERNAL (500), as its failed ``shm_open`` is."""

    status = 500


class UnknownRegion(RegionError):
    """The status of a region nobody registered, or a tensor naming one: Triton's NOT_FOUND."""

    status = 404


class RegionExists(RegionError):
    """A name registered already: Triton's ALREADY_EXISTS over gRPC (409 here), which its HTTP
    answers 400 (app.py)."""

    status = 409


# Triton reserves the prefix of its Python backend's own regions; shmserve reserves its own names.
TRITON_RESERVED_PREFIX = "triton_python_backend_shm_region_"


def check_key(name: str, key: Any) -> None:
    """Refuse keys no client may register, with the texts of Triton's own check (added after
    2.51, which could not open them): a key of slashes only, and a key in a namespace the server
    reserves (its own objects and its semaphores' files)."""
    if not isinstance(key, str) or not key.strip("/"):
        raise RegionError(f"cannot register shared memory region '{name}' - invalid shm key '{key}'")
    reserved = TRITON_RESERVED_PREFIX if key.lstrip("/").startswith(TRITON_RESERVED_PREFIX) else reserved_prefix(key)
    if reserved is not None:
        raise RegionError(f"cannot register shared memory region '{name}' with key '{key}' as the key contains "
                          f"the reserved prefix '{reserved}'")


def _why(e: OSError | ValueError) -> str:
    """What kept ``shm_open`` from opening a key that names something (not a missing or a
    forbidden object)."""
    if isinstance(e, ValueError):  # "." or "..", which shm_open refuses
        return "not the name of a shared-memory object"
    assert isinstance(e, OSError)
    if e.errno == errno.ELOOP:
        return "it is a symbolic link"
    if e.errno == errno.EISDIR:
        return "it is a directory"
    return e.strerror or str(e)


class Region:
    __slots__ = ("name", "key", "offset", "byte_size", "owner", "ino", "reclaim")

    def __init__(self, name: str, key: str, offset: int, byte_size: int, owner: Owner, ino: int,
                 reclaim: bool = False) -> None:
        self.name, self.key, self.offset, self.byte_size, self.owner = name, key, offset, byte_size, owner
        self.ino = ino  # the object registered: workers re-map if the key later names another
        self.reclaim = reclaim  # the owner's library created the object: unlinked if the owner dies


class _Registry:
    """What both registries share: forgetting regions and describing them as Triton does.

    An unregistered region is only marked leaving: it stays registered (listed, usable, its name
    taken) until ``Regions.settle`` finds no request using it, as Triton defers an unregister.
    """

    kind = "system"
    title = "system shared memory"

    def __init__(self) -> None:
        self.regions: dict[str, Any] = {}
        # name -> the region-table generation that first published it leaving (0: not published yet)
        self.leaving: dict[str, int] = {}
        self.other: _Registry | None = None  # the other kind's registry: Triton keeps one map for both

    def check_name_free(self, name: str) -> None:
        """Refuse a name either kind holds: Triton's one map of regions takes a name once,
        whatever its kind, and says so before it looks at anything else."""
        if name in self.regions or (self.other is not None and name in self.other.regions):
            raise RegionExists(f"shared memory region '{name}' already in manager")

    def unregister(self, name: str | None, caller: Caller) -> None:
        """Mark leaving the region ``name`` (None: every region the caller may unregister); the
        region of another owner is refused, one nobody registered is no error (as in Triton)."""
        if name is None:
            names = [n for n, r in self.regions.items() if caller.may_unregister(r.owner)]
        elif name in self.regions:
            if not caller.may_unregister(self.regions[name].owner):
                raise RegionDenied(f"shared memory region '{name}' was registered by another client: only it, or "
                                   f"a request with the restricted 'shared-memory' API key, may unregister it")
            names = [name]
        else:
            names = []
        for n in names:
            self.leaving.setdefault(n, 0)

    def forget(self, name: str) -> Any:
        self.leaving.pop(name, None)
        return self.regions.pop(name)

    def status(self, name: str | None) -> list[dict[str, Any]]:
        """Triton's status: all regions in name order (its map's), or one; a name the other kind
        holds is NOT_FOUND with Triton's words for it."""
        if name is not None:
            r = self.regions.get(name)
            if r is None and self.other is not None and name in self.other.regions:
                raise UnknownRegion(f"The region named '{name}' is registered as {self.other.title}, "
                                    f"not {self.title}")
            if r is None:
                raise UnknownRegion(f"Unable to find {self.kind} shared memory region: '{name}'")
            items = [r]
        else:
            items = [self.regions[n] for n in sorted(self.regions)]
        return [self.describe(r) for r in items]

    def describe(self, r: Any) -> dict[str, Any]:
        raise NotImplementedError


class RegionRegistry(_Registry):
    def describe(self, r: "Region") -> dict[str, Any]:
        return {"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size}

    def register(self, name: str, key: str, offset: int, byte_size: int, caller: Caller,
                 reclaim: bool = False) -> None:
        """Register ``key`` for ``caller``, who must be able to open it itself (region_access.py)."""
        check_key(name, key)
        check_client_key(name, key, caller)
        if not name:
            raise RegionError("shared memory region name must not be empty")
        self.check_name_free(name)
        self._check_key_unused(key, caller)
        if not _KEY_RE.match(key):  # shm_open refuses a name with a '/' after the first
            raise RegionError(f"Unable to open shared memory region: '{key}': a key is a single name "
                              f"such as '/my_region', not a path")
        shm_key = key if key.startswith("/") else "/" + key
        try:
            shm = posix_ipc.SharedMemory(shm_key, flags=0)
        except posix_ipc.ExistentialError:
            raise RegionOpenFailed(f"Unable to open shared memory region: '{key}'") from None
        except posix_ipc.PermissionsError:
            raise RegionDenied(f"Unable to open shared memory region: '{key}': permission denied") from None
        except (OSError, ValueError) as e:  # a symbolic link (shm_open follows none), a directory
            raise RegionOpenFailed(f"Unable to open shared memory region: '{key}': {_why(e)}") from None
        try:
            st = os.fstat(shm.fd)
            size = st.st_size
            check_may_open(key, shm.fd, st, caller)  # the object opened: its inode is what the region pins
        finally:
            shm.close_fd()
        if offset < 0 or byte_size < 0 or offset + byte_size > size:
            raise RegionError(f"failed to register shared memory region '{name}': invalid args")
        if byte_size == 0:  # in bounds, but nothing to map: Triton's mmap fails the same way
            raise RegionError(f"failed to register shared memory region '{name}': unable to process address "
                              f"space: a region needs byte_size > 0")
        self.regions[name] = Region(name, shm_key, offset, byte_size, caller.owner, st.st_ino, reclaim)

    def _check_key_unused(self, key: str, caller: Caller) -> None:
        """Refuse a network caller a key another region registered already, as Triton does: it
        reuses that region's descriptor, which it closed after mapping, so its fstat fails
        (INTERNAL). A local client may register several arrays of one object (``register_array``)."""
        if caller.owner.connection is not None:
            return
        shm_key = key if key.startswith("/") else "/" + key
        if any(r.key == shm_key for r in self.regions.values()):
            raise RegionOpenFailed(f"Invalid shared memory region: '{key}'")

    def drop_owner(self, connection: str, died: bool = False) -> None:
        """Forget a local client's regions; if it died, also unlink the objects its library
        created for it (``Client.create_region``), which would otherwise stay in /dev/shm for good."""
        for name in [n for n, r in self.regions.items() if r.owner.connection == connection]:
            r = self.forget(name)
            if died and r.reclaim:
                try:
                    posix_ipc.unlink_shared_memory(r.key)
                except posix_ipc.ExistentialError:
                    pass

    def inode(self, name: str) -> int:
        return self.regions[name].ino

    def resolve(self, name: str, offset: int, size: int) -> tuple[str, int]:
        r = self.regions.get(name)
        try:
            at = locate(name, r, offset, size)
        except RegionUseError as e:
            raise (UnknownRegion if isinstance(e, RegionNotFound) else RegionError)(str(e)) from None
        return r.key, at

    def table(self, shadowed: dict[str, Any]) -> dict[str, RegionEntry]:
        """What workers may resolve themselves: every region whose name no CUDA region shadows."""
        return {n: RegionEntry(r.key, r.offset, r.byte_size, r.ino, n in self.leaving)
                for n, r in self.regions.items() if n not in shadowed}


class CudaRegion:
    __slots__ = ("name", "handle_b64", "device_id", "byte_size", "owner")

    def __init__(self, name: str, handle_b64: str, device_id: int, byte_size: int, owner: Owner) -> None:
        self.name, self.handle_b64, self.device_id, self.byte_size = name, handle_b64, device_id, byte_size
        self.owner = owner


class CudaRegionRegistry(_Registry):
    """CUDA shared-memory regions: device memory a client exported with ``cudaIpcGetMemHandle``.

    The broker checks the request (a CUDA device exists, the handle has the size of one and
    opens on a real device); the worker that needs the bytes opens the handle again and keeps it
    open while the region is registered (see ``workers/cuda.py``).

    A CUDA IPC handle has no owner or mode to check: whoever holds the 64 bytes may open the
    allocation, as any process of the GPU's users could. Registration keeps the rest of the
    rules (this host only, --allow-client-shm), and the region belongs to its registrant.
    """

    kind = "cuda"
    title = "CUDA shared memory"

    def describe(self, r: "CudaRegion") -> dict[str, Any]:
        return {"name": r.name, "device_id": r.device_id, "byte_size": r.byte_size}

    def register(self, name: str, handle_b64: str, device_id: int, byte_size: int, caller: Caller) -> None:
        from shmserve.workers.cuda import IPC_HANDLE_BYTES, CudaError, runtime
        from shmserve.workers.devices import cuda_device_count

        self.check_name_free(name)  # Triton's first check, on a host without a GPU too
        devices = cuda_device_count()
        if devices == 0:  # Triton's words (it fails to open the handle), then why
            raise RegionError("failed to register shared memory region: invalid args (CUDA shared memory is not "
                              "available: this server has no CUDA device)")
        try:
            raw = base64.b64decode(handle_b64, validate=True)
        except (binascii.Error, ValueError, TypeError):
            raise RegionError(f"cuda shared memory region '{name}': raw_handle is not valid base64") from None
        if len(raw) != IPC_HANDLE_BYTES:
            raise RegionError(f"cuda shared memory region '{name}': raw_handle must be a {IPC_HANDLE_BYTES}-byte "
                              f"cudaIpcMemHandle_t, got {len(raw)} bytes")
        if not 0 <= device_id < devices:
            raise RegionError(f"cuda shared memory region '{name}': device {device_id} does not exist")
        if byte_size <= 0:
            raise RegionError(f"cuda shared memory region '{name}': byte_size must be > 0")
        try:  # as Triton does: a handle that does not open is refused now, not at the first request
            runtime().check(raw, device_id)
        except CudaError as e:
            raise RegionError(f"failed to register shared memory region: invalid args (failed to open CUDA IPC "
                              f"handle: {e})") from None
        self.regions[name] = CudaRegion(name, handle_b64, device_id, byte_size, caller.owner)

    def resolve(self, name: str, offset: int, size: int) -> dict[str, Any] | None:
        r = self.regions.get(name)
        if r is None:
            return None
        try:
            check_bounds(name, r.byte_size, offset, size)
        except RegionUseError as e:
            raise RegionError(str(e)) from None
        return {"cuda": r.handle_b64, "device": r.device_id, "off": offset, "size": size}


class Regions:
    """Both registries, and the table of system regions published for the workers.

    Regions of network callers (their clients registered once and go on using the name) are
    journaled with their owner's uid, and registered again by a restarted broker, checked again
    against that uid. A local client's own regions are not: its connection dies with the broker,
    and the ``Client`` it opens next registers anew.
    """

    def __init__(self, seg: BrokerSegment, journal: Journal) -> None:
        self.seg = seg
        self.journal = journal
        self.system = RegionRegistry()
        self.cuda = CudaRegionRegistry()
        self.system.other, self.cuda.other = self.cuda, self.system
        self._doc = b""  # the table last published
        self._restore()

    def publish(self) -> None:
        """Publish the system regions for direct lanes; before any reply to a registration, so a
        request sent after it finds the region. Every change passes here, so it is journaled here."""
        doc = region_table.encode(self.system.table(self.cuda.regions), REGIONS_BYTES - PUBLISHED_HEADER,
                                  [r.handle_b64 for r in self.cuda.regions.values()])
        if doc != self._doc:
            self._doc = doc
            self.seg.regions.publish(doc)
        gen = self.seg.regions.generation()
        for registry in (self.system, self.cuda):
            for name, marked in registry.leaving.items():
                if not marked:
                    registry.leaving[name] = gen
        self.journal.set("regions", [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size,
                                      **owner_json(r.owner)} for r in self.system.regions.values()
                                     if r.owner.connection is None and r.name not in self.system.leaving])
        self.journal.set("cuda_regions", [{"name": r.name, "raw_handle": r.handle_b64, "device_id": r.device_id,
                                           "byte_size": r.byte_size, **owner_json(r.owner)}
                                          for r in self.cuda.regions.values()
                                          if r.owner.connection is None and r.name not in self.cuda.leaving])

    def unregister(self, registry: _Registry, name: str | None, caller: Caller) -> None:
        """Mark the region (or all the caller's) leaving and publish that; the broker then calls
        ``settle``, which forgets at once those no request uses."""
        registry.unregister(name, caller)
        self.publish()

    def any_leaving(self) -> bool:
        return bool(self.system.leaving or self.cuda.leaving)

    def settle(self, in_use: set[str], lane_holds: list[dict[str, int]]) -> None:
        """Forget the leaving regions that no request uses any more. ``in_use``: the regions the
        requests the broker holds name (queued, sent to an instance, in an ensemble);
        ``lane_holds``: per worker, region name (or ``EVERY_REGION``) -> the oldest table
        generation its unfinished lane requests naming it started under, read after this
        process published the marks."""
        changed = False
        for registry in (self.system, self.cuda):
            for name, marked in list(registry.leaving.items()):
                # A lane request that started under a generation before the mark may use it.
                if name in in_use or any(min(h.get(name, marked), h.get(EVERY_REGION, marked)) < marked
                                         for h in lane_holds):
                    continue
                registry.forget(name)
                changed = True
        if changed:
            self.publish()

    def _restore(self) -> None:
        """Register again what a broker before this one had registered; a region whose object (or
        CUDA allocation) is gone meanwhile is dropped with a log line, and its users get the usual
        'unknown region' answer."""
        for saved in self.journal.get("regions", []):
            try:
                self.system.register(saved["name"], saved["key"], saved["offset"], saved["byte_size"],
                                     Caller(owner_from_json(saved)))
            except InvalidRequest as e:  # gone, replaced, or no longer the owner's to open
                log.error("system shared-memory region '%s' not restored after a broker restart: %s",
                          saved["name"], e)
        for saved in self.journal.get("cuda_regions", []):
            try:
                self.cuda.register(saved["name"], saved["raw_handle"], saved["device_id"], saved["byte_size"],
                                   Caller(owner_from_json(saved)))
            except InvalidRequest as e:
                log.error("CUDA shared-memory region '%s' not restored after a broker restart: %s",
                          saved["name"], e)
        if self.system.regions or self.cuda.regions:
            log.info("restored %d system and %d CUDA shared-memory region(s) after a broker restart",
                     len(self.system.regions), len(self.cuda.regions))
        self.publish()

    def forget_client(self, name: str, died: bool) -> None:
        """Drop the regions a departed client owned (see ``RegionRegistry.drop_owner``)."""
        self.system.drop_owner(name, died)
        self.publish()
