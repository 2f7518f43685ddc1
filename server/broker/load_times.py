"""The model load time histogram: one observation per load of a version, kept across reloads and
unloads so that rates over a window see every load (exported with ``histogram_latencies=true``)."""
from __future__ import annotations

import bisect

LOAD_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0)
FAMILY = "shmserve_model_load_histogram_seconds"
HELP = "Seconds from the start of a version's load until it was ready, one observation per load"


class LoadTimes:
    """Kept by the broker's loop, read by the scrape thread (a copy of each row is read)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, int], tuple[list[int], float]] = {}  # (model, version) -> counts, sum

    def observe(self, model: str, version: int, seconds: float) -> None:
        counts, total = self.rows.get((model, version)) or ([0] * (len(LOAD_BUCKETS_S) + 1), 0.0)
        counts = list(counts)
        counts[bisect.bisect_left(LOAD_BUCKETS_S, seconds)] += 1
        self.rows[(model, version)] = (counts, total + seconds)  # one store: a reader sees old or new
