"""Statistics: after requests of known outcomes, the statistics extension (through tritonclient)
and the Prometheus metrics show exactly those counts, across instances, frontend processes and
local clients; failures by reason; phase durations that add up; batch statistics."""
from __future__ import annotations

import concurrent.futures
import re
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TESTS, raw_request
from shmserve.shm.client import Client, InferenceServerError
from shmserve.workers.devices import cuda_device_count

STATS_MODELS = TESTS / "models" / "stats"


@pytest.fixture(scope="module")
def stats_server(module_factory):
    return module_factory.start([STATS_MODELS], ["--http-workers", "2",
                                                 "--metrics-config", "summary_latencies=true",
                                                 "--metrics-config", "histogram_latencies=true"])


def scrape(server) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include ``labels``."""
    found = []
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            found.append(float(m.group(3)))
    assert len(found) == 1, f"{name}{labels}: {found}"
    return found[0]


def double(url: str, x: list[int]) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    try:
        t = httpclient.InferInput("X", [len(x)], "INT32")
        t.set_data_from_numpy(np.array(x, dtype=np.int32))
        return client.infer("doubler", [t]).as_numpy("Y")
    finally:
        client.close()


def model_stats(server, model: str) -> dict:
    client = httpclient.InferenceServerClient(server.url)
    try:
        stats = client.get_inference_statistics(model)
    finally:
        client.close()
    assert [s["name"] for s in stats["model_stats"]] == [model]
    return stats["model_stats"][0]


def test_counts_are_exact_across_instances_frontends_and_local_clients(stats_server):
    """40 successes over HTTP (2 frontends, 2 instances, concurrent), 10 through the local
    client, 3 error responses, 2 executions that raise, 4 requests refused for bad input. As
    Triton counts them: an error response the model returned is a success, an execution that
    raised counts as one and fails its request, a refused request counts nowhere."""
    url = stats_server.url
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: double(url, [i, i + 1]), range(40)))
    assert all((r == np.array([2 * i, 2 * i + 2])).all() for i, r in enumerate(results))
    with Client(stats_server.id) as local:
        for i in range(10):
            out = local.infer("doubler", {"X": np.array([i], dtype=np.int32)})
            assert out["Y"].tolist() == [2 * i]
        with pytest.raises(InferenceServerError):
            local.infer("doubler", {"X": np.array([-1], dtype=np.int32)})
    for x in ([-1], [-2]):
        with pytest.raises(InferenceServerException, match="negative input"):
            double(url, x)
    for _ in range(2):
        with pytest.raises(InferenceServerException, match="told to raise"):
            double(url, [-999])
    client = httpclient.InferenceServerClient(url)
    for _ in range(4):
        bad = httpclient.InferInput("X", [2], "FP32")
        bad.set_data_from_numpy(np.zeros(2, dtype=np.float32))
        with pytest.raises(InferenceServerException) as e:
            client.infer("doubler", [bad])
        assert e.value.status() == "400"
    client.close()

    st = model_stats(stats_server, "doubler")
    inf = st["inference_stats"]
    assert st["version"] == "1"
    assert inf["success"]["count"] == 50 + 3
    assert inf["fail"]["count"] == 2 and inf["fail"]["ns"] > 0
    assert st["inference_count"] == 53 and st["execution_count"] == 53 + 2
    for phase in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert inf[phase]["count"] == 53, phase
        assert inf[phase]["ns"] > 0, phase
    phases = sum(inf[p]["ns"] for p in ("queue", "compute_input", "compute_infer", "compute_output"))
    assert inf["success"]["ns"] >= phases
    assert st["last_inference"] > 1.7e12  # milliseconds since the epoch
    # every execution, the two that raised too
    [row] = st["batch_stats"]
    assert row["batch_size"] == 1
    for p in ("compute_input", "compute_infer", "compute_output"):
        assert row[p]["count"] == 55 and row[p]["ns"] >= inf[p]["ns"], p

    text = scrape(stats_server)
    labels = {"model": "doubler", "version": "1"}
    assert sample(text, "nv_inference_request_success", **labels) == 53
    assert sample(text, "nv_inference_request_failure", reason="BACKEND", **labels) == 2
    assert sample(text, "nv_inference_request_failure", reason="REJECTED", **labels) == 0
    assert sample(text, "nv_inference_request_failure", reason="OTHER", **labels) == 0
    assert sample(text, "nv_inference_count", **labels) == 53
    assert sample(text, "nv_inference_exec_count", **labels) == 55
    assert sample(text, "shmserve_batch_size_count", **labels) == 55
    assert sample(text, "shmserve_batch_size_sum", **labels) == 55
    assert sample(text, "nv_inference_request_duration_us", **labels) == inf["success"]["ns"] // 1000
    assert sample(text, "nv_inference_queue_duration_us", **labels) == inf["queue"]["ns"] // 1000
    assert sample(text, "nv_inference_compute_infer_duration_us", **labels) == inf["compute_infer"]["ns"] // 1000
    assert sample(text, "nv_inference_pending_request_count", **labels) == 0
    assert sample(text, "shmserve_requests_in_flight", **labels) == 0
    assert sample(text, "shmserve_request_duration_us_count", **labels) == 53
    assert sample(text, "shmserve_request_duration_us_bucket", le="+Inf", **labels) == 53
    # summary_latencies=true: Triton's summaries, quantiles in order
    q = [sample(text, "nv_inference_request_summary_us", quantile=str(x), **labels) for x in (0.5, 0.9, 0.99)]
    assert 0 < q[0] <= q[1] <= q[2]
    assert sample(text, "nv_inference_queue_summary_us_count", **labels) == 53


def test_batch_statistics_follow_the_batches_formed(stats_server):
    url = stats_server.url

    barrier = threading.Barrier(8)  # sent together: well within the 500 ms the batcher waits for more

    def one(i: int) -> np.ndarray:
        c = httpclient.InferenceServerClient(url)
        t = httpclient.InferInput("X", [1, 2], "INT32")
        t.set_data_from_numpy(np.array([[i, i]], dtype=np.int32))
        try:
            barrier.wait()
            return c.infer("batch_doubler", [t]).as_numpy("Y")
        finally:
            c.close()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        out = list(pool.map(one, range(8)))
    assert [o.tolist() for o in out] == [[[2 * i, 2 * i]] for i in range(8)]
    st = model_stats(stats_server, "batch_doubler")
    assert st["inference_stats"]["success"]["count"] == 8
    assert st["inference_count"] == 8
    rows = {b["batch_size"]: b["compute_infer"]["count"] for b in st["batch_stats"]}
    assert sum(size * n for size, n in rows.items()) == 8
    assert sum(rows.values()) == st["execution_count"] < 8  # requests were batched
    text = scrape(stats_server)
    assert sample(text, "shmserve_batch_size_count", model="batch_doubler", version="1") == st["execution_count"]
    assert sample(text, "shmserve_batch_size_sum", model="batch_doubler", version="1") == 8


def test_statistics_endpoints_and_errors(stats_server):
    everything = raw_request(stats_server.port, "GET", "/v2/models/stats")
    assert everything.status == 200
    # every model, by name as Triton lists them (its models in a map)
    assert [s["name"] for s in everything.json()["model_stats"]] == ["batch_doubler", "doubler"]
    one = raw_request(stats_server.port, "GET", "/v2/models/doubler/versions/1/stats")
    assert one.status == 200 and [s["version"] for s in one.json()["model_stats"]] == ["1"]
    unknown = raw_request(stats_server.port, "GET", "/v2/models/nope/stats")
    # Triton 2.51's statistics texts (they differ from its inference ones).
    assert unknown.status == 400 and unknown.json() == {"error": "requested model 'nope' is not available"}
    bad_version = raw_request(stats_server.port, "GET", "/v2/models/doubler/versions/7/stats")
    assert bad_version.status == 400
    assert bad_version.json() == {"error": "requested model version is not available for model 'doubler'"}
    meta = raw_request(stats_server.port, "GET", "/v2").json()
    assert "statistics" in meta["extensions"]


def test_host_metrics_and_shmserve_gauges(stats_server):
    text = scrape(stats_server)
    # Triton's family names exactly (no _total), in a format Prometheus parses
    assert "# TYPE nv_inference_request_success counter\n" in text
    assert "# TYPE nv_inference_count counter\n" in text
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name for f in text_string_to_metric_families(text)}
    assert {"nv_inference_request_success", "nv_cpu_utilization", "shmserve_request_duration_us"} <= families
    assert 0.0 <= sample(text, "nv_cpu_utilization") <= 1.0
    total, used = sample(text, "nv_cpu_memory_total_bytes"), sample(text, "nv_cpu_memory_used_bytes")
    assert 0 < used < total
    check_gpu_families(text)
    assert sample(text, "shmserve_model_load_duration_seconds", model="doubler", version="1") > 0
    assert sample(text, "shmserve_registered_regions") == 0
    assert sample(text, "shmserve_worker_restarts", model="doubler", version="1") == 0
    assert sample(text, "shmserve_arena_bytes_in_use", owner="broker") >= 0


GPU_FAMILIES = ("nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
                "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption")


def gpu_families(text: str) -> dict[str, dict[str, float]]:
    """Triton's GPU families in a scrape: family name -> gpu_uuid -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: {s.labels["gpu_uuid"]: s.value for s in f.samples}
            for f in text_string_to_metric_families(text) if f.name in GPU_FAMILIES}


