"""Latency histograms with each model's own bucket bounds (``--metrics-config histogram_latencies=true``).

Triton exports ``nv_inference_first_response_histogram_ms`` with buckets a model may set through
``model_metrics`` in its config; shmserve adds the request, queue and compute phases the same way,
so that percentiles can be taken across instances and pods (summaries cannot be summed).

Each worker counts in its own statistics segment, in exactly the model's buckets (no estimate
from finer ones): one writer per area, plain uint64 words, and the broker adds the areas up when
scraped, so there is no lock on the request path. Durations are summed in integer nanoseconds,
which add up exactly across processes.
"""
from __future__ import annotations

import bisect
import math
from typing import Any, Mapping

import numpy as np

# (key, metric family, help); the key is what the worker spec and the area's rows use.
FAMILIES: tuple[tuple[str, str, str], ...] = (
    ("first_response", "nv_inference_first_response_histogram_ms",
     "Duration from request to first response in milliseconds"),
    ("request", "shmserve_inference_request_histogram_ms",
     "Duration of successful requests, from arrival to the last response, in milliseconds (includes cached "
     "requests)"),
    ("queue", "shmserve_inference_queue_histogram_ms",
     "Time successful requests waited in the scheduling queue in milliseconds (includes cached requests)"),
    ("compute_input", "shmserve_inference_compute_input_histogram_ms",
     "Time successful requests spent processing inputs in milliseconds (does not include cached requests)"),
    ("compute_infer", "shmserve_inference_compute_infer_histogram_ms",
     "Time successful requests spent executing the model in milliseconds (does not include cached requests)"),
    ("compute_output", "shmserve_inference_compute_output_histogram_ms",
     "Time successful requests spent processing outputs in milliseconds (does not include cached requests)"),
)
KEYS = tuple(key for key, _, _ in FAMILIES)
# The rows, in FAMILIES' order (LatencyRecorder.observe_all relies on it).
FIRST_RESPONSE, REQUEST, QUEUE, COMPUTE_INPUT, COMPUTE_INFER, COMPUTE_OUTPUT = range(len(FAMILIES))
BY_FAMILY = {family: key for key, family, _ in FAMILIES}

# Triton's default for the first response; the phases get a wider, finer range (0.1 ms to 10 s).
_PHASE_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0,
                     5000.0, 10000.0)
DEFAULT_BUCKETS_MS: dict[str, tuple[float, ...]] = {
    "first_response": (100.0, 500.0, 2000.0, 5000.0), **{key: _PHASE_BUCKETS_MS for key in KEYS[1:]}}
MAX_BOUNDS = 32  # bounds a model may set per family; the area keeps room for them and +Inf
COLUMNS = MAX_BOUNDS + 2  # per family: MAX_BOUNDS + 1 bucket counts, then the sum in ns
SUM = COLUMNS - 1

Buckets = dict[str, tuple[float, ...]]  # family key -> upper bounds in ms (ascending, finite)


def nbytes() -> int:
    return len(FAMILIES) * COLUMNS * 8


def view(buf: Any, offset: int) -> np.ndarray:
    """The area's words: one row per family."""
    return np.ndarray((len(FAMILIES), COLUMNS), dtype=np.uint64, buffer=buf, offset=offset)


def resolve(config: Mapping[str, Any]) -> tuple[Buckets, list[str]]:
    """The buckets a model's config asks for (``model_metrics.metric_control``), the defaults for
    the rest, and a line per family it names that has no buckets to set (Triton warns too)."""
    buckets = dict(DEFAULT_BUCKETS_MS)
    unknown = []
    for control in (config.get("model_metrics") or {}).get("metric_control") or []:
        family = (control.get("metric_identifier") or {}).get("family", "")
        key = BY_FAMILY.get(family)
        if key is None:
            unknown.append(f"metric family '{family}' in 'metric_identifier' is not a customizable metric")
            continue
        bounds = (control.get("histogram_options") or {}).get("buckets") or []
        buckets[key] = tuple(float(b) for b in bounds)
    return buckets, unknown


def problem(config: Mapping[str, Any]) -> str | None:
    """Why the config's histogram buckets cannot be used, or None: bounds must be finite, strictly
    ascending (prometheus' rule) and at most MAX_BOUNDS."""
    buckets, _ = resolve(config)
    for key, bounds in buckets.items():
        family = FAMILIES[KEYS.index(key)][1]
        if len(bounds) > MAX_BOUNDS:
            return f"model_metrics: {family} has {len(bounds)} buckets, at most {MAX_BOUNDS} are supported"
        if not all(math.isfinite(b) for b in bounds):
            return f"model_metrics: {family} buckets must be finite numbers (+Inf is always there)"
        if any(b >= c for b, c in zip(bounds, bounds[1:])):
            return f"model_metrics: {family} buckets must be in strictly increasing order"
    return None


