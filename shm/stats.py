"""Per-instance request statistics, kept by each worker in its own segment.

Requests for default-scheduled models never pass the broker, so the worker that answers is the
only process that sees every outcome and every phase of a request. It keeps counters, latency
histograms and per-batch-size rows in its segment (plain uint64 arrays); the broker sums them per
version at scrape time, so counts are exact across instances and frontends with no messages.

Latencies go into log-spaced buckets (ratio 2^(1/4), from 10 us), fine enough for p99 estimates
within about 10%, small enough to update in place per request.
"""
from __future__ import annotations

import math
import time
from typing import Any, Final

import numpy as np

from . import latency_histograms as lh
from .latency_histograms import BrokerHistograms, LatencyRecorder

# direct_taken and direct_done: the lane records a worker took off its lanes, and of those the
# ones it finished (ran, or dropped): the broker's count of what is left on them, from words
# only the worker writes (a lane's own counters are its client's user's to write).
SCALARS = ("success", "success_ns", "failure", "failure_ns", "inference_count",
           "execution_count", "phase_count", "queue_ns", "compute_input_ns", "compute_infer_ns",
           "compute_output_ns", "direct_done", "last_inference_ms", "arena_bytes", "direct_taken", "cancelled",
           "cache_hit", "cache_hit_ns", "cache_miss", "cache_miss_ns", "failed_inferences",
           "error_responses")
S = {name: i for i, name in enumerate(SCALARS)}
(SUCCESS, SUCCESS_NS, FAILURE, FAILURE_NS, INFERENCE_COUNT, EXECUTION_COUNT, PHASE_COUNT, QUEUE_NS,
 INPUT_NS, INFER_NS, OUTPUT_NS, DIRECT_DONE, LAST_INFERENCE_MS, ARENA_BYTES, DIRECT_TAKEN, CANCELLED, CACHE_HIT,
 CACHE_HIT_NS, CACHE_MISS, CACHE_MISS_NS, FAILED_INFERENCES, ERROR_RESPONSES) = range(len(SCALARS))
# The last counters count only failures' rare paths: published as they change, so that ``flush``,
# on every answer's path, writes only the words before them.
FLUSHED = FAILED_INFERENCES
SCALAR_SLOTS = 32  # room to add counters without moving the arrays behind them
BUSY_SINCE = SCALAR_SLOTS - 1  # not a counter: monotonic ns the running execution began, 0 when idle
EXECUTING = SCALAR_SLOTS - 2  # not a counter: the requests in the running execution, 0 when idle
PHASES = ("request", "queue", "compute_input", "compute_infer", "compute_output")
BUCKETS = 96
_U64 = (1 << 64) - 1
_FIRST_NS = 10_000.0
_PER_DOUBLING = 4
BATCH_ROWS = 1024  # batch sizes 1..1024 have their own row; larger ones share the last
BATCH_COLS = ("count", "compute_input_ns", "compute_infer_ns", "compute_output_ns")


def bucket_upper_ns(i: int) -> float:
    """Upper bound of bucket ``i`` (the last bucket is unbounded)."""
    return math.inf if i >= BUCKETS - 1 else _FIRST_NS * 2.0 ** (i / _PER_DOUBLING)


_UPPERS = [bucket_upper_ns(i) for i in range(BUCKETS - 1)]
# Offsets of each phase's histogram in the flat array (the request phase is at 0).
_QUEUE_CELL, _INPUT_CELL, _INFER_CELL, _OUTPUT_CELL = (PHASES.index(p) * BUCKETS for p in PHASES[1:])


# For an integer duration, ``ns <= upper`` exactly when ``ns <= floor(upper)``: the search
# compares integers.
_LIMITS: Final[list[int]] = [int(upper) for upper in _UPPERS]
_LAST: Final = BUCKETS - 1


