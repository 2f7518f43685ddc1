"""Prometheus metrics, served by the broker on ``--metrics-port`` with Triton's names and labels.

Workers keep per-instance statistics in their segments (see ``shm/stats.py``) and the broker
counts what it answers itself; the collector sums them per version at scrape time, so counts are
exact across instances and frontend processes with no aggregation messages. Samples keep Triton's
exact names (no ``_total``); shmserve's own metrics are prefixed ``shmserve_``.
"""
from __future__ import annotations

import dataclasses
import http.server
import logging
import math
import os
import socket
import threading
import time
from typing import Callable, Iterable, Iterator, Protocol

import numpy as np
import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.utils import floatToGoString
from prometheus_client.metrics_core import Metric

from shmserve.shm import latency_histograms as lh
from shmserve.shm.stats import BUCKETS, PHASES, VersionTotals, bucket_upper_ns, quantile_ns

from . import load_times
from .gpu_metrics import FAMILIES as GPU_FAMILIES, GpuSampler
from .summary_window import SummaryWindow
from .system import CpuSampler

log = logging.getLogger("shmserve.metrics")

QUANTILES = (0.5, 0.9, 0.95, 0.99, 0.999)
# Coarse buckets of the request-duration histogram (us): every fine bucket edge at or below one
# of these is summed into it, so dashboards get percentiles without the summaries' cost.
HISTOGRAM_EDGES_US = (100, 250, 500, 1000, 2500, 5000, 10000, 25000, 50000, 100000, 250000, 500000,
                      1000000, 2500000, 5000000, 10000000)
BATCH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

VersionRow = tuple[str, int, VersionTotals]
Family = tuple[str, str, str, list[tuple[dict[str, str], float]]]  # name, help, type, samples


@dataclasses.dataclass
class MetricsOptions:
    port: int = 8002
    address: str = "0.0.0.0"
    interval_ms: int = 2000
    summary_latencies: bool = False
    quantiles: tuple[float, ...] = QUANTILES  # --metrics-config summary_quantiles
    counter_latencies: bool = True  # --metrics-config counter_latencies=false: no *_duration_us counters
    histogram_latencies: bool = False  # --metrics-config histogram_latencies=true
    cpu: bool = True
    gpu: bool = True


def _fine_to_coarse(hist: np.ndarray) -> list[tuple[str, int]]:
    """Cumulative counts at the coarse edges (a fine bucket counts below an edge when its upper
    bound is at or below it) plus +Inf."""
    cumulative = np.cumsum(hist)
    out = []
    for edge in HISTOGRAM_EDGES_US:
        i = -1
        while i + 1 < BUCKETS - 1 and bucket_upper_ns(i + 1) <= edge * 1000:
            i += 1
        out.append((str(float(edge)), int(cumulative[i]) if i >= 0 else 0))
    out.append(("+Inf", int(cumulative[-1])))
    return out


def merge_custom(docs: Iterable[bytes]) -> Iterator[Metric]:
    """The models' own families (workers/custom_metrics.py) from every worker's document, merged
    as one process would hold them: counters and histograms add up; a gauge takes the value of
    the instance that set it last plus the increments of instances that never set it. A family
    another instance declared with a different kind first is left out."""
    families: dict[str, tuple[str, str, dict]] = {}
    for raw in docs:
        try:
            doc = orjson.loads(raw) if raw else []
        except orjson.JSONDecodeError:
            continue
        for f in doc:
            kind, description, cells = families.setdefault(f["name"], (f["kind"], f["description"], {}))
            if kind != f["kind"]:
                continue
            for m in f["metrics"]:
                key = (tuple(sorted(m["labels"].items())), tuple(m.get("buckets", ())))
                got = cells.get(key)
                if got is None:
                    cells[key] = {**m, "counts": list(m.get("counts", ())), "setters": [m] if m.get("t") else [],
                                  "added": 0.0 if m.get("t") else m.get("value", 0.0)}
                    continue
                if kind == "histogram":
                    got["counts"] = [a + b for a, b in zip(got["counts"], m["counts"])]
                    got["sum"] += m["sum"]
                    got["count"] += m["count"]
                elif kind == "counter":
                    got["value"] += m["value"]
                elif m.get("t"):
                    got["setters"].append(m)
                else:
                    got["added"] += m["value"]
    for name, (kind, description, cells) in families.items():
        metric = Metric(name, description, kind)
        for c in cells.values():
            labels = c["labels"]
            if kind == "histogram":
                cumulative = 0
                for upper, n in zip([*c["buckets"], float("inf")], c["counts"]):
                    cumulative += n
                    metric.add_sample(name + "_bucket", {**labels, "le": lh.format_le(upper)}, cumulative)
                metric.add_sample(name + "_count", labels, c["count"])
                metric.add_sample(name + "_sum", labels, c["sum"])
            elif kind == "gauge":
                last = max(c["setters"], key=lambda m: m["t"])["value"] if c["setters"] else 0.0
                metric.add_sample(name, labels, last + c["added"])
            else:
                metric.add_sample(name, labels, c["value"])
        yield metric


