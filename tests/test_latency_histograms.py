"""Latency histograms (``--metrics-config histogram_latencies=true``): Triton's
``nv_inference_first_response_histogram_ms`` with its default buckets and a model's own through
``model_metrics``, shmserve's request, queue and compute histograms and the model load time; summed
over instances, frontend processes and local clients; nothing of them with the flag off."""
from __future__ import annotations

import concurrent.futures
import queue
import shutil
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from conftest import TESTS, raw_request
from shmserve.shm.client import Client

MODELS = TESTS / "models" / "histograms"
PHASES = ("shmserve_inference_request_histogram_ms", "shmserve_inference_queue_histogram_ms",
          "shmserve_inference_compute_input_histogram_ms", "shmserve_inference_compute_infer_histogram_ms",
          "shmserve_inference_compute_output_histogram_ms")
FIRST = "nv_inference_first_response_histogram_ms"
DEFAULT_PHASE_LES = ["0.1", "0.25", "0.5", "1", "2.5", "5", "10", "25", "50", "100", "250", "500", "1000", "2500",
                     "5000", "10000", "+Inf"]


@pytest.fixture(scope="module")
def hist_server(module_factory):
    return module_factory.start([MODELS], ["--http-workers", "2", "--metrics-config", "histogram_latencies=true"])


def families(server) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as r:
        text = r.read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def histogram(fams: dict, name: str, model: str) -> tuple[list[tuple[str, float]], float, float]:
    """(le, cumulative count) in the order served, the count and the sum of one version's histogram,
    checked to be a well-formed Prometheus histogram."""
    fam = fams[name]
    assert fam.type == "histogram", name
    mine = [s for s in fam.samples if s.labels.get("model") == model and s.labels.get("version") == "1"]
    buckets = [(s.labels["le"], s.value) for s in mine if s.name == name + "_bucket"]
    (count,) = [s.value for s in mine if s.name == name + "_count"]
    (total,) = [s.value for s in mine if s.name == name + "_sum"]
    counts = [c for _, c in buckets]
    assert counts == sorted(counts), f"{name}: buckets are not cumulative: {buckets}"
    assert buckets[-1] == ("+Inf", count), f"{name}: +Inf bucket is not the count: {buckets} {count}"
    assert total >= 0
    return buckets, count, total


def value(fams: dict, name: str, model: str) -> float:
    (v,) = [s.value for s in fams[name].samples if s.labels.get("model") == model]
    return v


def timed(url: str, ms: int, model: str = "timed") -> None:
    with httpclient.InferenceServerClient(url) as client:
        t = httpclient.InferInput("X", [1], "INT32")
        t.set_data_from_numpy(np.array([ms], dtype=np.int32))
        assert client.infer(model, [t]).as_numpy("Y").tolist() == [ms]


def test_plain_model_histograms_sum_instances_frontends_and_local_clients(hist_server):
    """12 concurrent HTTP requests (2 frontends, 2 instances) and 3 from a local client, each
    taking 30 ms in the model: every family counts 15, in the default buckets, and agrees with
    Triton's counters."""
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda _: timed(hist_server.url, 30), range(12)))
    with Client(hist_server.id) as local:
        for _ in range(3):
            assert local.infer("timed", {"X": np.array([30], dtype=np.int32)})["Y"].tolist() == [30]
    fams, _ = families(hist_server)
    buckets, count, total = histogram(fams, FIRST, "timed")
    assert [le for le, _ in buckets] == ["100", "500", "2000", "5000", "+Inf"]  # Triton's defaults
    assert count == 15 and total >= 15 * 30
    for name in PHASES:
        buckets, count, _ = histogram(fams, name, "timed")
        assert [le for le, _ in buckets] == DEFAULT_PHASE_LES, name
        assert count == 15, name
    _, count, request_ms = histogram(fams, "shmserve_inference_request_histogram_ms", "timed")
    assert count == value(fams, "nv_inference_request_success", "timed")
    # the same durations as Triton's counter (which truncates each sum to whole microseconds)
    assert abs(request_ms - value(fams, "nv_inference_request_duration_us", "timed") / 1000) < 0.01
    assert request_ms >= 15 * 30
    infer, _, infer_ms = histogram(fams, "shmserve_inference_compute_infer_histogram_ms", "timed")
    assert dict(infer)["25"] == 0 and infer_ms >= 15 * 30  # every execution slept 30 ms
    assert abs(infer_ms - value(fams, "nv_inference_compute_infer_duration_us", "timed") / 1000) < 0.01


def test_decoupled_first_response_comes_before_the_last(hist_server):
    """Two streams of 3 responses 60 ms apart: the first response is counted at about 60 ms, the
    request when its stream ends, at about 180 ms."""
    before = families(hist_server)[0]
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(hist_server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put(error or result))
        for _ in range(2):
            n = grpcclient.InferInput("N", [1], "INT32")
            n.set_data_from_numpy(np.array([3], dtype=np.int32))
            wait = grpcclient.InferInput("WAIT", [1], "INT32")
            wait.set_data_from_numpy(np.array([60], dtype=np.int32))
            client.async_stream_infer("streamer", [n, wait])
            outs = [got.get(timeout=60) for _ in range(3)]
            assert [o.as_numpy("OUT").tolist() for o in outs] == [[0], [1], [2]]
        client.stop_stream()
    fams, _ = families(hist_server)
    assert histogram(before, FIRST, "streamer")[1] == 0
    _, first_count, first_ms = histogram(fams, FIRST, "streamer")
    _, request_count, request_ms = histogram(fams, "shmserve_inference_request_histogram_ms", "streamer")
    assert first_count == 2 and request_count == 2
    assert 2 * 60 <= first_ms < request_ms and request_ms >= 2 * 180
    assert first_ms < request_ms - 2 * 100  # counted at the first response, not at the end
    for name in PHASES[1:]:
        assert histogram(fams, name, "streamer")[1] == 2, name