def check_gpu_families(text: str) -> None:
    """Without a CUDA device no GPU family appears; with them (the server inherits this process's
    CUDA_VISIBLE_DEVICES) every family has one sample per visible device, labelled by its UUID."""
    found = gpu_families(text)
    devices = cuda_device_count()
    if devices == 0:
        assert found == {}
        return
    assert set(found) == set(GPU_FAMILIES), found
    uuids = set(found["nv_gpu_utilization"])
    assert len(uuids) == devices, found
    assert all(uuid.startswith("GPU-") for uuid in uuids), uuids
    for name in GPU_FAMILIES:
        assert set(found[name]) == uuids, (name, found[name])
    for uuid in uuids:
        assert 0.0 <= found["nv_gpu_utilization"][uuid] <= 1.0
        assert 0 <= found["nv_gpu_memory_used_bytes"][uuid] <= found["nv_gpu_memory_total_bytes"][uuid]
        assert found["nv_gpu_memory_total_bytes"][uuid] > 0
        assert 0 < found["nv_gpu_power_usage"][uuid]
        assert 0 < found["nv_gpu_power_limit"][uuid]
        assert 0 <= found["nv_energy_consumption"][uuid]


def test_gpu_metrics_can_be_turned_off(server_factory):
    server = server_factory.start([STATS_MODELS], ["--allow-gpu-metrics=false"])
    text = scrape(server)
    assert gpu_families(text) == {}
    assert 0.0 <= sample(text, "nv_cpu_utilization") <= 1.0