class MetricSource(Protocol):
    """What a scrape reads (``statistics.Statistics`` in the broker); called from the scrape thread."""

    def rows(self) -> list[VersionRow]:
        """Every loaded version's statistics."""

    def extras(self) -> list[Family]:
        """shmserve's own families beside the per-version statistics."""

    def custom_docs(self) -> list[bytes]:
        """Every worker's published custom metrics document."""

    def load_times(self) -> dict[tuple[str, int], tuple[list[int], float]]:
        """Per (model, version) ever loaded: counts per load time bucket and their sum in seconds."""


class _Collector:
    def __init__(self, source: MetricSource, opts: MetricsOptions) -> None:
        self.source = source
        self.opts = opts
        self.cpu = CpuSampler(opts.interval_ms / 1000.0)
        # NVML sees every GPU; the server's own mask says which ones it reports, as Triton
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        # (only where metrics are served: NVML and the CUDA driver are not loaded for nothing)
        self.gpu = GpuSampler(opts.interval_ms / 1000.0, mask) if opts.gpu and opts.port > 0 else None
        self.window = SummaryWindow()

    def collect(self) -> Iterator[Metric]:
        rows = self.source.rows()

        def family(name: str, doc: str, kind: str, value: Callable[[VersionTotals], float]) -> Metric:
            m = Metric(name, doc, kind)
            for model, version, st in rows:
                m.add_sample(name, {"model": model, "version": str(version)}, value(st))
            return m

        yield family("nv_inference_request_success", "Number of successful inference requests, all batch sizes",
                     "counter", lambda s: s.get("success"))
        failure = Metric("nv_inference_request_failure", "Number of failed inference requests, all batch sizes",
                         "counter")
        for model, version, st in rows:
            for reason, n in st.failures().items():
                failure.add_sample("nv_inference_request_failure",
                                   {"model": model, "version": str(version), "reason": reason}, n)
        yield failure
        yield family("nv_inference_count", "Number of inferences performed (does not include cached requests)",
                     "counter", lambda s: s.get("inference_count"))
        yield family("nv_inference_exec_count", "Number of model executions performed (does not include cached "
                     "requests)", "counter", lambda s: s.get("execution_count"))
        if self.opts.counter_latencies:
            yield from self._duration_counters(family)
        if any(st.cached for _, _, st in rows):  # as Triton: only for models that use the response cache
            yield from _cache_families([row for row in rows if row[2].cached], self.opts.counter_latencies)
        yield family("nv_inference_pending_request_count", "Instantaneous number of pending requests awaiting "
                     "execution per-model.", "gauge", lambda s: s.pending)
        if self.opts.summary_latencies:
            yield from self._summaries(rows)
        if self.opts.histogram_latencies:
            yield from latency_families(rows)
            yield load_time_family(self.source.load_times())
        yield from self._histograms(rows)
        yield from self._own(family)
        yield from merge_custom(self.source.custom_docs())
        if self.opts.cpu:
            yield from self._cpu()
        if self.gpu is not None:
            yield from self._gpu(self.gpu)

    @staticmethod
    def _duration_counters(family: Callable[..., Metric]) -> Iterator[Metric]:
        """Triton's cumulative durations (``counter_latencies``, on by default)."""
        yield family("nv_inference_request_duration_us", "Cumulative inference request duration in microseconds "
                     "(includes cached requests)", "counter", lambda s: s.get("success_ns") // 1000)
        yield family("nv_inference_queue_duration_us", "Cumulative inference queuing duration in microseconds "
                     "(includes cached requests)", "counter", lambda s: s.get("queue_ns") // 1000)
        yield family("nv_inference_compute_input_duration_us", "Cumulative compute input duration in microseconds "
                     "(does not include cached requests)", "counter", lambda s: s.get("compute_input_ns") // 1000)
        yield family("nv_inference_compute_infer_duration_us", "Cumulative compute inference duration in "
                     "microseconds (does not include cached requests)", "counter",
                     lambda s: s.get("compute_infer_ns") // 1000)
        yield family("nv_inference_compute_output_duration_us", "Cumulative inference compute output duration in "
                     "microseconds (does not include cached requests)", "counter",
                     lambda s: s.get("compute_output_ns") // 1000)

    def _own(self, family: Callable[..., Metric]) -> Iterator[Metric]:
        """shmserve's own families."""
        yield family("shmserve_worker_restarts", "Worker processes restarted after they died", "counter",
                     lambda s: s.worker_restarts)
        yield family("shmserve_queue_depth", "Requests waiting for an instance: scheduler queues and direct lanes",
                     "gauge", lambda s: s.pending)
        yield family("shmserve_requests_in_flight", "Requests accepted and not answered yet: waiting or executing",
                     "gauge", lambda s: s.in_flight)
        for name, doc, kind, samples in self.source.extras():
            m = Metric(name, doc, kind)
            for labels, value in samples:
                m.add_sample(name, labels, value)
            yield m

    def _summaries(self, rows: list[VersionRow]) -> Iterator[Metric]:
        """Triton's ``summary_latencies``: quantiles of the last minute (summary_window.py),
        estimated from the log-spaced histograms; ``_count`` and ``_sum`` of all time."""
        totals = {"request": "success_ns", "queue": "queue_ns", "compute_input": "compute_input_ns",
                  "compute_infer": "compute_infer_ns", "compute_output": "compute_output_ns"}
        recent = self.window.recent({(model, version, st.generation): np.asarray(st.hist) for model, version, st in rows},
                                    time.monotonic())
        for p, phase in enumerate(PHASES):
            name = f"nv_inference_{phase}_summary_us"
            m = Metric(name, SUMMARY_HELP[phase], "summary")
            for model, version, st in rows:
                labels = {"model": model, "version": str(version)}
                hist = st.hist[p]
                window = recent[(model, version, st.generation)][p]
                for q in self.opts.quantiles:  # (nothing in the window: Triton's NaN, a gap on a dashboard)
                    value = quantile_ns(window, q) / 1000.0 if window.any() else math.nan
                    m.add_sample(name, {**labels, "quantile": str(q)}, value)
                m.add_sample(name + "_count", labels, int(hist.sum()))
                m.add_sample(name + "_sum", labels, st.get(totals[phase]) / 1000.0)
            yield m

    @staticmethod
    def _histograms(rows: list[VersionRow]) -> Iterator[Metric]:
        name = "shmserve_request_duration_us"
        m = Metric(name, "Successful request durations in microseconds (for percentiles in dashboards)",
                   "histogram")
        for model, version, st in rows:
            labels = {"model": model, "version": str(version)}
            for le, count in _fine_to_coarse(st.hist[0]):
                m.add_sample(name + "_bucket", {**labels, "le": le}, count)
            m.add_sample(name + "_count", labels, int(st.hist[0].sum()))
            m.add_sample(name + "_sum", labels, st.get("success_ns") / 1000.0)
        yield m
        name = "shmserve_batch_size"
        m = Metric(name, "Executions by batch size (inferences per model execution)", "histogram")
        for model, version, st in rows:
            labels = {"model": model, "version": str(version)}
            counts = st.batches[:, 0]
            for edge in BATCH_EDGES:
                m.add_sample(name + "_bucket", {**labels, "le": str(float(edge))}, int(counts[:edge].sum()))
            m.add_sample(name + "_bucket", {**labels, "le": "+Inf"}, int(counts.sum()))
            m.add_sample(name + "_count", labels, int(counts.sum()))
            # every execution's batch size: its successful requests' and its failed ones'
            m.add_sample(name + "_sum", labels, st.get("inference_count") + st.get("failed_inferences"))
        yield m

    def _cpu(self) -> Iterator[Metric]:
        utilization, total, used = self.cpu.sample()
        for name, doc, value in (("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", utilization),
                                 ("nv_cpu_memory_total_bytes", "CPU total memory (RAM), in bytes", total),
                                 ("nv_cpu_memory_used_bytes", "CPU used memory (RAM), in bytes", used)):
            m = Metric(name, doc, "gauge")
            m.add_sample(name, {}, value)
            yield m

    @staticmethod
    def _gpu(sampler: GpuSampler) -> Iterator[Metric]:
        """One family per figure, a ``gpu_uuid`` sample per visible device that reported it; no
        family at all without devices (as Triton on a host without GPUs)."""
        devices = sampler.sample()
        for name, doc, kind in GPU_FAMILIES:
            samples = [(uuid, figures[name]) for uuid, figures in devices if name in figures]
            if not samples:
                continue
            m = Metric(name, doc, kind)
            for uuid, value in samples:
                m.add_sample(name, {"gpu_uuid": uuid}, value)
            yield m


def latency_families(rows: list[VersionRow]) -> Iterator[Metric]:
    """``histogram_latencies``: per version, in the buckets its config sets, summed over its
    workers and the broker's own observations."""
    for family, (key, name, doc) in enumerate(lh.FAMILIES):
        m = Metric(name, doc, "histogram")
        for model, version, st in rows:
            labels = {"model": model, "version": str(version)}
            buckets, count, total_ms = lh.samples(st.latency.words, family, st.latency.buckets[key])
            for le, n in buckets:
                m.add_sample(name + "_bucket", {**labels, "le": le}, n)
            m.add_sample(name + "_count", labels, count)
            m.add_sample(name + "_sum", labels, total_ms)
        yield m


def load_time_family(rows: dict[tuple[str, int], tuple[list[int], float]]) -> Metric:
    name = load_times.FAMILY
    m = Metric(name, load_times.HELP, "histogram")
    for (model, version), (counts, total) in sorted(rows.items()):
        labels = {"model": model, "version": str(version)}
        cumulative = 0
        for le, n in zip([*map(lh.format_le, load_times.LOAD_BUCKETS_S), "+Inf"], counts):
            cumulative += n
            m.add_sample(name + "_bucket", {**labels, "le": le}, cumulative)
        m.add_sample(name + "_count", labels, cumulative)
        m.add_sample(name + "_sum", labels, total)
    return m


# Triton 2.51's words for its summaries (the compute ones say "Cumulative", as its do).
SUMMARY_HELP = {
    "request": "Summary of inference request duration in microseconds (includes cached requests)",
    "queue": "Summary of inference queuing duration in microseconds (includes cached requests)",
    "compute_input": "Cumulative compute input duration in microseconds (does not include cached requests)",
    "compute_infer": "Cumulative compute inference duration in microseconds (does not include cached requests)",
    "compute_output": "Cumulative inference compute output duration in microseconds (does not include cached "
                      "requests)",
}


def _cache_families(rows: list[VersionRow], durations: bool = True) -> Iterator[Metric]:
    """Triton's per-model response cache counters (hits, misses, and, unless ``counter_latencies``
    is off, their durations in us)."""
    for name, doc, value in (
            ("nv_cache_num_hits_per_model", "Number of cache hits per model", lambda s: s.get("cache_hit")),
            ("nv_cache_num_misses_per_model", "Number of cache misses per model", lambda s: s.get("cache_miss")),
            ("nv_cache_hit_duration_per_model", "Total cache hit duration per model, in microseconds",
             lambda s: s.get("cache_hit_ns") // 1000),
            ("nv_cache_miss_duration_per_model", "Total cache miss (insert+lookup) duration per model, in "
             "microseconds", lambda s: s.get("cache_miss_ns") // 1000)):
        if not durations and name.endswith("_duration_per_model"):
            continue
        m = Metric(name, doc, "counter")
        for model, version, st in rows:
            m.add_sample(name, {"model": model, "version": str(version)}, value(st))
        yield m


def render(registry: CollectorRegistry) -> bytes:
    """The Prometheus text format with Triton's exact family names.

    prometheus_client's writer renames counter families to ``<name>_total`` in their TYPE lines
    (the OpenMetrics convention) while Triton's samples and metadata have no suffix; dashboards
    and recording rules written for Triton expect its names, so the lines are written here.
    """
    out = []
    for metric in registry.collect():
        kind = {"unknown": "untyped", "info": "gauge"}.get(metric.type, metric.type)
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if doc:  # (as Triton: a family described by nothing has no HELP line)
            out.append(f"# HELP {metric.name} {doc}\n")
        out.append(f"# TYPE {metric.name} {kind}\n")
        for sample in metric.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
            out.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n" if labels
                       else f"{sample.name} {floatToGoString(sample.value)}\n")
    return "".join(out).encode()


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def serve_metrics(opts: MetricsOptions, source: MetricSource) -> CollectorRegistry:
    """Serve ``source``'s metrics on ``opts.address``:``opts.port`` (port 0: not served) from a thread
    of their own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(source, opts))  # type: ignore[arg-type]
    if opts.port > 0:
        try:
            server = _server_class(opts.address)((opts.address, opts.port), _handler(registry))
        except OSError as e:
            log.error("cannot serve metrics on %s:%d: %s", opts.address, opts.port, e.strerror)
        else:
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, name="shmserve-metrics", daemon=True).start()
            log.info("serving metrics on %s:%d", opts.address, opts.port)
    return registry


def _server_class(address: str) -> type[http.server.ThreadingHTTPServer]:
    """The standard library's server, for an IPv6 address when ``address`` is one."""
    if ":" not in address:
        return http.server.ThreadingHTTPServer

    class ServerV6(http.server.ThreadingHTTPServer):
        address_family = socket.AF_INET6

    return ServerV6


def _handler(registry: CollectorRegistry) -> type[http.server.BaseHTTPRequestHandler]:
    class MetricsHandler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the standard library's name
            if self.path.split("?")[0] not in ("/metrics", "/metrics/", "/"):  # (Triton takes the slash too)
                self.send_error(404, "metrics are served at /metrics")
                return
            try:
                body = render(registry)
            except Exception:  # noqa: BLE001 - a scrape must never take the broker down
                log.exception("metrics collection failed")
                self.send_error(500, "metrics collection failed")
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _not_allowed(self) -> None:
            """Any other method: Triton's 405, in JSON."""
            body = b'{"error":"Method Not Allowed"}'
            self.send_response(405)
            self.send_header("Allow", "GET")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _not_allowed  # noqa: N815

        def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
            pass

    return MetricsHandler


def version_stats_json(model: str, version: int, st: VersionTotals) -> dict:
    """One ``model_stats`` entry of the statistics extension, as Triton writes it."""
    phase_count = st.get("phase_count")

    def duration(count: int, ns: int) -> dict[str, int]:
        return {"count": count, "ns": ns}

    batches = []
    for row in np.flatnonzero(st.batches[:, 0]).tolist():
        count, input_ns, infer_ns, output_ns = (int(x) for x in st.batches[row])
        batches.append({"batch_size": row + 1, "compute_input": duration(count, input_ns),
                        "compute_infer": duration(count, infer_ns), "compute_output": duration(count, output_ns)})
    return {
        "name": model, "version": str(version),
        "last_inference": st.get("last_inference_ms"),
        "inference_count": st.get("inference_count"), "execution_count": st.get("execution_count"),
        "inference_stats": {
            "success": duration(st.get("success"), st.get("success_ns")),
            "fail": duration(st.get("failure"), st.get("failure_ns")),
            "queue": duration(phase_count + st.get("cache_hit"), st.get("queue_ns")),  # hits wait too
            "compute_input": duration(phase_count, st.get("compute_input_ns")),
            "compute_infer": duration(phase_count, st.get("compute_infer_ns")),
            "compute_output": duration(phase_count, st.get("compute_output_ns")),
            "cache_hit": duration(st.get("cache_hit"), st.get("cache_hit_ns")),
            "cache_miss": duration(st.get("cache_miss"), st.get("cache_miss_ns")),
        },
        "response_stats": {},
        "batch_stats": batches,
        "memory_usage": [],
    }