def _limits_ns(bounds: tuple[float, ...]) -> list[int]:
    """Integer ns limits: a duration of ``ns`` is within a bound of ``b`` ms exactly when
    ``ns <= floor(b * 1e6)``."""
    return [math.floor(b * 1_000_000) for b in bounds]


class LatencyRecorder:
    """The worker's side, the area's only writer (under the worker's stream lock). It counts in
    its own Python list and stores each changed count and sum into the area as a whole 8-byte
    word, so the broker never reads a torn word and a request is counted before its answer is
    completed. It never reads the area back: a lane's client maps the segment and could write
    anything there, which must not make the worker fail (the broker's sums may be wrong then)."""

    def __init__(self, area: np.ndarray, buckets: Mapping[str, Any]) -> None:
        self._limits = [_limits_ns(tuple(float(b) for b in buckets.get(key, DEFAULT_BUCKETS_MS[key])))
                        for key in KEYS]
        self._words = memoryview(area.reshape(-1)).cast("B").cast("Q")  # type: ignore[arg-type]
        self._cells = [0] * (len(FAMILIES) * COLUMNS)  # (a worker's area starts zeroed: a new segment)

    def observe(self, family: int, ns: int) -> None:
        row = family * COLUMNS
        cell = row + bisect.bisect_left(self._limits[family], ns)
        cells, words = self._cells, self._words
        cells[cell] += 1
        cells[row + SUM] += ns
        words[cell] = cells[cell]
        words[row + SUM] = cells[row + SUM]

    def observe_all(self, request: int, queue: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """A request answered once (its only response is its first): one call per request, the
        worker's hot path."""
        cells, words, limits, find = self._cells, self._words, self._limits, bisect.bisect_left
        for row, family, ns in ((0, FIRST_RESPONSE, request), (COLUMNS, REQUEST, request),
                                (2 * COLUMNS, QUEUE, queue), (3 * COLUMNS, COMPUTE_INPUT, input_ns),
                                (4 * COLUMNS, COMPUTE_INFER, infer_ns), (5 * COLUMNS, COMPUTE_OUTPUT, output_ns)):
            cell = row + find(limits[family], ns)
            cells[cell] += 1
            words[cell] = cells[cell]
            cells[row + SUM] += ns
            words[row + SUM] = cells[row + SUM]


class BrokerHistograms:
    """What the broker observes itself for a version (an ensemble's answers), in the version's
    buckets; added to the workers' areas at scrape time."""

    def __init__(self, buckets: Buckets) -> None:
        self.buckets = buckets
        self._limits = [_limits_ns(buckets[key]) for key in KEYS]
        # Python ints: workers' words a client may have overwritten add up without wrapping, so
        # the served buckets stay cumulative whatever an area holds.
        self.words = np.zeros((len(FAMILIES), COLUMNS), dtype=object)

    def observe(self, family: int, ns: int) -> None:
        self.words[family, bisect.bisect_left(self._limits[family], ns)] += 1
        self.words[family, SUM] += ns

    def add(self, area: np.ndarray) -> None:
        """A worker's area (untrusted words: see LatencyRecorder)."""
        self.words += area.astype(object)

    def copy(self) -> "BrokerHistograms":
        out = BrokerHistograms(self.buckets)
        out.words[:] = self.words
        return out


def samples(words: np.ndarray, family: int, bounds: tuple[float, ...]) -> tuple[list[tuple[str, int]], int, float]:
    """Cumulative counts per ``le`` (Triton's formatting: ``100``, ``2.5``, ``+Inf``), the count and
    the sum in ms of one family's row."""
    row = words[family]
    cumulative = np.cumsum(row[:len(bounds) + 1]).tolist()
    les = [format_le(b) for b in bounds] + ["+Inf"]
    return list(zip(les, (int(c) for c in cumulative))), int(cumulative[-1]), int(row[SUM]) / 1e6


def format_le(bound: float) -> str:
    """A bound as Triton's prometheus-cpp writes it (``std::to_chars``: the shorter of the
    shortest fixed and scientific forms, fixed on a tie): ``1``, ``2.5``, ``1e+05``, ``+Inf``.
    Prometheus keys a series on the label's text: ``le="1.0"`` is not Triton's ``le="1"``."""
    if bound in (math.inf, -math.inf):
        return "+Inf" if bound > 0 else "-Inf"
    fixed = np.format_float_positional(bound, trim="-")
    scientific = np.format_float_scientific(bound, trim="-", exp_digits=2)
    return scientific if len(scientific) < len(fixed) else fixed
