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

A streaming request to a decoupled model may be answered after ``execute`` returns, from the
model's own threads: its hold passes to its sender, which lets go with the final response
(``workers/stream.py``). Hence the lock: holds are taken on the worker's loop and may be let go
on a model's thread.
"""
from __future__ import annotations

import collections
import threading

import orjson

from shmserve.shm.batch_entry import BatchEntry
from shmserve.shm.descriptor import InferRequest
from shmserve.shm.published import HEADER, Published
from shmserve.shm.region_table import EVERY_REGION, RegionTable
from shmserve.shm.waker import fence

# The generation a request the broker forwarded is held under once the broker lets go of it: it
# was admitted while its regions were registered, so it started before any leaving mark.
ADMITTED = -1

Held = tuple[int, list[str]]


class RegionHolds:
    def __init__(self, regions: RegionTable, area: Published, capacity: int) -> None:
        self.regions = regions
        self.area = area
        self.capacity = capacity - HEADER
        self.lock = threading.Lock()
        # region name -> {generation -> unfinished requests}
        self.held: dict[str, collections.Counter[int]] = {}
        self._published: dict[str, int] = {}

    def hold(self, request: InferRequest, entry: BatchEntry) -> None:
        """Before the request's regions are looked up in the table: note them, under the
        generation published now."""
        names = request.regions()
        if names:
            entry["held"] = self._take(self.regions.current(), sorted(names))

    def hand_to_sender(self, entry: BatchEntry) -> Held | None:
        """A streaming request's hold, taken out of ``entry`` for its sender to let go of with the
        final response. A request the broker forwarded holds its regions from here on (the
        broker forgets it once ``execute`` returns)."""
        held = entry.pop("held", None)
        if held is None and entry.get("regions"):
            held = self._take(ADMITTED, list(entry["regions"]))
        return held

    def release(self, entry: BatchEntry) -> None:
        """The request is answered (or refused): its regions are no longer used here."""
        self.let_go(entry.pop("held", None))

    def let_go(self, held: Held | None) -> None:
        if held is None:
            return
        gen, names = held
        with self.lock:
            for name in names:
                counts = self.held[name]
                counts[gen] -= 1
                if counts[gen] <= 0:
                    del counts[gen]
                if not counts:
                    del self.held[name]
            self._publish()

    def _take(self, gen: int, names: list[str]) -> Held:
        with self.lock:
            for name in names:
                self.held.setdefault(name, collections.Counter())[gen] += 1
            self._publish()
        fence()
        return gen, names

    def _publish(self) -> None:
        oldest = {name: min(counts) for name, counts in self.held.items()}
        if oldest == self._published:
            return
        self._published = oldest
        doc = orjson.dumps(oldest)
        if len(doc) > self.capacity:
            doc = orjson.dumps({EVERY_REGION: min(oldest.values())})
        self.area.publish(doc)