def test_cpu_metrics_can_be_turned_off_and_summaries_are_off_by_default(server_factory):
    server = server_factory.start([STATS_MODELS], ["--allow-cpu-metrics=false"])
    text = scrape(server)
    assert "nv_cpu_utilization" not in text
    assert "nv_inference_request_summary_us" not in text
    assert sample(text, "nv_inference_request_success", model="doubler", version="1") == 0


def test_summaries_say_tritons_words_and_nan_before_any_request(server_factory):
    """As Triton 2.51: its HELP texts, and a model with no request yet has NaN quantiles (a gap
    on a dashboard), not 0 us."""
    import math

    server = server_factory.start([STATS_MODELS], ["--metrics-config", "summary_latencies=true"])
    text = scrape(server)
    assert ("# HELP nv_inference_request_summary_us Summary of inference request duration in microseconds "
            "(includes cached requests)") in text
    assert ("# HELP nv_inference_compute_infer_summary_us Cumulative compute inference duration in microseconds "
            "(does not include cached requests)") in text
    assert math.isnan(sample(text, "nv_inference_request_summary_us", model="doubler", version="1", quantile="0.5"))
    assert sample(text, "nv_inference_request_summary_us_count", model="doubler", version="1") == 0


def test_counter_latencies_off_and_summary_quantiles_as_tritons_metrics_config(server_factory):
    """Two of Triton 2.51's --metrics-config keys: counter_latencies=false leaves out the
    cumulative durations; summary_quantiles sets the summaries' quantiles (QUANTILE:ERROR)."""
    server = server_factory.start([STATS_MODELS], [
        "--metrics-config", "counter_latencies=false", "--metrics-config", "summary_latencies=true",
        "--metrics-config", "summary_quantiles=0.5:0.05,0.99:0.001"])
    t = httpclient.InferInput("X", [2], "INT32")
    t.set_data_from_numpy(np.array([1, 2], dtype=np.int32))
    server.client().infer("doubler", [t])
    text = scrape(server)
    assert "nv_inference_request_duration_us" not in text and "nv_inference_compute_infer_duration_us" not in text
    assert sample(text, "nv_inference_count", model="doubler", version="1") == 1
    quantiles = set(re.findall(r'nv_inference_request_summary_us\{[^}]*model="doubler"[^}]*quantile="([^"]+)"', text))
    assert quantiles == {"0.5", "0.99"}, quantiles
    assert sample(text, "nv_inference_request_summary_us", model="doubler", version="1", quantile="0.99") > 0
    bad = server_factory.create([STATS_MODELS], ["--metrics-config", "summary_quantiles=0.5"])
    bad.start()
    assert bad.wait_exit(60) == 2
    assert "summary_quantiles: '0.5' is not QUANTILE:ERROR" in bad.log()


def test_bad_metrics_config_is_refused(server_factory):
    server = server_factory.create([STATS_MODELS], ["--metrics-config", "bogus=1"])
    server.start()
    assert server.wait_exit(60) == 2
    assert "--metrics-config" in server.log()


