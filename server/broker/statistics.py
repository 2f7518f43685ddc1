"""The statistics the broker serves: per version, what it counted itself plus every live worker's
counters (``shm/stats.py``), and shmserve's own gauges and counters.

The statistics extension (``control.py``) and the Prometheus scrape (``metrics.py``, from its
own thread) read them here; nothing is aggregated ahead of a read.
"""
from __future__ import annotations

from shmserve.shm.extents import OutputArenas
from shmserve.shm.response_cache import CacheStore
from shmserve.shm.stats import EXECUTING, VersionTotals

from . import response_cache
from .catalog import Catalog
from .edge_reports import EdgeReports
from .instances import Instances
from .metrics import QUANTILES, Family, MetricsOptions, serve_metrics
from .options import BrokerOptions
from .regions import Regions
from .summary_window import summary_quantiles


class Statistics:
    def __init__(self, answers: OutputArenas, catalog: Catalog, instances: Instances, regions: Regions,
                 cache: CacheStore | None = None) -> None:
        self.answers = answers  # the broker's output arena
        self.edges = EdgeReports()  # the frontends' (control.py takes their reports)
        self.cache = cache  # the response cache (--cache-config), for Triton's global nv_cache_* gauges
        self.catalog = catalog
        self.instances = instances
        self.regions = regions

    def serve(self, opts: BrokerOptions) -> None:
        """Serve the metrics on ``--metrics-address``:``--metrics-port`` (scrapes call rows, extras and custom_docs)."""
        serve_metrics(MetricsOptions(port=opts.metrics_port, address=opts.metrics_address,
                                     interval_ms=opts.metrics_interval_ms,
                                     summary_latencies=opts.metrics_config.get("summary_latencies") == "true",
                                     counter_latencies=opts.metrics_config.get("counter_latencies") != "false",
                                     quantiles=summary_quantiles(opts.metrics_config.get("summary_quantiles", ""))
                                     or QUANTILES,
                                     histogram_latencies=opts.histogram_latencies,
                                     cpu=opts.cpu_metrics, gpu=opts.gpu_metrics), self)

    def rows(self) -> list[tuple[str, int, VersionTotals]]:
        """Per version: what the broker counted itself plus every live worker's statistics."""
        rows = []
        for name, versions in list(self.catalog.models.items()):
            for v, mv in list(versions.items()):
                total = self.instances.version_totals(mv)
                # Requests waiting for execution, as Triton counts them: those clients put on direct
                # lanes and the worker has not finished, and the broker's own (in_flight()), less
                # those in the running executions.
                live = [i for i in list(mv.instances) if self.instances.live(i)]
                total.in_flight = mv.in_flight() + sum(i.lanes_unfinished(others=True) for i in live)
                total.pending = max(0, total.in_flight - sum(int(i.seg.stats.scalars[EXECUTING]) for i in live))
                total.cached = response_cache.enabled(mv.config_dict, self.instances.opts.response_cache_bytes)
                total.generation = mv.created
                rows.append((name, v, total))
        return rows

    def extras(self) -> list[Family]:
        """shmserve's own gauges and counters beside the per-version statistics."""
        arenas: list[tuple[dict[str, str], float]] = [({"owner": "broker"}, self.answers.in_use_now())]
        loads, regions = [], self.regions.system.regions
        for name, versions in list(self.catalog.models.items()):
            for v, mv in list(versions.items()):
                labels = {"model": name, "version": str(v)}
                loads.append((labels, mv.load_seconds))
                used = sum(int(i.seg.stats.get("arena_bytes")) for i in mv.instances if self.instances.live(i))
                arenas.append(({"owner": "worker", **labels}, used))
        return [
            ("shmserve_arena_bytes_in_use", "Bytes allocated in shared-memory arenas (broker; workers' output "
             "arenas per version)", "gauge", arenas),
            ("shmserve_registered_regions", "System shared-memory regions registered by clients", "gauge",
             [({}, len(regions))]),
            ("shmserve_registered_region_bytes", "Bytes of the registered system shared-memory regions", "gauge",
             [({}, sum(r.byte_size for r in list(regions.values())))]),
            ("shmserve_model_load_duration_seconds", "Seconds from the start of a version's load until it was "
             "ready", "gauge", loads),
            ("shmserve_model_load_failures", "Loads of a model that failed", "counter",
             [({"model": m}, n) for m, n in list(self.catalog.load_failures.items())]),
            ("shmserve_model_serving_after_failed_load", "1 while a model's older versions serve because its "
             "last load failed", "gauge",
             [({"model": m}, 1) for m in list(self.catalog.models) if self.catalog.failed_reload(m)]),
            ("shmserve_canary_decisions", "Canary promotions and rollbacks, by trigger (manual, error_rate, "
             "p99_latency)", "counter",
             [({"model": c.model, "version": str(v), "action": action, "trigger": trigger}, n)
              for c in list(self.catalog.canaries.values()) for (v, action, trigger), n in list(c.counts.items())]),
            ("shmserve_canary_traffic_fraction", "Share of a model's unversioned requests each version is sent",
             "gauge", self._split_samples()),
        ] + self._cache_families() + self.edges.families()

    def _cache_families(self) -> list[Family]:
        """Triton's global response cache gauges (its names and words), with a cache only."""
        if self.cache is None:
            return []
        t = self.cache.totals()
        return [(name, doc, "gauge", [({}, value)]) for name, doc, value in (
            ("nv_cache_num_entries", "Number of responses stored in response cache", t.entries),
            ("nv_cache_num_lookups", "Number of cache lookups in response cache", t.lookups),
            ("nv_cache_num_hits", "Number of cache hits in response cache", t.hits),
            ("nv_cache_num_misses", "Number of cache misses in response cache", t.misses),
            ("nv_cache_num_evictions", "Number of cache evictions in response cache", t.evictions),
            ("nv_cache_lookup_duration", "Total cache lookup duration (hit and miss), in microseconds", t.lookup_us),
            ("nv_cache_insertion_duration", "Total cache insertion duration, in microseconds", t.insertion_us),
            ("nv_cache_util", "Cache utilization [0.0 - 1.0]", t.util))]

    def load_times(self) -> dict[tuple[str, int], tuple[list[int], float]]:
        """Every successful load's duration, per version (kept after unloads)."""
        return dict(self.catalog.load_times.rows)

    def custom_docs(self) -> list[bytes]:
        """Every live worker's published custom metrics."""
        return self.instances.custom_metric_docs()

    def _split_samples(self) -> list[tuple[dict[str, str], float]]:
        out = []
        for name in list(self.catalog.models):
            split = self.catalog.split(name)
            if split is None:
                continue
            if split.canary is None:
                out.append(({"model": name, "version": str(split.stable)}, 1.0))
            else:
                out.append(({"model": name, "version": str(split.stable)}, 1.0 - split.fraction))
                out.append(({"model": name, "version": str(split.canary)}, split.fraction))
        return out
