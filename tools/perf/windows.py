"""The arithmetic of a measurement window: from the requests that completed in it (and the
server's counters over it) to throughput, latency percentiles and the server's share, and
perf_analyzer's stability rule over the last three windows."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np

from shmserve.tools.perf.server_stats import Counters

DELAY_NS = 5_000_000  # an open-loop request sent more than 5 ms after its time counts as delayed


class Record(NamedTuple):
    """One request as a client process saw it (monotonic ns): when it was due, sent and done,
    when each response came, its error ('' when none) and its sequence id (0 outside one)."""

    due: int
    start: int
    end: int
    responses: tuple[int, ...]
    error: str
    sequence_id: int


@dataclass(frozen=True)
class Figures:
    """One window, or several merged: what perf_analyzer reports for a level (microseconds)."""

    requests: int
    duration_s: float
    throughput: float  # inferences per second: requests x batch size
    avg_us: float
    std_us: float
    p50_us: float
    p90_us: float
    p95_us: float
    p99_us: float
    stabilizing_us: float  # the --percentile latency, or the average without it
    errors: int
    delayed: int
    first_response_us: float | None  # decoupled models: time to first response
    between_responses_us: float | None  # ... and between consecutive responses
    responses_per_s: float | None
    server: Counters | None

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["server"] = asdict(self.server) if self.server is not None else None
        return out


def figures(records: list[Record], duration_s: float, batch: int, server: Counters | None,
            percentile: int | None, streaming: bool) -> Figures:
    """The window's figures from the requests that completed in it (errors not in latencies);
    ``streaming``: a decoupled model's, timed per response."""
    good = [r for r in records if not r.error]
    lat = np.array([r.end - r.start for r in good], dtype=np.float64) / 1e3
    pick = (lambda q: float(np.percentile(lat, q))) if lat.size else (lambda q: 0.0)
    avg = float(lat.mean()) if lat.size else 0.0
    streamed = [r for r in good if r.responses] if streaming else []
    first = [r.responses[0] - r.start for r in streamed]
    gaps = [b - a for r in streamed for a, b in zip(r.responses, r.responses[1:])]
    responses = sum(len(r.responses) for r in good)
    return Figures(
        requests=len(good), duration_s=duration_s,
        throughput=len(good) * batch / duration_s if duration_s > 0 else 0.0,
        avg_us=avg, std_us=float(lat.std()) if lat.size else 0.0,
        p50_us=pick(50), p90_us=pick(90), p95_us=pick(95), p99_us=pick(99),
        stabilizing_us=pick(percentile) if percentile else avg,
        errors=len(records) - len(good), delayed=sum(1 for r in records if r.start - r.due > DELAY_NS),
        first_response_us=float(np.mean(first)) / 1e3 if first else None,
        between_responses_us=float(np.mean(gaps)) / 1e3 if gaps else None,
        responses_per_s=responses / duration_s if duration_s > 0 and streaming else None,
        server=server)


def stable(last: list[Figures], stability_pct: float) -> bool:
    """perf_analyzer's rule: over the last three windows, max/min of the throughput and of the
    stabilizing latency are both within ``stability_pct`` percent."""
    if len(last) < 3:
        return False
    limit = 1 + stability_pct / 100
    for values in ([f.throughput for f in last], [f.stabilizing_us for f in last]):
        if min(values) <= 0 or max(values) / min(values) > limit:
            return False
    return True


def server_sum(parts: list[Counters | None]) -> Counters | None:
    """The server's counters over several windows; None when any window lacks them."""
    if not parts or any(p is None for p in parts):
        return None
    total = Counters()
    for p in parts:
        total = total + p  # type: ignore[operator]
    return total


def completed_by(pending: list[Record], start_ns: int, end_ns: int) -> tuple[list[Record], list[Record]]:
    """The requests of ``pending`` done within [start_ns, end_ns), and those not done yet (those
    done before ``start_ns``, in a warm-up, are in neither)."""
    done = [r for r in pending if start_ns <= r.end < end_ns]
    return done, [r for r in pending if r.end >= end_ns]