def test_grafana_dashboard_uses_only_metrics_the_server_exports(stats_server):
    import json

    from conftest import ROOT

    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 12
    names = {n for e in exprs for n in re.findall(r"\b((?:nv|shmserve)_[a-z_]+)", e)}
    exported = set(re.findall(r"^# TYPE (\S+) ", scrape(stats_server), re.M))
    for name in names:
        base = re.sub(r"_(bucket|count|sum)$", "", name)
        assert name in exported or base in exported, f"dashboard uses {name}, which the server does not export"
    assert {"shmserve_inference_request_histogram_ms_bucket", "nv_inference_first_response_histogram_ms_bucket",
            "shmserve_inference_queue_histogram_ms_bucket", "shmserve_model_load_histogram_seconds_bucket",
            "nv_inference_request_success", "shmserve_canary_traffic_fraction"} <= names


def test_custom_metrics_of_two_instances_read_as_one(module_factory):
    """pb_utils.MetricFamily / Metric in a model with two instances: served on the metrics port
    from the moment the model is ready, merged across the instances as Triton's single process
    holds them; misuses raise TritonModelException in the model."""
    import json

    s = module_factory.start([TESTS / "models" / "custom_metrics"])
    text = scrape(s)
    assert sample(text, "metered_requests", model="metered") == 0
    assert "# TYPE metered_requests counter" in text and "# TYPE metered_x histogram" in text
    sent = [1, 5, 50, 500]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # both instances take requests
        results = list(pool.map(lambda x: metered(s.url, x), sent[:2]))
    results += [metered(s.url, x) for x in sent[2:]]  # one after the other: 500 is set last
    checks = json.loads(results[-1])
    assert all(checks[k] for k in ("negative_counter", "set_counter", "histogram_without_buckets",
                                   "reserved_name", "other_kind")), checks
    assert "nv_mine" in checks["reserved_name"]
    # Triton 2.51's texts, less the stub's "Failed to process the request for model '<instance>', message: "
    kinds = "TRITONSERVER_METRIC_KIND_"
    assert checks["negative_counter"] == f"Failed to increment metric value: {kinds}COUNTER can only be " \
        "incremented monotonically by non-negative values."
    assert checks["set_counter"] == f"Failed to set metric value: {kinds}COUNTER does not support Set"
    assert checks["observe_gauge"] == f"Failed to observe metric value: {kinds}GAUGE does not support Observe"
    assert checks["increment_histogram"] == f"Failed to increment metric value: {kinds}HISTOGRAM does not support Increment"
    assert checks["value_histogram"] == f"Failed to get metric value: {kinds}HISTOGRAM does not support Value"
    assert checks["histogram_without_buckets"] == "Failed to create metric. Missing required buckets."
    assert checks["buckets_gauge"] == "Failed to create metric. Unexpected buckets found."
    assert checks["labels_list"] == "Failed to create metric. Labels must be a dictionary."
    assert checks["buckets_str"] == "Failed to create metric. Buckets must be a list."
    assert checks["buckets_unsorted"] == "Error when creating Metric: Bucket Boundaries must be strictly sorted"
    assert checks["numpy_values"] == [2.5, True]  # numpy scalars, a one-element array, a bool: as float() takes them
    assert checks["str_value"] == checks["none_value"] == "TypeError"
    assert checks["counter_value"] is True
    text = scrape(s)
    assert sample(text, "metered_requests", model="metered") == 4
    assert sample(text, "metered_value", model="metered", kind="added") == sum(sent)
    assert sample(text, "metered_value", model="metered", kind="last") == 500
    # (the bounds as Triton's prometheus-cpp writes them: a series is keyed on the label's text)
    assert [sample(text, "metered_x_bucket", model="metered", le=le) for le in ("1", "10", "100", "+Inf")] \
        == [1, 2, 3, 4]
    assert "# TYPE metered_quiet counter" in text and "# HELP metered_quiet" not in text  # (no description)
    assert sample(text, "metered_x_count", model="metered") == 4
    assert sample(text, "metered_x_sum", model="metered") == sum(sent)


def metered(url: str, x: int) -> str:
    client = httpclient.InferenceServerClient(url)
    try:
        t = httpclient.InferInput("X", [1], "INT32")
        t.set_data_from_numpy(np.array([x], dtype=np.int32))
        return client.infer("metered", [t]).as_numpy("CHECKS")[0].decode()
    finally:
        client.close()


def test_histogram_buckets_are_the_bounds_bisected():
    """A duration's bucket is the first whose upper bound holds it: the integer search the
    worker runs per request agrees with bisecting the (float) bounds, at and around each bound."""
    from bisect import bisect_left

    from shmserve.shm.stats import BUCKETS, bucket_of, bucket_upper_ns

    uppers = [bucket_upper_ns(i) for i in range(BUCKETS - 1)]
    durations = [0, 1, 9_999, 10_000, 10_001, 2**62]
    for upper in uppers:
        durations += [int(upper) - 1, int(upper), int(upper) + 1]
    for ns in durations:
        assert bucket_of(ns) == bisect_left(uppers, ns), ns
    assert bucket_of(2**62) == BUCKETS - 1  # the last bucket is unbounded


