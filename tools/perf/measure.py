"""perf_analyzer's measurement of one level: load on, then windows of ``--measurement-interval``
until the last three agree (or ``--max-trials``), the server's counters and CPU read at every
window's edges. The figures of a level are those of its last three windows together."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from shmserve.tools import proc_cpu
from shmserve.tools.perf.plan import Load, Measurement, Requests, Target
from shmserve.tools.perf.pool import ClientUsage, Pool, jobs
from shmserve.tools.perf.server_stats import Counters, StatsReader
from shmserve.tools.perf.windows import Figures, Record, completed_by, figures, server_sum, stable

GRACE_S = 0.15  # after a window's end, until the client processes' last records of it are in


@dataclass
class Session:
    """What every level of a run shares: the client processes, a statistics reader and the
    server's processes (found by port, for its CPU) per target, the plan and the progress line."""

    pool: Pool
    targets: list[Target]
    readers: list[StatsReader]
    load: Load
    measurement: Measurement
    requests: Requests
    processes: int
    progress: Any
    trees: list[list[int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.trees = [proc_cpu.server_tree(t.port) if t.port is not None else [] for t in self.targets]


@dataclass
class LevelResult:
    """A level on one target: the deciding figures, every window's, whether they were stable,
    every request sent (for the profile export) and what the processes spent."""

    target: str
    mode: str
    level: float
    figures: Figures
    windows: list[Figures]
    stable: bool
    records: list[Record]
    boundaries: list[int]
    clients: list[ClientUsage]
    server_cpu_us: float | None = None  # per request, where the server's processes can be read


@dataclass
class Edge:
    """What is read at a window's edge."""

    at: int
    counters: Counters | None
    server: proc_cpu.Usage
    ticks: tuple[int, int]


def read_edge(session: Session, target: int) -> Edge:
    return Edge(time.monotonic_ns(), session.readers[target].read(), proc_cpu.usage(session.trees[target]),
                proc_cpu.machine_ticks())


def window_figures(session: Session, records: list[Record], a: Edge, b: Edge) -> Figures:
    counters = b.counters - a.counters if a.counters is not None and b.counters is not None else None
    return figures(records, (b.at - a.at) / 1e9, session.requests.batch, counters, session.measurement.percentile,
                   session.requests.decoupled)


def measure_level(session: Session, target: int, level: float) -> LevelResult:
    """Windows until stable (or the trials run out) at ``level`` on ``targets[target]``."""
    meas = session.measurement
    session.pool.start(jobs(session.load, level, target, session.processes))
    time.sleep(meas.warmup_ms / 1000)
    edges = [read_edge(session, target)]
    kept: list[Record] = []
    pending: list[Record] = []
    windows: list[Figures] = []
    in_windows: list[list[Record]] = []
    try:
        for trial in range(meas.max_trials):
            end = edges[0].at + (trial + 1) * meas.interval_ms * 1_000_000
            time.sleep(max(0.0, (end - time.monotonic_ns()) / 1e9))
            edges.append(read_edge(session, target))
            time.sleep(GRACE_S)
            new = session.pool.collect()
            kept.extend(new)
            done, pending = completed_by(pending + new, edges[-2].at, edges[-1].at)
            in_windows.append(done)
            windows.append(window_figures(session, done, edges[-2], edges[-1]))
            session.progress.window(session.targets[target].name, level, trial + 1, windows[-1])
            if windows[-1].errors and not windows[-1].requests:
                raise RuntimeError(f"every request failed; the first: {next(r.error for r in done if r.error)}")
            if stable(windows[-3:], meas.stability_pct):
                break
    finally:
        clients = session.pool.stop(session.requests.timeout_s)
        kept.extend(session.pool.collect())
        session.progress.level_done(len(windows))
    last = len(windows[-3:])
    merged = figures([r for w in in_windows[-last:] for r in w], sum(w.duration_s for w in windows[-last:]),
                     session.requests.batch, server_sum([w.server for w in windows[-last:]]), meas.percentile,
                     session.requests.decoupled)
    cpu = edges[-1].server - edges[-1 - last].server
    return LevelResult(session.targets[target].name, session.load.mode, level, merged, windows,
                       stable(windows[-3:], meas.stability_pct), kept, [e.at for e in edges], clients,
                       cpu.cpu_us / merged.requests if session.trees[target] and merged.requests else None)


def sweep(session: Session, target: int, latency_threshold_ms: float, report: Any) -> list[LevelResult]:
    """Every level in turn, each reported as it ends; stops past ``latency_threshold_ms`` (perf_
    analyzer's ``-l``: 0 for none) or when a level's requests all failed."""
    results = []
    for level in session.load.levels:
        result = measure_level(session, target, level)
        results.append(result)
        report(result)
        if result.figures.requests == 0:
            break
        if latency_threshold_ms and result.figures.stabilizing_us > latency_threshold_ms * 1000:
            break
    return results
