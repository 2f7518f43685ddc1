"""What Triton's latency summaries remember: the last minute.

Triton's ``nv_inference_*_summary_us`` quantiles come from prometheus-cpp summaries that forget an
observation after 60 s (a latency spike leaves p99 a minute later, and an idle model's quantiles
read NaN), while their ``_count`` and ``_sum`` keep counting. Ours are estimated from each
version's lifetime histograms (shm/stats.py); this keeps snapshots of them, taken at scrapes (at
most one every few seconds), and gives each scrape the histograms less the newest snapshot at
least a minute old: the observations of the last minute and up to one scrape interval more (a
snapshot at most every 5 s). In the first minute of scrapes, before any snapshot is that old, a
scrape sees everything counted so far; so does a version loaded again (a new generation, counted
afresh), and one whose counts went down (a worker replaced with its counts).
"""
from __future__ import annotations

import collections
import math
import threading

import numpy as np

MAX_AGE_S = 60.0  # prometheus-cpp's default max_age, which Triton's summaries keep
SNAPSHOT_EVERY_S = 5.0

Key = tuple[str, int, float]  # (model, version, generation: which load of the version)


class SummaryWindow:
    def __init__(self) -> None:
        self._snapshots: collections.deque[tuple[float, dict[Key, np.ndarray]]] = collections.deque()
        self._lock = threading.Lock()  # (scrapes may overlap)

    def recent(self, histograms: dict[Key, np.ndarray], now: float) -> dict[Key, np.ndarray]:
        """Each version's histograms (phases x buckets) counted over the last minute."""
        with self._lock:
            base = self._base(now)
            if not self._snapshots or now - self._snapshots[-1][0] >= SNAPSHOT_EVERY_S:
                self._snapshots.append((now, {key: h.copy() for key, h in histograms.items()}))
        out = {}
        for key, hist in histograms.items():
            old = base.get(key)
            if old is None or old.shape != hist.shape:
                out[key] = hist
                continue
            diff = hist.astype(np.int64) - old.astype(np.int64)
            out[key] = hist if (diff < 0).any() else diff  # (fewer than before: a reloaded version's new counts)
        return out

    def _base(self, now: float) -> dict[Key, np.ndarray]:
        """The newest snapshot at least MAX_AGE_S old (older ones are dropped); none (count from
        zero) while no snapshot is that old."""
        snapshots = self._snapshots
        while len(snapshots) > 1 and now - snapshots[1][0] >= MAX_AGE_S:
            snapshots.popleft()
        return snapshots[0][1] if snapshots and now - snapshots[0][0] >= MAX_AGE_S else {}


def summary_quantiles(text: str) -> tuple[float, ...]:
    """``summary_quantiles=0.5:0.05,0.99:0.001``: Triton's quantile:error pairs (the error a
    streaming estimator allows; ours reads histograms, so only the quantile counts). ValueError
    names a pair that is not two numbers, or a quantile outside [0, 1]."""
    quantiles: list[float] = []
    for pair in (part.strip() for part in text.split(",") if text.strip()):
        q, sep, error = pair.partition(":")
        try:
            quantile, _ = float(q), float(error)
        except ValueError:
            quantile = math.nan
        if not sep or not 0.0 <= quantile <= 1.0:
            raise ValueError(f"--metrics-config summary_quantiles: '{pair}' is not QUANTILE:ERROR with a quantile "
                             f"between 0 and 1 (e.g. summary_quantiles=0.5:0.05,0.99:0.001)")
        quantiles.append(quantile)
    return tuple(dict.fromkeys(quantiles))  # (a quantile given twice is one series)
