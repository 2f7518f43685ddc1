"""The routing table the broker publishes for clients: which versions are ready, which workers a
client may call directly on its lane, and how unversioned requests split between a stable
version and a canary.

Clients read the table from the broker segment (``shm/published.py``) before each request; it is
published again whenever what serves changes (a load, a swap, an instance ready or gone, a
canary decision) and only when its bytes change.
"""
from __future__ import annotations

from typing import Any

import orjson

from shmserve.shm.channel import BrokerSegment

from .catalog import Catalog
from .instances import Instances
from .models import State


class Routes:
    def __init__(self, seg: BrokerSegment, catalog: Catalog, instances: Instances) -> None:
        self.seg = seg
        self.catalog = catalog
        self.instances = instances
        self.doc = b""  # the table last published
        self.draining = False  # the server stops: no direct lanes, so every new request meets the broker's refusal

    def publish(self) -> None:
        """Tell clients which versions are ready and which workers they may call directly.

        A version is direct when its scheduler is the default one (no dynamic or sequence
        batching): then any ready instance may take any request, and the broker adds nothing. A
        dynamically batched version with one instance is direct too: its worker batches what
        arrives on its lanes (``batches_on_worker``). A rate-limited version never is: the broker
        starts each of its executions when the rate limiter lets it.
        """
        models: dict[str, Any] = {}
        splits: dict[str, Any] = {}
        for name, versions in self.catalog.models.items():
            entry = models[name] = {}
            for v, mv in versions.items():
                cfg = mv.config
                direct = not mv.rate_limited and (mv.worker_batching or (
                    not cfg.HasField("dynamic_batching") and not cfg.HasField("sequence_batching")))
                # "load": which load of the version this is, so that a reload changes the table
                # even where no worker does (an ensemble): clients keep a config while it stays
                entry[str(v)] = {"ready": mv.state == State.READY, "direct": direct,
                                 "workers": [] if self.draining else
                                 [i.num for i in mv.instances if i.ready and self.instances.live(i)],
                                 "load": mv.created}
            split = self.catalog.split(name)
            if split is not None:
                splits[name] = split.doc()  # where unversioned requests go: see canary.py
        doc = orjson.dumps({"models": models, "splits": splits})
        if doc != self.doc:
            self.doc = doc
            self.seg.routes.publish(doc)

    def judge_canaries(self, now: float) -> None:
        """Let each canary in progress look at its evidence; a rollback changes the split."""
        for name, canary in list(self.catalog.canaries.items()):
            if canary.policy.fraction <= 0:
                continue
            split = self.catalog.split(name)
            if split is None or split.canary is None:
                continue
            versions = self.catalog.models[name]
            totals = {}
            for v in (split.stable, split.canary):
                totals[v] = (id(versions[v]), self.instances.version_totals(versions[v]))
            if canary.observe(now, split, totals) is not None:
                self.publish()
