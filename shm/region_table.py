"""The system shared-memory regions as the broker publishes them, so that requests naming a
region can go straight to a worker on a direct lane (the broker would add a hop of its own).

The broker stays the only one that registers: it checks each key (not the server's own objects,
existing, large enough) and publishes ``{"complete": bool, "regions": {name: [key, offset,
byte_size, inode, leaving]}}`` in its segment before it answers the registration. Clients route a
request directly only when every region it names is in the table and not leaving; workers resolve
and bounds-check the names against the same table, with the broker's error texts.

A region unregistered while requests use it stays in the table, marked leaving, until they are
done (Triton defers such an unregister the same way). Requests naming it then go through the
broker, which counts them; a worker refuses a leaving region on its lanes (a client that routed
by the table before the mark), so the broker need only wait for the lane requests that began
before: each worker publishes the regions its unfinished lane requests name, with the oldest
table generation they started under (``workers/region_holds.py``).

A table too large for its area is published empty and incomplete: requests then take the
broker's path.
"""
from __future__ import annotations

import base64
from typing import Any, NamedTuple

import orjson

from .published import Published


class RegionEntry(NamedTuple):
    key: str
    offset: int
    byte_size: int
    ino: int
    leaving: bool = False  # unregistered while requests use it: clients send the next ones to the broker


class RegionUseError(ValueError):
    """A tensor lies outside its region's bounds (a 400)."""

    status = 400


class RegionNotFound(RegionUseError):
    """A tensor names a region that is not registered: Triton's NOT_FOUND (404 over HTTP)."""

    status = 404


SIZE_MAX = (1 << 64) - 1  # Triton's size_t: where offset + byte_size overflows


def check_bounds(name: str, byte_size: int, offset: int, size: int) -> None:
    """Refuse a tensor outside its region's registered ``byte_size`` with Triton's texts, in
    Triton's order (clients match on them): the offset, then overflow, then the end."""
    if offset < 0 or offset >= byte_size:
        raise RegionUseError(f"Invalid offset for shared memory region: '{name}'")
    if size > SIZE_MAX - offset:
        raise RegionUseError(f"Integer overflow detected: byte_size ({size}) + offset ({offset}) exceeds maximum "
                             f"value ({SIZE_MAX}) for region '{name}'")
    if size < 0 or offset + size > byte_size:
        raise RegionUseError(f"Invalid offset + byte size for shared memory region: '{name}'")


def locate(name: str, region: Any, offset: int, size: int) -> int:
    """Where a tensor starts in its region's shm object: the broker and workers resolve alike.
    ``region`` is the registered entry (``offset`` and ``byte_size``), or None if unknown (or,
    on a worker's lane, leaving)."""
    if region is None:
        raise RegionNotFound(f"Unable to find shared memory region: '{name}'")
    check_bounds(name, region.byte_size, offset, size)
    return region.offset + offset


def encode(regions: dict[str, RegionEntry], capacity: int, cuda_handles: list[str] = ()) -> bytes:  # type: ignore[assignment]
    """The table; ``cuda_handles`` (base64) are the CUDA regions' handles, so that workers close
    the mappings of the others."""
    doc = orjson.dumps({"complete": True, "regions": {n: list(r) for n, r in regions.items()},
                        "cuda": sorted(cuda_handles)})
    if len(doc) > capacity:
        doc = orjson.dumps({"complete": False, "regions": {}, "cuda": sorted(cuda_handles)})
    return doc


EVERY_REGION = "*"  # a worker's holds when the names do not fit their area: every region is held


def read_holds(area: Published) -> dict[str, int]:
    """What a worker published (``workers/region_holds.py``): region name (or ``EVERY_REGION``)
    -> the oldest table generation its unfinished lane requests naming it started under."""
    gen, raw = area.read(attempts=1000)
    if gen < 0:  # caught mid-write (the worker preempted): hold everything until the next look
        return {EVERY_REGION: 0}
    return orjson.loads(raw) if raw else {}


class RegionTable:
    """A reader's view of the published table, re-read only when its generation changes."""

    def __init__(self, published: Published) -> None:
        self._published = published
        self._gen = -1
        self._regions: dict[str, RegionEntry] = {}
        self._cuda: set[bytes] = set()
        self._complete = False

    @property
    def generation(self) -> int:
        """The generation of the table ``get`` last resolved against (-1: none yet)."""
        return self._gen

    def current(self) -> int:
        """The generation published now."""
        return self._published.generation()

    def get(self, name: str) -> RegionEntry | None:
        if self._published.generation() != self._gen:
            self._refresh()
        return self._regions.get(name)

    def registered(self) -> set[tuple[str, int]] | None:
        """(key, inode) of each system region registered now; None when the table is incomplete
        (too large for its area), which does not say."""
        if self._published.generation() != self._gen:
            self._refresh()
        return None if not self._complete else {(r.key, r.ino) for r in self._regions.values()}

    def cuda_handles(self) -> set[bytes]:
        """The handles of the CUDA regions registered now."""
        if self._published.generation() != self._gen:
            self._refresh()
        return self._cuda

    def _refresh(self) -> None:
        gen, raw = self._published.read()
        doc = orjson.loads(raw) if raw else {}
        self._regions = {n: RegionEntry(*r) for n, r in doc.get("regions", {}).items()}
        self._cuda = {base64.b64decode(h) for h in doc.get("cuda", ())}
        self._complete = doc.get("complete") is True
        self._gen = gen
