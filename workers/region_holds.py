"""The regions this worker's unfinished lane requests name, and the table generation each
started under, published for the broker.

The broker defers an unregister while requests use the region (as Triton does). Requests it
forwarded it can see; requests on this worker's lanes it cannot, so the worker publishes
``{region name: oldest table generation}`` over its unfinished lane requests that name regions
(``WorkerSegment.region_holds``). A region marked leaving in generation M is gone for good once
no worker holds it under a generation before M: later lane requests saw the mark and were
refused (``workers/requests.py``). A request's names are published before it reads the table,
with a fence between, so a broker that reads them after publishing M either sees the hold or
knows the request reads M or later.
"""
from __future__ import annotations

import collections

import orjson

from shmserve.shm.published import HEADER, Published
from shmserve.shm.region_table import EVERY_REGION, RegionTable
from shmserve.shm.waker import fence

def region_names(doc: dict) -> set[str]:
    """The registered regions a lane request's descriptor names."""
    return {t["region"] for t in doc.get("inputs", ()) if "region" in t} | \
        {o["region"] for o in doc.get("outputs") or () if "region" in o}


class RegionHolds:
    def __init__(self, regions: RegionTable, area: Published, capacity: int) -> None:
        self.regions = regions
        self.area = area
        self.capacity = capacity - HEADER
        # region name -> {generation -> unfinished requests}
        self.held: dict[str, collections.Counter[int]] = {}
        self._published: dict[str, int] = {}

    def hold(self, doc: dict, entry: dict) -> None:
        """Before the request's regions are looked up in the table: note them, under the
        generation published now."""
        names = region_names(doc)
        if not names:
            return
        gen = self.regions.current()
        for name in names:
            self.held.setdefault(name, collections.Counter())[gen] += 1
        entry["held"] = (gen, sorted(names))
        self._publish()
        fence()

    def release(self, entry: dict) -> None:
        """The request is answered (or refused): its regions are no longer used here."""
        held = entry.pop("held", None)
        if held is None:
            return
        gen, names = held
        for name in names:
            counts = self.held[name]
            counts[gen] -= 1
            if counts[gen] <= 0:
                del counts[gen]
            if not counts:
                del self.held[name]
        self._publish()

    def _publish(self) -> None:
        oldest = {name: min(counts) for name, counts in self.held.items()}
        if oldest == self._published:
            return
        self._published = oldest
        doc = orjson.dumps(oldest)
        if len(doc) > self.capacity:
            doc = orjson.dumps({EVERY_REGION: min(oldest.values())})
        self.area.publish(doc)
