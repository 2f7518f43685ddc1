"""Model lifecycle in the broker: loads that become visible only when ready, and retirement that
drains before it stops anything, so no request is lost while what is served changes.

A load builds new versions (new workers) beside what serves. When every new version is READY the
swap is one step: the routing table moves to the new workers and the old versions retire. If any
new version fails, the new workers stop and the old ones go on serving; the reason is kept for
the repository index. A retiring version takes no new requests but finishes its queue, its
batches and its workers' lanes; then its workers get a graceful stop (bounded by
``--exit-timeout-secs``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from .canary import CanaryPolicy
from .models import ModelVersion, State

STRAGGLER_GRACE_S = 0.2  # a client that read the old routes just before the swap lands within this


@dataclasses.dataclass
class LoadJob:
    name: str
    versions: dict[int, ModelVersion]
    waiters: list[tuple[Any, int]] = dataclasses.field(default_factory=list)  # (client, slot) to answer
    canary_policy: CanaryPolicy = dataclasses.field(default_factory=CanaryPolicy)  # from its config.pbtxt

    def failed(self) -> ModelVersion | None:
        return next((mv for mv in self.versions.values() if mv.state == State.UNAVAILABLE), None)

    def ready(self) -> bool:
        return all(mv.state == State.READY for mv in self.versions.values())


@dataclasses.dataclass
class Retiring:
    version: ModelVersion
    since: float = dataclasses.field(default_factory=time.monotonic)
    stopping: bool = False
    waiters: list[tuple[Any, int]] = dataclasses.field(default_factory=list)


def idle(mv: ModelVersion) -> bool:
    """Nothing queued, nothing running, nothing left on any of its workers' lanes."""
    if mv.in_flight():
        return False
    for inst in mv.instances:
        seg = inst.seg
        if seg.lanes_pending() or int(seg.lane_tails.sum()) != seg.stats.get("direct_done"):
            return False
    return True