def test_published_counters_are_never_torn():
    """The broker reads a worker's counters while the worker writes them: each counter must be
    written as one 8-byte store, or a reader sees half of a new value (``struct.pack_into``
    writes byte by byte: 19% of such reads were torn). A child process flushes a counter that
    flips between two values differing in both halves; this process reads it meanwhile."""
    import mmap
    import os
    import time

    from shmserve.shm.stats import SUCCESS_NS, StatsArea, StatsWriter

    low, high = 0x0000_0000_FFFF_FFFF, 0xFFFF_FFFF_0000_0000
    mm = mmap.mmap(-1, StatsArea.nbytes() + 8)  # shared with the child across fork; the last word: "stop"
    area = StatsArea(mm, 0)
    writer = StatsWriter(area)
    writer.counts[SUCCESS_NS] = low
    writer.flush()
    words = memoryview(mm).cast("Q")
    stop = len(words) - 1
    pid = os.fork()
    if pid == 0:  # the writer, until told to stop (or after a minute, should this process die)
        try:
            end = time.monotonic() + 60.0
            while not words[stop] and time.monotonic() < end:
                for value in (high, low) * 500:
                    writer.counts[SUCCESS_NS] = value
                    writer.flush()
        finally:
            os._exit(0)
    # Read until the value has changed under the reads many times: that many reads overlapped
    # writes, however the two processes were scheduled (a torn read is one in five of those).
    seen, torn, changes, last = set(), 0, 0, low
    try:
        end = time.monotonic() + 60.0
        while changes < 1000 and time.monotonic() < end:
            for _ in range(1000):
                value = words[SUCCESS_NS]
                seen.add(value)
                torn += value not in (low, high)
                changes += value != last
                last = value
    finally:
        words[stop] = 1
        os.waitpid(pid, 0)
        del words, area
    assert changes >= 1000, changes
    assert seen >= {low, high}  # the reads overlapped the writes
    assert torn == 0


# -- what counts as a failure, as Triton 2.51 counts it -------------------------------------------

# The stats repository's doubler: doubles X, answers a negative X with an error response, raises
# for -999.
OUTCOMES_MODEL = (STATS_MODELS / "doubler" / "1" / "model.py").read_text()
# A model on workers' direct lanes, and one whose requests the broker batches.
OUTCOMES_CONFIGS = {
    "direct_outcomes": 'backend: "python"\nmax_batch_size: 0\n'
                       'input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
                       'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 2 ] } ]\n',
    "batched_outcomes": 'backend: "python"\nmax_batch_size: 4\n'
                        'input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
                        'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
                        'dynamic_batching { }\n',
}
BATCH_PHASES = ("compute_input", "compute_infer", "compute_output")
FAILURE_REASONS = ("REJECTED", "CANCELED", "BACKEND", "OTHER")


def flat_stats(st: dict) -> dict[str, int]:
    """A ``model_stats`` entry, from HTTP's JSON or gRPC's (which leaves zeros out and writes
    64-bit numbers as strings), as flat numbers."""
    out = {name: int(st.get(name, 0)) for name in ("inference_count", "execution_count", "last_inference")}
    for phase, d in st["inference_stats"].items():
        out[f"{phase}.count"], out[f"{phase}.ns"] = int(d.get("count", 0)), int(d.get("ns", 0))
    for row in st.get("batch_stats", []):
        for phase in BATCH_PHASES:
            d = row.get(phase, {})
            out[f"batch{int(row['batch_size'])}.{phase}.count"] = int(d.get("count", 0))
            out[f"batch{int(row['batch_size'])}.{phase}.ns"] = int(d.get("ns", 0))
    return out


def flat_metrics(server, model: str) -> dict[str, float]:
    text = scrape(server)
    labels = {"model": model, "version": "1"}
    out = {name: sample(text, name, **labels) for name in (
        "nv_inference_request_success", "nv_inference_count", "nv_inference_exec_count")}
    for reason in FAILURE_REASONS:
        out[reason] = sample(text, "nv_inference_request_failure", reason=reason, **labels)
    return out


