"""Which worker takes a client's request directly, per the routing table the broker publishes.

A client that holds a lane puts an inference request straight on a worker's lane when the
broker's table says the model version is served directly (default scheduling, no sequence or
ensemble). Everything else goes through the broker. Among several instances the one with the
fewest of this client's requests in flight takes it.
"""
from __future__ import annotations

import collections
import random
from typing import Any

import orjson
import posix_ipc

from .channel import BrokerSegment, WorkerSegment
from .descriptor import InferRequest
from .names import object_name
from .region_table import RegionTable

ROUTE_CACHE_LIMIT = 256
_UNKNOWN: Any = object()


class Router:
    """One connection's view of the routing table, and of its requests in flight per worker."""

    def __init__(self, server_id: str, broker: BrokerSegment, lane: int | None) -> None:
        self.server_id = server_id
        self.broker = broker
        self.lane = lane  # None: no lane was free, every request goes through the broker
        self._gen = -1
        self._routes: dict = {}
        self._splits: dict = {}
        # (model, version) -> the workers serving it directly, per the table's generation
        self._cache: dict[tuple[Any, str], list[int] | None] = {}
        self._regions = RegionTable(broker.regions)
        self._workers: dict[int, WorkerSegment] = {}
        self._load: dict[int, int] = collections.defaultdict(int)  # worker -> our requests on it

    def pick(self, request: InferRequest) -> tuple[int, WorkerSegment] | None:
        """The worker to send ``request`` to directly, or None to go through the broker."""
        workers = self._direct_route(request.model, request.version)
        if workers is None:
            return None
        # Registered regions: the worker resolves (and bounds-checks) those the broker published;
        # any other name (a CUDA region, one not yet published, a mistake) goes to the broker.
        # A region unregistered while in use (leaving) goes to the broker too, which counts its users.
        for t in request.inputs:
            if t.region and not self._published(t.region):
                return None
        for o in request.outputs or ():
            if o.region and not self._published(o.region):
                return None
        num = workers[0] if len(workers) == 1 else min(workers, key=self._load.__getitem__)
        seg = self._worker(num)
        return None if seg is None else (num, seg)

    def _published(self, name: str) -> bool:
        region = self._regions.get(name)
        return region is not None and not region.leaving

    def began(self, num: int) -> None:
        self._load[num] += 1

    def ended(self, num: int) -> None:
        self._load[num] -= 1

    def _direct_route(self, model: Any, version: str) -> list[int] | None:
        """The workers that take (model, version) on our lane per the routing table, or None
        (no lane, not served directly, or a split the broker's odds send elsewhere)."""
        if self.lane is None:
            return None
        if self.broker.routes.generation() != self._gen:
            self._reload()
        asked = (model, version)
        workers: Any = self._cache.get(asked, _UNKNOWN)
        if workers is not _UNKNOWN:
            return workers
        if len(self._cache) >= ROUTE_CACHE_LIMIT:  # names a client made up must not pile up
            self._cache.clear()
        kept = True  # whether the route of the (model, version) asked for may be cached
        if not version:
            split = self._splits.get(model)
            if split is None:
                self._cache[asked] = None
                return None
            # The broker's split (a canary's fraction), chosen here per request; a request that
            # goes through the broker instead is chosen there, with the same odds.
            kept = split["canary"] is None
            # (the table holds versions as numbers: the cache keys them as text)
            version = str(split["canary"] if not kept and random.random() < split["fraction"] else split["stable"])
        key = (model, version)
        workers = self._cache.get(key, _UNKNOWN)
        if workers is _UNKNOWN:
            workers = self._cache[key] = self._direct_workers(model, version)
        if kept:
            self._cache[asked] = workers
        return workers

    def _reload(self) -> None:
        gen, raw = self.broker.routes.read()
        routes = orjson.loads(raw) if raw else {}
        self._routes = routes.get("models", {})
        self._splits = routes.get("splits", {})
        self._gen = gen
        live = {w for vs in self._routes.values() for e in vs.values() for w in e["workers"]}
        for num in [n for n in self._workers if n not in live]:
            self._workers.pop(num).close()  # a stopped worker's mapping would pin its memory
        self._cache.clear()

    def _direct_workers(self, model: Any, version: str) -> list[int] | None:
        """The workers serving (model, version) on direct lanes per the routing table, or None."""
        versions = self._routes.get(model)
        if not versions:
            return None
        v = versions.get(version)
        if not v or not v["ready"] or not v["direct"] or not v["workers"]:
            return None
        return list(v["workers"])

    def mapped(self, num: int) -> WorkerSegment | None:
        """The segment of worker ``num`` if this client maps it already (it sent there)."""
        return self._workers.get(num)

    def _worker(self, num: int) -> WorkerSegment | None:
        seg = self._workers.get(num)
        if seg is None:
            try:
                # (with its control object, where the worker's sleeping flag lies: writable for a
                # process of the server's user, read-only for a client of another user)
                seg = WorkerSegment.attach(object_name(self.server_id, "worker", num))
            except (posix_ipc.ExistentialError, FileNotFoundError, ValueError, ConnectionError):
                return None
            self._workers[num] = seg
        return seg

    def close(self) -> None:
        for seg in self._workers.values():
            seg.close()
        self._workers.clear()