def test_model_metrics_sets_a_models_buckets(hist_server):
    """model_metrics in config.pbtxt: the first response and compute buckets are the model's
    (Triton's own test bounds included: -1 and 0 count nothing); a family that has no buckets
    to set is warned about, as Triton does, and the model loads."""
    for _ in range(2):
        timed(hist_server.url, 100, "ladder")
    fams, _ = families(hist_server)
    buckets, count, _ = histogram(fams, FIRST, "ladder")
    assert [le for le, _ in buckets] == ["-1", "0", "1", "2.5", "40", "200", "+Inf"]
    assert dict(buckets)["-1"] == dict(buckets)["0"] == dict(buckets)["2.5"] == dict(buckets)["40"] == 0
    assert count == 2
    buckets, _, _ = histogram(fams, "shmserve_inference_compute_infer_histogram_ms", "ladder")
    assert buckets == [("20", 0), ("60", 0), ("+Inf", 2)]
    buckets, _, _ = histogram(fams, "shmserve_inference_request_histogram_ms", "ladder")
    assert [le for le, _ in buckets] == DEFAULT_PHASE_LES  # not set: the default
    warned = [line for line in hist_server.log().splitlines()
              if "model 'ladder': metric family 'nv_gpu_utilization'" in line and "not a customizable" in line]
    assert warned and all(line.startswith("W") for line in warned), warned
    assert "'model_metrics' is not supported" not in hist_server.log()


def test_ensemble_answers_are_counted_by_the_broker(hist_server):
    """An ensemble has no worker of its own: the broker's observations are served, beside its
    step's."""
    before = families(hist_server)[0]
    steps_before = histogram(before, FIRST, "timed")[1]
    for _ in range(2):
        timed(hist_server.url, 30, "pipeline")
    fams, _ = families(hist_server)
    for name in (FIRST, "shmserve_inference_request_histogram_ms"):
        _, count, total = histogram(fams, name, "pipeline")
        assert count == 2 and total >= 2 * 30, name
    assert histogram(fams, FIRST, "timed")[1] == steps_before + 2


def test_garbage_in_a_workers_area_breaks_nothing(hist_server):
    """A lane's client maps the worker's segment and may write its statistics: all ones in every
    histogram word. The worker never reads them back (it keeps answering and counting), and the
    broker serves a well-formed page."""
    import os

    from shmserve.shm.channel import WorkerSegment

    prefix = f"shmserve.{hist_server.id}.worker."
    names = [n for n in os.listdir("/dev/shm") if n.startswith(prefix) and n[len(prefix):].isdigit()]
    assert names
    for name in names:
        seg = WorkerSegment.attach("/" + name)
        try:
            seg.stats.latency[:] = np.iinfo(np.uint64).max
        finally:
            seg.close()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: timed(hist_server.url, 1), range(8)))
    fams, _ = families(hist_server)
    histogram(fams, FIRST, "timed")  # parsed, cumulative, +Inf is the count
    assert value(fams, "nv_inference_request_success", "timed") >= 8


def test_model_load_time_histogram(hist_server):
    fams, _ = families(hist_server)
    for model in ("timed", "streamer", "ladder"):
        buckets, count, seconds = histogram(fams, "shmserve_model_load_histogram_seconds", model)
        assert count == 1 and seconds > 0, model
        assert [le for le, _ in buckets][:2] == ["0.1", "0.25"]


def test_without_the_flag_no_histogram_and_bad_buckets_are_refused(server_factory, tmp_path):
    """Off by default: no histogram family is served. A model whose buckets are not strictly
    increasing does not load, with the reason; the others serve."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "ladder", repo / "ladder")
    shutil.copytree(MODELS / "timed", repo / "unordered")
    config = (repo / "unordered" / "config.pbtxt").read_text().replace('name: "timed"', 'name: "unordered"')
    (repo / "unordered" / "config.pbtxt").write_text(config + 'model_metrics { metric_control [ { metric_identifier '
                                                     '{ family: "nv_inference_first_response_histogram_ms" } '
                                                     'histogram_options { buckets: [ 5, 1 ] } } ] }\n')
    s = server_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])
    timed(s.url, 1, "ladder")
    _, text = families(s)
    assert "_histogram_" not in text
    assert "nv_inference_request_success{" in text
    raw = raw_request(s.port, "POST", "/v2/repository/index", b"{}")
    index = {e["name"]: e for e in raw.json()}
    assert index["ladder"]["state"] == "READY"
    assert index["unordered"]["state"] == "UNAVAILABLE"
    assert "strictly increasing" in index["unordered"]["reason"], index["unordered"]
    assert "nv_inference_first_response_histogram_ms" in index["unordered"]["reason"]