class Outcomes:
    """One protocol's client of the outcomes models, and its statistics extension."""

    def __init__(self, protocol: str, server) -> None:
        import tritonclient.grpc as grpcclient

        self.protocol = protocol
        self.lib = httpclient if protocol == "http" else grpcclient
        self.client = self.lib.InferenceServerClient(server.url if protocol == "http" else server.grpc_url)

    def stats(self, model: str) -> dict[str, int]:
        if self.protocol == "http":
            return flat_stats(self.client.get_inference_statistics(model)["model_stats"][0])
        return flat_stats(self.client.get_inference_statistics(model, as_json=True)["model_stats"][0])

    def infer(self, model: str, x: list[int] | None) -> np.ndarray:
        """Infer ``x`` (None: with no input at all); shaped [1, 2] for the batching model."""
        inputs = []
        if x is not None:
            arr = np.array([x] if model == "batched_outcomes" else x, dtype=np.int32)
            t = self.lib.InferInput("X", list(arr.shape), "INT32")
            t.set_data_from_numpy(arr)
            inputs.append(t)
        return self.client.infer(model, inputs).as_numpy("Y")


def count_deltas(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counts that changed (``name: delta``); each changed count's duration must have grown
    and each unchanged one's stayed (a queue may take 0 ns)."""
    deltas = {}
    for key in sorted(set(before) | set(after)):
        if key.endswith(".count") or key in ("inference_count", "execution_count"):
            delta = after.get(key, 0) - before.get(key, 0)
            ns_key = key.replace(".count", ".ns")
            if ns_key != key:
                grown = after.get(ns_key, 0) - before.get(ns_key, 0)
                assert (grown >= 0 if key == "queue.count" else grown > 0) if delta else grown == 0, (key, delta, grown)
            if delta:
                deltas[key] = delta
    return deltas


def metric_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


@pytest.mark.parametrize("model", list(OUTCOMES_CONFIGS))
def test_failures_count_as_triton_counts_them(server_factory, tmp_path, model):
    """Triton 2.51's deltas around one request each, over HTTP and gRPC, in the statistics
    extension and the metrics: a request refused before it ran (an input missing) counts
    nowhere; an ``execute`` that raised counts its execution (batch statistics, last inference)
    and fails its request; an error response the model returned is a request the backend
    executed successfully; a success counts as it always did."""
    (tmp_path / "repo" / model / "1").mkdir(parents=True)
    (tmp_path / "repo" / model / "config.pbtxt").write_text(f'name: "{model}"\n' + OUTCOMES_CONFIGS[model])
    (tmp_path / "repo" / model / "1" / "model.py").write_text(OUTCOMES_MODEL)
    server = server_factory.start([tmp_path / "repo"])
    executed = {"execution_count": 1, **{f"batch1.{p}.count": 1 for p in BATCH_PHASES}}
    ran = {"success.count": 1, "inference_count": 1, "queue.count": 1,
           **{f"{p}.count": 1 for p in BATCH_PHASES}, **executed}
    for protocol in ("http", "grpc"):
        client = Outcomes(protocol, server)
        try:
            # 1. An input missing: refused before it is queued (400), counted nowhere.
            before, metrics = client.stats(model), flat_metrics(server, model)
            with pytest.raises(InferenceServerException, match="expected 1 inputs but got 0"):
                client.infer(model, None)
            after = client.stats(model)
            assert after == before, protocol
            assert metric_deltas(metrics, flat_metrics(server, model)) == {}, protocol

            # 2. execute raised: its execution counts, its request fails (500).
            before, metrics = after, flat_metrics(server, model)
            with pytest.raises(InferenceServerException, match="told to raise"):
                client.infer(model, [-999, 1])
            after = client.stats(model)
            assert count_deltas(before, after) == {"fail.count": 1, **executed}, protocol
            assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 1.7e12
            assert metric_deltas(metrics, flat_metrics(server, model)) == {"nv_inference_exec_count": 1,
                                                                            "BACKEND": 1}, protocol

            # 3. The model returned an error response: a 500 to the client, a success in the counts.
            before, metrics = after, flat_metrics(server, model)
            with pytest.raises(InferenceServerException, match="negative input"):
                client.infer(model, [-1, 1])
            after = client.stats(model)
            assert count_deltas(before, after) == ran, protocol
            assert metric_deltas(metrics, flat_metrics(server, model)) == {
                "nv_inference_request_success": 1, "nv_inference_count": 1, "nv_inference_exec_count": 1}, protocol

            # 4. A success: as before.
            before, metrics = after, flat_metrics(server, model)
            assert client.infer(model, [3, 4]).reshape(-1).tolist() == [6, 8]
            after = client.stats(model)
            assert count_deltas(before, after) == ran, protocol
            assert metric_deltas(metrics, flat_metrics(server, model)) == {
                "nv_inference_request_success": 1, "nv_inference_count": 1, "nv_inference_exec_count": 1}, protocol
        finally:
            client.client.close()


DECOUPLED_ECHO = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            if (x < 0).any():
                sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''


def _stream_once(server, model: str, x: list[int]) -> list:
    """One request on a gRPC stream; its results and errors, in order."""
    import queue

    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        t = grpcclient.InferInput("X", [len(x)], "INT32")
        t.set_data_from_numpy(np.array(x, dtype=np.int32))
        c.async_stream_infer(model, [t], enable_empty_final_response=True)
        out = []
        while True:
            item = got.get(timeout=30)
            out.append(item)
            if isinstance(item, InferenceServerException):
                break
            if item.get_response(as_json=True).get("parameters", {}).get("triton_final_response", {}).get("bool_param"):
                break
        c.stop_stream()
    return out


def _one_model_server(server_factory, tmp_path, model: str, source: str, config: str) -> tuple:
    """A server of one Python model (``source``, ``config``) and an HTTP client of its statistics."""
    (tmp_path / "repo" / model / "1").mkdir(parents=True)
    (tmp_path / "repo" / model / "config.pbtxt").write_text(config)
    (tmp_path / "repo" / model / "1" / "model.py").write_text(source)
    server = server_factory.start([tmp_path / "repo"])
    return server, Outcomes("http", server)


def test_a_decoupled_models_error_response_counts_as_a_success(server_factory, tmp_path):
    """As Triton 2.51 counts it (checked side by side): a decoupled model that answers with an
    error response executed its request successfully; only the error reaches the client."""
    model = "decoupled_outcomes"
    server, http = _one_model_server(server_factory, tmp_path, model, DECOUPLED_ECHO,
                                     'backend: "python"\nmax_batch_size: 0\nmodel_transaction_policy { decoupled: true }\n'
                                     'input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
                                     'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 2 ] } ]\n')
    try:
        before, metrics = http.stats(model), flat_metrics(server, model)
        answers = _stream_once(server, model, [-1, 1])
        assert len(answers) == 1 and "negative input" in str(answers[0]), answers
        after = http.stats(model)
        assert after["success.count"] == before["success.count"] + 1 and after["fail.count"] == 0, after
        assert metric_deltas(metrics, flat_metrics(server, model)) == {
            "nv_inference_request_success": 1, "nv_inference_count": 1, "nv_inference_exec_count": 1}
        answers = _stream_once(server, model, [3, 4])
        assert answers[0].as_numpy("Y").tolist() == [6, 8]
        assert http.stats(model)["success.count"] == before["success.count"] + 2
    finally:
        http.client.close()


def test_an_execute_that_raised_on_a_stream_counts_its_execution(server_factory, tmp_path):
    """A model that is not decoupled, called on a gRPC stream, whose ``execute`` raises: its
    request fails and its execution counts (batch statistics, exec count), as Triton 2.51 counts it
    and as a unary call counts it."""
    model = "direct_outcomes"
    server, http = _one_model_server(server_factory, tmp_path, model, OUTCOMES_MODEL,
                                     f'name: "{model}"\n' + OUTCOMES_CONFIGS[model])
    try:
        before, metrics = http.stats(model), flat_metrics(server, model)
        answers = _stream_once(server, model, [-999, 1])
        assert len(answers) == 1 and "told to raise" in str(answers[0]), answers
        after = http.stats(model)
        assert count_deltas(before, after) == {"fail.count": 1, "execution_count": 1,
                                               **{f"batch1.{p}.count": 1 for p in BATCH_PHASES}}
        assert metric_deltas(metrics, flat_metrics(server, model)) == {"nv_inference_exec_count": 1, "BACKEND": 1}
    finally:
        http.client.close()


def test_an_ensemble_counts_its_inferences_executions_and_its_steps_compute(server_factory, tmp_path):
    """As Triton's ensemble scheduler counts an ensemble (checked side by side on 2.51): each
    request an execution of its batch size, and the compute phases its steps took, summed (its
    own queue none); in the statistics extension and the metrics. Its steps count as ever."""
    repo = tmp_path / "repo"
    (repo / "step" / "1").mkdir(parents=True)
    (repo / "step" / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 4\n'
                                                'input [ { name: "X" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
                                                'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 2 ] } ]\n')
    (repo / "step" / "1" / "model.py").write_text(OUTCOMES_MODEL)
    (repo / "twice" / "1").mkdir(parents=True)
    (repo / "twice" / "config.pbtxt").write_text(
        'platform: "ensemble"\nmax_batch_size: 4\n'
        'input [ { name: "IN" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
        'output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 2 ] } ]\n'
        'ensemble_scheduling { step [\n'
        '  { model_name: "step" model_version: -1 input_map { key: "X" value: "IN" } output_map { key: "Y" value: "MID" } },\n'
        '  { model_name: "step" model_version: -1 input_map { key: "X" value: "MID" } output_map { key: "Y" value: "OUT" } }\n'
        '] }\n')
    server = server_factory.start([repo])
    http = Outcomes("http", server)
    try:
        before, metrics = http.stats("twice"), flat_metrics(server, "twice")
        for rows in (1, 2, 2):
            t = httpclient.InferInput("IN", [rows, 2], "INT32")
            t.set_data_from_numpy(np.ones((rows, 2), dtype=np.int32))
            assert http.client.infer("twice", [t]).as_numpy("OUT").tolist() == [[4, 4]] * rows
        after = http.stats("twice")
        assert count_deltas(before, after) == {
            "success.count": 3, "inference_count": 5, "execution_count": 3, "queue.count": 3,
            **{f"{p}.count": 3 for p in BATCH_PHASES}, "batch1.compute_input.count": 1,
            "batch1.compute_infer.count": 1, "batch1.compute_output.count": 1,
            **{f"batch2.{p}.count": 2 for p in BATCH_PHASES}}
        step = http.stats("step")
        assert after["compute_infer.ns"] >= step["compute_infer.ns"] > 0  # the two steps' summed
        # each step request counts its queue time and its whole duration, from when the broker
        # sent it (Triton's), not its compute alone
        assert step["queue.count"] == 6 and step["queue.ns"] > 0, step
        assert step["success.ns"] > step["compute_input.ns"] + step["compute_infer.ns"] + step["compute_output.ns"]
        assert metric_deltas(metrics, flat_metrics(server, "twice")) == {
            "nv_inference_request_success": 3, "nv_inference_count": 5, "nv_inference_exec_count": 3}
        text = scrape(server)
        assert sample(text, "nv_inference_compute_infer_duration_us", model="twice", version="1") > 0
    finally:
        http.client.close()


def test_the_metrics_port_takes_tritons_paths_and_refuses_other_methods(stats_server):
    """/metrics with or without its slash (a Prometheus job's metrics_path either way), and a 405
    in JSON for another method, as Triton's metrics service answers."""
    for path in ("/metrics", "/metrics/"):
        with urllib.request.urlopen(f"http://127.0.0.1:{stats_server.metrics_port}{path}", timeout=5) as r:
            assert r.status == 200 and b"nv_inference_request_success" in r.read(), path
    for method in ("POST", "PUT", "DELETE"):
        r = raw_request(stats_server.metrics_port, method, "/metrics", b"")
        assert (r.status, r.json()) == (405, {"error": "Method Not Allowed"}), method


SLEEPER = '''
import time

import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Sleeps X tenths of a second, then answers X."""

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            time.sleep(int(x[0]) / 10)
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
'''


def test_requests_queued_behind_a_long_execution_count_once_as_pending(server_factory, tmp_path):
    """Three requests at once on one lane of a one-instance model that does not batch: the worker
    takes the second and the third off the lane when the first ends and runs them in turn. While
    the second runs (3 s) the third is waiting, taken: pending 1 and 2 in flight, as Triton counts
    them; its client must not take it for a lost lane record and put it again (which counted it
    twice, and warned of another process writing the lanes)."""
    model = tmp_path / "repo" / "sleeper"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'name: "sleeper"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\n')
    (model / "1" / "model.py").write_text(SLEEPER)
    server = server_factory.start([tmp_path / "repo"])
    answered: list[int] = []

    def send(tenths: int) -> None:
        client = httpclient.InferenceServerClient(server.url)
        try:
            t = httpclient.InferInput("X", [1], "INT32")
            t.set_data_from_numpy(np.array([tenths], dtype=np.int32))
            answered.append(int(client.infer("sleeper", [t]).as_numpy("Y")[0]))
        finally:
            client.close()

    def start_when_in_flight(tenths: int, in_flight: int) -> threading.Thread:
        """A request started once ``in_flight`` are: in this order on the lane, on a loaded host too."""
        deadline = time.monotonic() + 60
        while sample(scrape(server), "shmserve_requests_in_flight", model="sleeper") < in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        thread = threading.Thread(target=send, args=(tenths,))
        thread.start()
        return thread

    first = start_when_in_flight(30, 0)
    rest = [start_when_in_flight(30, 1), start_when_in_flight(0, 2)]
    seen = []
    while first.is_alive() or any(t.is_alive() for t in rest):
        text = scrape(server)
        if answered and 30 in answered and len(answered) == 1:  # the first answered, the second running
            seen.append((sample(text, "nv_inference_pending_request_count", model="sleeper"),
                         sample(text, "shmserve_requests_in_flight", model="sleeper")))
        time.sleep(0.1)
    for t in (first, *rest):
        t.join()
    assert sorted(answered) == [0, 30, 30]
    assert len(seen) > 10, seen  # (sampled through the second execution)
    assert max(seen) <= (1, 2), seen
    assert "put again" not in server.log()