def bucket_of(ns: int) -> int:
    """Index of the histogram bucket holding a duration of ``ns`` nanoseconds: the first whose
    upper bound is at least ``ns`` (a bisection; five of these per request, so no logarithm)."""
    lo, hi = 0, _LAST
    limits = _LIMITS
    while lo < hi:
        mid = (lo + hi) >> 1
        if limits[mid] < ns:
            lo = mid + 1
        else:
            hi = mid
    return lo


def quantile_ns(hist: np.ndarray, q: float) -> float:
    """The ``q`` quantile of a histogram, interpolated geometrically inside its bucket; 0 if empty."""
    total = int(hist.sum())
    if total == 0:
        return 0.0
    rank = q * total
    cumulative = np.cumsum(hist)
    i = int(np.searchsorted(cumulative, rank, side="left"))
    i = min(i, BUCKETS - 1)
    below = int(cumulative[i - 1]) if i else 0
    inside = int(hist[i])
    lo = bucket_upper_ns(i - 1) if i else 0.0
    hi = bucket_upper_ns(i) if i < BUCKETS - 1 else lo * 2.0 ** (1 / _PER_DOUBLING)
    frac = (rank - below) / inside if inside else 1.0
    if lo <= 0.0:
        return hi * frac
    return lo * (hi / lo) ** frac


class StatsArea:
    """The arrays in a worker segment (views; the segment owns the memory)."""

    def __init__(self, buf: Any, offset: int) -> None:
        self.scalars = np.ndarray((SCALAR_SLOTS,), dtype=np.uint64, buffer=buf, offset=offset)
        offset += SCALAR_SLOTS * 8
        self.hist = np.ndarray((len(PHASES), BUCKETS), dtype=np.uint64, buffer=buf, offset=offset)
        offset += len(PHASES) * BUCKETS * 8
        self.batches = np.ndarray((BATCH_ROWS, len(BATCH_COLS)), dtype=np.uint64, buffer=buf, offset=offset)
        offset += BATCH_ROWS * len(BATCH_COLS) * 8
        self.latency = lh.view(buf, offset)  # in the model's buckets (shm/latency_histograms.py)

    @staticmethod
    def nbytes() -> int:
        return (SCALAR_SLOTS + len(PHASES) * BUCKETS + BATCH_ROWS * len(BATCH_COLS)) * 8 + lh.nbytes()

    def clear(self) -> None:
        self.scalars[:] = 0
        self.hist[:] = 0
        self.batches[:] = 0
        self.latency[:] = 0

    def get(self, name: str) -> int:
        return int(self.scalars[S[name]])


