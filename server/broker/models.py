"""Loaded model versions, their worker instances, and the default scheduler.

A version is READY when every instance reported ready. The default scheduler sends each request
to the least-loaded ready instance, allowing a short pipeline per instance so a worker finds its
next batch waiting the moment it finishes one.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import os
import subprocess
import time
from typing import Any

from shmserve.batching import Pending
from shmserve.shm.channel import ClientSegment, WorkerSegment
from shmserve.shm import latency_histograms
from shmserve.shm.stats import VersionTotals
from shmserve.signature import ModelSignature


class State(str, enum.Enum):
    LOADING = "LOADING"
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    UNLOADING = "UNLOADING"


@dataclasses.dataclass
class Client:
    """A connected client (a frontend process or a local program) as the broker sees it."""

    name: str
    ticket: int  # its process's liveness ticket (shm/liveness.py): what the server keys it on
    seg: ClientSegment
    lane: int | None = None
    pid: int = 0  # its process's pid, when it shares our PID namespace (0: it does not); for logs and BLS

    @property
    def server_user(self) -> bool:
        """Whether it runs as the server's user (a frontend, or a program as privileged as the
        server): its segment's owner, as the kernel said when the broker attached it. A client of
        a user named by --local-client-users is not, and is given no more than a network caller."""
        return self.seg.seg.uid == os.geteuid()

    @property
    def uid(self) -> int:
        """Its user (its segment's owner): whose extents of an output arena hold its answers."""
        return self.seg.seg.uid


@dataclasses.dataclass
class Instance:
    num: int  # worker segment number: unique for the life of the server
    name: str
    index: int
    kind: str
    device_id: int
    seg: WorkerSegment
    proc: subprocess.Popen
    ready: bool = False
    outstanding: dict[int, list[Pending]] = dataclasses.field(default_factory=dict)
    restarts: int = 0
    started: float = dataclasses.field(default_factory=time.monotonic)
    death_note: str = ""  # why the broker killed it (e.g. a hung execution), for the failed requests
    added: bool = False  # added to a serving version by a live instance change, not ready yet
    removed_since: float = 0.0  # when a live instance change removed it (0: not removed)
    message_parts: list[bytes] = dataclasses.field(default_factory=list)  # of its next message (W_MORE)
    readiness_asks: int = 0  # is_ready() checks asked of its worker (server/broker/readiness.py)
    readiness_asked_at: float = 0.0  # when the last of them was asked

    @property
    def removed(self) -> bool:
        return self.removed_since > 0

    def lanes_drained(self) -> bool:
        """Nothing left on the worker's lanes: every direct request put there was answered."""
        return self.lanes_unfinished() == 0

    def lanes_unfinished(self, others: bool = False) -> int:
        """Requests on the worker's lanes it has not finished: those it took and has not finished
        (its own counts, modulo 2**64: one that finished more since they were read counts as
        none), and those waiting on the lanes of the server's user; with ``others``, also those
        waiting on other users' lanes (a statistic: their counters are their user's to write,
        each lane counts at most its capacity). A drain waits for the requests waiting on other
        users' lanes only through the worker, which answers them before it stops, so that no such
        user keeps an unload or a stop waiting by writing its counters."""
        stats = self.seg.stats
        # Read in the order the worker moves a record (off its lane, counted taken, done): one
        # moved between two reads is counted twice for a moment. One the worker holds between
        # its lane and its count (a few instructions) may be missed for a moment: the worker
        # answers it before it stops all the same.
        waiting = self.seg.lanes_waiting(others)
        done = stats.get("direct_done")
        running = (stats.get("direct_taken") - done) % (1 << 64)
        return (0 if running >= 1 << 63 else running) + waiting


@dataclasses.dataclass
class ModelVersion:
    name: str
    version: int
    model_dir: str
    config: Any  # ModelConfig message
    config_dict: dict[str, Any]
    backend: str
    state: State = State.LOADING
    reason: str = ""
    instances: list[Instance] = dataclasses.field(default_factory=list)
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    signature: ModelSignature | None = None
    pipeline_depth: int = 2
    config_confirmed: bool = False
    stats: VersionTotals = dataclasses.field(default_factory=VersionTotals)
    created: float = dataclasses.field(default_factory=time.monotonic)
    load_seconds: float = 0.0  # from the start of its load until READY
    exec_timeout_s: float = 0.0  # parameter execution_timeout_s: a longer execution kills the instance
    batcher: Any = None  # a DynamicBatcher when the config asks for dynamic batching
    worker_batching: bool = False  # the single instance batches its lanes itself (batches_on_worker)
    rate_limited: bool = False  # its instances execute when the rate limiter lets them (rate_limiter.py)
    dispatched: float = 0.0  # when its scheduler last looked for batches to send (Scheduler.next_timer)
    planned_instances: int = 0  # instances its config asks for
    sequencer: Any = None  # a SequenceBatcher when the config asks for sequence batching
    ensemble: Any = None  # an EnsemblePlan for platform "ensemble" (no instances of its own)
    requested_config: Any = None  # the config loaded, before the backend completed it
    weights_key: str = ""  # names this load's shared weights (workers/shared_weights.py)
    files: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # instance_update.folder_fingerprint
    # repository_scan.folder_state of its folder as the load read it (None: unknown, or changed since in place)
    folder_state: frozenset | None = None
    load_stamp: int | None = None  # load_stamp.load_stamp of the load that gave it its config (None: unknown)

    def __post_init__(self) -> None:
        # Counted in the buckets its config sets (model_metrics), as its workers count.
        self.stats = VersionTotals(latency_histograms.resolve(self.config_dict)[0])

    def set_config(self, config_dict: dict[str, Any]) -> None:
        self.config_dict = config_dict
        self.signature = ModelSignature(self.name, config_dict)

    def live(self) -> bool:
        """Able to serve now: an ensemble, or a version with at least one ready instance."""
        return self.ensemble is not None or any(i.ready for i in self.instances)

    def pick_instance(self) -> Instance | None:
        best = None
        if self.batcher is not None and self.batcher.preserve_ordering and \
                any(i.outstanding for i in self.instances):
            return None  # one batch at a time keeps responses in request order
        for inst in self.instances:
            if inst.ready and len(inst.outstanding) < self.pipeline_depth:
                if best is None or len(inst.outstanding) < len(best.outstanding):
                    best = inst
        return best

    def in_flight(self) -> int:
        queued = len(self.queue) + (len(self.batcher) if self.batcher is not None else 0) \
            + (len(self.sequencer) if self.sequencer is not None else 0)
        return queued + sum(len(p) for i in self.instances for p in i.outstanding.values())

    def queued(self) -> list[Pending]:
        return list(self.queue) + (self.batcher.all() if self.batcher is not None else []) \
            + (self.sequencer.all() if self.sequencer is not None else [])
