"""Prometheus metrics, served by the broker on ``--metrics-port`` with Triton's names and labels.

The broker sees every request (it validates and queues them) and every batch outcome (workers
report successes, failures and compute time in the record that frees the instance), so the counts
are exact across instances and frontend processes without any aggregation step. The numbers live
in plain per-version ``VersionStats`` objects that the collector reads at scrape time; the same
objects will back the statistics extension. Samples keep Triton's exact names (no ``_total``).
"""
from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric

log = logging.getLogger("shmserve.metrics")


@dataclasses.dataclass
class VersionStats:
    success: int = 0
    failure: dict[str, int] = dataclasses.field(default_factory=lambda: defaultdict(int))
    inference_count: int = 0
    execution_count: int = 0
    compute_infer_ns: int = 0
    pending: int = 0
    worker_restarts: int = 0

    def copy(self) -> "VersionStats":
        out = dataclasses.replace(self)
        out.failure = defaultdict(int, self.failure)
        return out


def add_worker_counters(stats: VersionStats, seg: Any) -> None:
    """Add a worker's own counters (kept in its segment) into ``stats``."""
    c = seg.stats
    stats.success += int(c[0])
    stats.failure["BACKEND"] += int(c[1])
    stats.failure["REJECTED"] += int(c[5])
    stats.inference_count += int(c[2])
    stats.execution_count += int(c[3])
    stats.compute_infer_ns += int(c[4])


StatsSource = Callable[[], Iterable[tuple[str, int, VersionStats]]]


class _Collector:
    def __init__(self, source: StatsSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        rows = list(self.source())

        def family(name: str, doc: str, kind: str, value: Callable[[VersionStats], float]) -> Metric:
            m = Metric(name, doc, kind)
            for model, version, st in rows:
                m.add_sample(name, {"model": model, "version": str(version)}, value(st))
            return m

        yield family("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
                     "counter", lambda s: s.success)
        failure = Metric("nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
                         "counter")
        for model, version, st in rows:
            for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER"):
                failure.add_sample("nv_inference_request_failure",
                                   {"model": model, "version": str(version), "reason": reason},
                                   st.failure.get(reason, 0))
        yield failure
        yield family("nv_inference_count", "Number of inferences performed (does not include cached requests)",
                     "counter", lambda s: s.inference_count)
        yield family("nv_inference_exec_count", "Number of model executions performed", "counter",
                     lambda s: s.execution_count)
        yield family("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in "
                     "microseconds", "counter", lambda s: s.compute_infer_ns // 1000)
        yield family("nv_inference_pending_request_count", "Instantaneous number of pending requests awaiting "
                     "execution per-model.", "gauge", lambda s: s.pending)
        yield family("shmserve_worker_restarts", "Worker processes restarted after they died", "counter",
                     lambda s: s.worker_restarts)


def serve_metrics(port: int, source: StatsSource) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source))  # type: ignore[arg-type]
    if port > 0:
        try:
            start_http_server(port, registry=registry)
        except OSError as e:
            log.error("cannot serve metrics on port %d: %s", port, e.strerror)
    return registry