class StatsWriter:
    """The worker's side: counts in Python, written to the segment by ``flush`` before answers
    are completed, so a client that sees its answer also sees it counted."""

    def __init__(self, area: StatsArea, latency_buckets: dict[str, Any] | None = None) -> None:
        self.area = area
        # The model's latency histograms, counted only when the server exports them.
        self.latency = LatencyRecorder(area.latency, latency_buckets) if latency_buckets is not None else None
        # Plain lists, published at flush: an increment of a list item is cheaper than one on an
        # array or a numpy view. They go out as 8-byte word stores through a memoryview, as the
        # histogram cells do: ``struct.pack_into`` zeroes a word before it writes it (words.py),
        # and the broker, reading at scrape time, could see a counter drop to 0.
        self.counts: list[int] = [0] * FLUSHED
        self._published = memoryview(area.scalars).cast("B").cast("Q")  # type: ignore[arg-type]
        self._rare = [0] * len(SCALARS)  # (only its items from FLUSHED on are used)
        self._hist = area.hist.reshape(-1)
        self._hist_words = memoryview(self._hist).cast("B").cast("Q")  # type: ignore[arg-type]
        # The worker is the area's only writer: it counts in a Python copy of the histograms and
        # writes the cells that changed at flush (a cell may be listed twice).
        self._cells: list[int] = [int(x) for x in self._hist]
        self._dirty: list[int] = []
        self._rows: list[int] = []
        self._batch_rows = [[0] * len(BATCH_COLS) for _ in range(BATCH_ROWS)]
        self._batch_words = memoryview(area.batches.reshape(-1)).cast("B").cast("Q")  # type: ignore[arg-type]

    def _count_rare(self, i: int, n: int) -> None:
        """Count and publish at once one of the counters ``flush`` leaves out (an 8-byte store:
        never torn), before the answer it counts is completed."""
        self._rare[i] += n
        self._published[i] = self._rare[i] & _U64

    def publish(self, i: int) -> None:
        """Publish counter ``i`` of ``counts`` at once, not at the next ``flush`` (lane records
        taken: the broker counts them in flight before the execution they start ends)."""
        self._published[i] = self.counts[i] & _U64

    def _observe(self, phase: int, ns: int) -> None:
        cell = phase * BUCKETS + bucket_of(ns)
        self._cells[cell] += 1
        self._dirty.append(cell)

    def executed(self, sizes: list[int], arrivals: list[int], start: int, input_ns: int, infer_ns: int,
                 output_ns: int, ok: list[bool], streamed: int = 0, batch_only: int = 0) -> None:
        """One model execution; per answered request its batch size, receive time (monotonic ns,
        0 if unknown) and whether it succeeded; ``streamed`` inferences whose outcome comes later
        (decoupled senders); ``batch_only`` inferences in its batch size only (a direct sequence
        batch's null requests, streams failed by an execute that raised). As Triton counts them:
        the execution, its batch statistics and the last inference time whatever its requests'
        outcomes (an ``execute`` that raised was run too); the inference count, queue and compute
        phases of successful requests only, and a failed request's whole duration as its failure's."""
        c = self.counts
        cells, dirty = self._cells, self._dirty
        now = start + input_ns + infer_ns + output_ns
        batch_size = streamed
        failed = 0  # failed requests' batch sizes: in the execution's batch size, not in the inference count
        for size, arrived, good in zip(sizes, arrivals, ok):
            if arrived > start:
                arrived = 0  # a send time after the execution began is not ours to trust (counters are unsigned)
            duration = now - arrived if arrived else input_ns + infer_ns + output_ns
            if not good:
                c[FAILURE] += 1
                c[FAILURE_NS] += duration
                failed += size
                continue
            batch_size += size
            queue = start - arrived if arrived else 0
            c[SUCCESS] += 1
            c[SUCCESS_NS] += duration
            c[PHASE_COUNT] += 1
            c[QUEUE_NS] += queue
            c[INPUT_NS] += input_ns
            c[INFER_NS] += infer_ns
            c[OUTPUT_NS] += output_ns
            for cell in (bucket_of(duration), _QUEUE_CELL + bucket_of(queue), _INPUT_CELL + bucket_of(input_ns),
                         _INFER_CELL + bucket_of(infer_ns), _OUTPUT_CELL + bucket_of(output_ns)):
                cells[cell] += 1
                dirty.append(cell)
            if self.latency is not None:
                self.latency.observe_all(duration, queue, input_ns, infer_ns, output_ns)
        if batch_size or failed or batch_only:
            self.count_execution(batch_size, input_ns, infer_ns, output_ns, failed, batch_only)

    def stream_phases(self, arrivals: list[int], start: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """The queue and compute phases of streamed (decoupled) requests, whose outcome and whole
        duration count when their stream ends (``finished_stream``): the execution that started
        them, as Triton reports a decoupled request's queue and compute."""
        c, cells, dirty = self.counts, self._cells, self._dirty
        for arrived in arrivals:
            queue = start - arrived if 0 < arrived <= start else 0
            c[PHASE_COUNT] += 1
            c[QUEUE_NS] += queue
            c[INPUT_NS] += input_ns
            c[INFER_NS] += infer_ns
            c[OUTPUT_NS] += output_ns
            for cell in (_QUEUE_CELL + bucket_of(queue), _INPUT_CELL + bucket_of(input_ns),
                         _INFER_CELL + bucket_of(infer_ns), _OUTPUT_CELL + bucket_of(output_ns)):
                cells[cell] += 1
                dirty.append(cell)
            if self.latency is not None:
                self._observe_phases(queue, input_ns, infer_ns, output_ns)

    def _observe_phases(self, queue: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        latency = self.latency
        assert latency is not None
        latency.observe(lh.QUEUE, queue)
        latency.observe(lh.COMPUTE_INPUT, input_ns)
        latency.observe(lh.COMPUTE_INFER, infer_ns)
        latency.observe(lh.COMPUTE_OUTPUT, output_ns)

    def first_response(self, arrived: int) -> None:
        """A streamed request sent its first response now (under the stream lock)."""
        if self.latency is not None:
            now = time.monotonic_ns()
            self.latency.observe(lh.FIRST_RESPONSE, now - arrived if 0 < arrived <= now else 0)

    def count_execution(self, inferences: int, input_ns: int, infer_ns: int, output_ns: int, failed: int = 0,
                        batch_only: int = 0) -> None:
        """An execution of ``inferences + failed + batch_only`` inferences, ``failed`` of them in
        requests that failed and ``batch_only`` others that count in its batch size only (none of
        them in the inference count)."""
        c = self.counts
        c[INFERENCE_COUNT] += inferences
        c[EXECUTION_COUNT] += 1
        if failed:
            self._count_rare(FAILED_INFERENCES, failed)
        row_index = min(inferences + failed + batch_only, BATCH_ROWS) - 1
        row = self._batch_rows[row_index]
        row[0] += 1
        row[1] += input_ns
        row[2] += infer_ns
        row[3] += output_ns
        self._rows.append(row_index)
        c[LAST_INFERENCE_MS] = time.time_ns() // 1_000_000

    def cache_hit(self, arrived: int, looked_up: int, lookup_ns: int, ok: bool) -> None:
        """A request answered from the response cache, looked up at ``looked_up`` (monotonic ns)
        in ``lookup_ns``. As Triton counts it: a success, its queue time up to the lookup, and no
        inference, execution or compute phase."""
        c = self.counts
        if not 0 < arrived <= looked_up:
            arrived = looked_up
        duration = time.monotonic_ns() - arrived
        if not ok:  # the stored outputs could not be answered (a region too small, no room)
            c[FAILURE] += 1
            c[FAILURE_NS] += duration
            return
        c[SUCCESS] += 1
        c[SUCCESS_NS] += duration
        c[QUEUE_NS] += looked_up - arrived
        c[CACHE_HIT] += 1
        c[CACHE_HIT_NS] += lookup_ns
        for cell in (bucket_of(duration), _QUEUE_CELL + bucket_of(looked_up - arrived)):
            self._cells[cell] += 1
            self._dirty.append(cell)
        if self.latency is not None:
            self.latency.observe(lh.REQUEST, duration)
            self.latency.observe(lh.FIRST_RESPONSE, duration)
            self.latency.observe(lh.QUEUE, looked_up - arrived)

    def cache_miss(self, ns: int) -> None:
        """A request the response cache did not hold, counted at its lookup whatever its outcome,
        as Triton counts misses: ``ns`` is the lookup."""
        self.counts[CACHE_MISS] += 1
        self.counts[CACHE_MISS_NS] += ns

    def cache_inserted(self, ns: int) -> None:
        """The insertion of a missed request's outputs: its time counts with the misses' (Triton's)."""
        self.counts[CACHE_MISS_NS] += ns

    def model_error(self) -> None:
        """A request answered with an error response its model returned: a success in Triton's
        counts (``executed``), kept apart for what counts the errors clients saw (a canary's
        error rate). The worker's loop only."""
        self._count_rare(ERROR_RESPONSES, 1)

    def cancelled(self) -> None:
        """A request its owner cancelled before it ran: a failure, for Triton's reason CANCELED."""
        self.counts[FAILURE] += 1
        self.counts[CANCELLED] += 1

    def finished_stream(self, arrived: int, ok: bool, answered_once: bool = False) -> None:
        """A streamed (decoupled) request ended: its outcome and whole duration. ``answered_once``:
        a request answered after execute returned with its only response (its first)."""
        now = time.monotonic_ns()
        duration = now - arrived if 0 < arrived <= now else 0
        if ok:
            self.counts[SUCCESS] += 1
            self.counts[SUCCESS_NS] += duration
            self._observe(0, duration)
            if self.latency is not None:
                self.latency.observe(lh.REQUEST, duration)
                if answered_once:
                    self.latency.observe(lh.FIRST_RESPONSE, duration)
        else:
            self.counts[FAILURE] += 1
            self.counts[FAILURE_NS] += duration

    def flush(self) -> None:
        published = self._published
        for i, value in enumerate(self.counts):
            published[i] = value & _U64  # (direct_taken and direct_done count modulo 2**64)
        # (the lists are swapped out first: a decoupled model's thread may count meanwhile)
        if self._dirty:
            dirty, self._dirty = self._dirty, []
            cells, hist = self._cells, self._hist_words
            for cell in dirty:
                hist[cell] = cells[cell]
        if self._rows:
            rows, self._rows = self._rows, []
            words, cols = self._batch_words, len(BATCH_COLS)
            for i in rows:
                for col, value in enumerate(self._batch_rows[i]):  # (numpy's row assignment: 1.5 us)
                    words[i * cols + col] = value


class VersionTotals:
    """The sum for one model version: every instance's area plus what the broker counted itself
    (rejections it answered, ensemble outcomes, requests lost with a dead worker)."""

    def __init__(self, latency_buckets: lh.Buckets | None = None) -> None:
        # The version's latency histograms: the broker's own observations, workers' areas added.
        self.latency = BrokerHistograms(latency_buckets or dict(lh.DEFAULT_BUCKETS_MS))
        self.scalars = np.zeros(SCALAR_SLOTS, dtype=np.uint64)
        self.hist = np.zeros((len(PHASES), BUCKETS), dtype=np.uint64)
        self.batches = np.zeros((BATCH_ROWS, len(BATCH_COLS)), dtype=np.uint64)
        self.failure_reasons: dict[str, int] = {}
        self.worker_restarts = 0
        self.pending = 0  # requests waiting for an execution (Triton's pending count)
        self.in_flight = 0  # ... and those executing: accepted, not answered yet
        self.cached = False  # the version uses the response cache: its cache metrics are reported
        self.generation = 0.0  # which load of the version this is (a version loaded again counts afresh)

    def copy(self) -> "VersionTotals":
        out = VersionTotals()
        out.latency = self.latency.copy()
        out.scalars[:] = self.scalars
        out.hist[:] = self.hist
        out.batches[:] = self.batches
        out.failure_reasons = dict(self.failure_reasons)
        out.worker_restarts = self.worker_restarts
        return out

    def add_area(self, area: StatsArea) -> None:
        last = max(int(self.scalars[LAST_INFERENCE_MS]), int(area.scalars[LAST_INFERENCE_MS]))
        self.scalars[:len(SCALARS)] += area.scalars[:len(SCALARS)]
        self.scalars[LAST_INFERENCE_MS] = last
        self.hist += area.hist
        self.batches += area.batches
        self.latency.add(area.latency)

    def fail(self, reason: str, n: int = 1, ns: int = 0) -> None:
        """Failures the broker answered itself (the workers count their own)."""
        self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + n
        self.scalars[FAILURE] += n
        self.scalars[FAILURE_NS] += ns

    def succeed(self, ns: int, batch_size: int = 1, input_ns: int = 0, infer_ns: int = 0, output_ns: int = 0
                ) -> None:
        """An ensemble's success, counted as Triton's ensemble scheduler counts it: one execution
        of the request's batch size (at least 1) whose compute phases are its steps' summed (its
        own queue takes no time), and the request's whole duration ``ns``."""
        s = self.scalars
        s[SUCCESS] += 1
        s[SUCCESS_NS] += ns
        s[INFERENCE_COUNT] += batch_size
        s[EXECUTION_COUNT] += 1
        s[PHASE_COUNT] += 1
        s[INPUT_NS] += input_ns
        s[INFER_NS] += infer_ns
        s[OUTPUT_NS] += output_ns
        row = self.batches[min(batch_size, BATCH_ROWS) - 1]
        for col, value in enumerate((1, input_ns, infer_ns, output_ns)):
            row[col] += value
        for phase, phase_ns in (("request", ns), ("queue", 0), ("compute_input", input_ns),
                                ("compute_infer", infer_ns), ("compute_output", output_ns)):
            self.hist[PHASES.index(phase), bucket_of(phase_ns)] += 1
        for family, phase_ns in ((lh.REQUEST, ns), (lh.QUEUE, 0), (lh.COMPUTE_INPUT, input_ns),
                                 (lh.COMPUTE_INFER, infer_ns), (lh.COMPUTE_OUTPUT, output_ns)):
            self.latency.observe(family, phase_ns)
        s[LAST_INFERENCE_MS] = time.time_ns() // 1_000_000

    def first_response(self, ns: int) -> None:
        """An answer the broker passed on (an ensemble's) was its request's first."""
        self.latency.observe(lh.FIRST_RESPONSE, ns)

    def cache_hit(self, arrived: int, looked_up: int, lookup_ns: int) -> None:
        """A request the broker answered from the response cache (an ensemble's), looked up at
        ``looked_up`` (monotonic ns) in ``lookup_ns``: counted as ``StatsWriter.cache_hit`` counts
        a worker's, a success with its queue time up to the lookup and no inference."""
        if not 0 < arrived <= looked_up:
            arrived = looked_up
        duration = time.monotonic_ns() - arrived
        s = self.scalars
        s[SUCCESS] += 1
        s[SUCCESS_NS] += duration
        s[QUEUE_NS] += looked_up - arrived
        s[CACHE_HIT] += 1
        s[CACHE_HIT_NS] += lookup_ns
        self.hist[0, bucket_of(duration)] += 1
        self.hist[PHASES.index("queue"), bucket_of(looked_up - arrived)] += 1
        for family, ns in ((lh.REQUEST, duration), (lh.FIRST_RESPONSE, duration), (lh.QUEUE, looked_up - arrived)):
            self.latency.observe(family, ns)

    def cache_miss(self, ns: int) -> None:
        """A request the cache did not hold (an ensemble's), counted at its lookup whatever its
        outcome, as Triton counts misses: ``ns`` is the lookup."""
        self.scalars[CACHE_MISS] += 1
        self.scalars[CACHE_MISS_NS] += ns

    def cache_inserted(self, ns: int) -> None:
        """The insertion of a missed request's answer: its time counts with the misses' (Triton's)."""
        self.scalars[CACHE_MISS_NS] += ns

    def get(self, name: str) -> int:
        return int(self.scalars[S[name]])

    def failures(self) -> dict[str, int]:
        """Failures by Triton's reasons: the broker's own (queue timeouts among them: a worker's
        batcher has none, batches_on_worker) plus the workers' (an execution that failed is
        BACKEND, a request cancelled while it waited CANCELED)."""
        out = {reason: 0 for reason in ("REJECTED", "CANCELED", "BACKEND", "OTHER")}
        for reason, n in self.failure_reasons.items():
            out[reason] = out.get(reason, 0) + n
        broker_counted = sum(self.failure_reasons.values())
        worker_failed = self.get("failure") - broker_counted - self.get("cancelled")
        out["BACKEND"] += max(0, worker_failed)
        out["CANCELED"] += self.get("cancelled")
        return out
