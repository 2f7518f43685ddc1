"""shmserve-perf against a real server, with short windows: what it writes must agree with the
server's own statistics, or its figures mean nothing."""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import PYTHON, ROOT

from shmserve.tools.perf.cli import build_parser
from shmserve.tools.perf.report import CSV_COLUMNS, STREAM_COLUMNS

PERF = str(Path(PYTHON).parent / "shmserve-perf")
FAST = ["-p", "250", "-r", "3", "-s", "1000"]  # three short windows; no waiting for stability


def success_count(server, model: str) -> tuple[int, int]:
    """(successful requests, inferences) of ``model`` from the server's statistics extension."""
    client = server.client()
    try:
        row = client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()
    return int(row["inference_stats"]["success"]["count"]), int(row["inference_count"])


def perf(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([PERF, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open() as fh:
        rows = list(csv.reader(fh))
    return rows[0], [dict(zip(rows[0], r)) for r in rows[1:]]


def exported_requests(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    return [r for e in doc["experiments"] for r in e["requests"]]


def address(server, protocol: str) -> str:
    return {"http": server.url, "grpc": server.grpc_url, "local": server.id}[protocol]


@pytest.mark.parametrize("protocol,shm", [("http", "none"), ("grpc", "system"), ("local", "system"),
                                          ("http", "system")])
def test_csv_and_profile_export_agree_with_the_servers_statistics(server, tmp_path, protocol, shm):
    out_csv, export = tmp_path / "perf.csv", tmp_path / "export.json"
    before = success_count(server, "add_sub")
    run = perf("-m", "add_sub", "-i", protocol, "-u", address(server, protocol), "--shared-memory", shm,
               "--concurrency-range", "1:2", *FAST, "-f", str(out_csv), "--profile-export-file", str(export), "-q")
    assert run.returncode == 0, run.stderr
    after = success_count(server, "add_sub")
    header, rows = read_csv(out_csv)
    assert header == ["Concurrency", *CSV_COLUMNS]
    assert sorted(int(r["Concurrency"]) for r in rows) == [1, 2]
    throughputs = [float(r["Inferences/Second"]) for r in rows]
    assert throughputs == sorted(throughputs) and throughputs[0] > 0  # perf_analyzer's order
    for r in rows:
        assert int(r["p50 latency"]) <= int(r["p90 latency"]) <= int(r["p95 latency"]) <= int(r["p99 latency"]), r
        assert int(r["Server Compute Infer"]) > 0, r  # from the statistics extension
    doc = json.loads(export.read_text())
    assert [e["experiment"] for e in doc["experiments"]] == [{"mode": "concurrency", "value": 1},
                                                             {"mode": "concurrency", "value": 2}]
    sent = exported_requests(export)
    # Every request the tool sent is in the export, and the server counted exactly those.
    assert len(sent) == after[0] - before[0] and after[1] - before[1] == len(sent)
    for e in doc["experiments"]:
        edges = e["window_boundaries"]
        assert edges == sorted(edges) and len(edges) >= 2
        for r in e["requests"]:
            assert len(r["response_timestamps"]) == 1 and r["response_timestamps"][0] > r["timestamp"]
    assert "Successful request count:" in run.stdout and "Concurrency: 2, throughput:" in run.stdout
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("shmperf_")]
    client = server.client()
    try:
        assert client.get_system_shared_memory_status() == [], "the tool's regions are still registered"
    finally:
        client.close()


def test_open_loop_request_rate(server, tmp_path):
    out_csv, export = tmp_path / "rate.csv", tmp_path / "rate.json"
    before = success_count(server, "add_sub")
    run = perf("-m", "add_sub", "-u", server.url, "--request-rate-range", "40:80:40", "--request-distribution",
               "poisson", "--max-threads", "4", *FAST, "-f", str(out_csv), "--profile-export-file", str(export))
    assert run.returncode == 0, run.stderr
    assert success_count(server, "add_sub")[0] - before[0] == len(exported_requests(export))
    header, rows = read_csv(out_csv)
    assert header[0] == "Request Rate" and sorted(float(r["Request Rate"]) for r in rows) == [40, 80]
    assert [e["experiment"]["mode"] for e in json.loads(export.read_text())["experiments"]] == ["request_rate"] * 2
    assert "Request Rate: 40 inference requests per seconds" in run.stdout
    assert "window" in run.stderr  # the progress line (not with -q)


def test_sequences_get_ids_and_each_one_ends(server, tmp_path):
    export = tmp_path / "seq.json"
    before = success_count(server, "running_sum")
    run = perf("-m", "running_sum", "-i", "grpc", "-u", server.grpc_url, "--sequence-length", "4",
               "--concurrency-range", "2", *FAST, "--profile-export-file", str(export), "-q")
    assert run.returncode == 0, run.stderr
    sent = exported_requests(export)
    assert success_count(server, "running_sum")[0] - before[0] == len(sent)
    by_id: dict[int, int] = {}
    for r in sent:
        by_id[r["sequence_id"]] = by_id.get(r["sequence_id"], 0) + 1
    assert 0 not in by_id and len(by_id) >= 2
    assert max(by_id.values()) <= 5  # 4 give or take 20%


@pytest.mark.parametrize("protocol", ["grpc", "local"])
def test_a_decoupled_model_streams_and_each_response_is_timed(server, tmp_path, protocol):
    data, out_csv, export = tmp_path / "words.json", tmp_path / "words.csv", tmp_path / "words-export.json"
    data.write_text(json.dumps({"data": [{"text_input": ["one two three four"]}, {"text_input": ["a b"]}]}))
    before = phase_counts(server, "word_stream")
    run = perf("-m", "word_stream", "-i", protocol, "-u", address(server, protocol), "--input-data", str(data),
               *FAST, "-f", str(out_csv), "--profile-export-file", str(export), "-q")
    assert run.returncode == 0, run.stderr
    header, rows = read_csv(out_csv)
    assert header[-3:] == STREAM_COLUMNS
    assert float(rows[0]["Avg Time To First Response"]) > 0 and float(rows[0]["Avg Time Between Responses"]) > 0
    counts = {len(r["response_timestamps"]) for r in exported_requests(export)}
    assert counts == {2, 4}, counts  # a response per word
    assert "Avg time to first response:" in run.stdout
    # The server's queue and compute of each streamed request (the execution that started it), so
    # that the rest of its time reads as streaming, not as overhead.
    after = phase_counts(server, "word_stream")
    grown = {phase: after[phase] - before[phase] for phase in after}
    assert grown["success"] > 0 and set(grown.values()) == {grown["success"]}, grown
    assert int(rows[0]["Server Queue"]) > 0 and int(rows[0]["Server Compute Infer"]) > 0, rows[0]
    assert "streaming after execute returned" in run.stdout and "(overhead" not in run.stdout, run.stdout


def test_the_stream_bench_model_streams_the_shape_its_input_file_asks_for(server_factory, tmp_path):
    """docs/performance.md's recipe for the stream figures: tools/stream_models.py writes chatter
    and an input file per shape, and shmserve-perf times each whole stream over gRPC."""
    written = subprocess.run([PYTHON, "-m", "shmserve.tools.stream_models", str(tmp_path), "--shape", "7x100"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert written.returncode == 0, written.stderr
    assert written.stdout.split() == [str(tmp_path / "7x100.json"), str(tmp_path / "repo")]
    server = server_factory.start([tmp_path / "repo"])
    export = tmp_path / "export.json"
    run = perf("-m", "chatter", "-i", "grpc", "-u", server.grpc_url, "--input-data", str(tmp_path / "7x100.json"),
               *FAST, "--profile-export-file", str(export), "-q")
    assert run.returncode == 0, run.stderr
    assert {len(r["response_timestamps"]) for r in exported_requests(export)} == {7}


def phase_counts(server, model: str) -> dict[str, int]:
    """How many requests each phase of the statistics extension counts."""
    client = server.client()
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]["inference_stats"]
    finally:
        client.close()
    return {phase: int(stats[phase]["count"])
            for phase in ("success", "queue", "compute_input", "compute_infer", "compute_output")}


def test_what_cannot_work_is_refused_with_the_reason(server):
    run = perf("-m", "word_stream", "-u", server.url)
    assert run.returncode == 2 and "decoupled (streaming): measure it with -i grpc or -i local" in run.stderr
    run = perf("-m", "add_sub", "-u", server.url, "-b", "2")
    assert run.returncode == 2 and "-b 2: the model takes batches of 1 to 1" in run.stderr
    run = perf("-m", "add_sub", "-u", server.url, "--concurrency-range", "4:2")
    assert run.returncode == 2 and "bad range '4:2'" in run.stderr
    run = perf("-m", "no_such_model", "-u", server.url)
    assert run.returncode == 2 and "no_such_model" in run.stderr
    run = perf("-m", "add_sub", "-i", "local", "-u", server.id, "--shared-memory", "cuda")
    assert run.returncode == 2 and "--shared-memory cuda is for http and grpc" in run.stderr


def test_cuda_shared_memory_needs_a_gpu(server):
    """Here (no GPU) the answer is a clear refusal; on a GPU machine, a run."""
    from shmserve.tools.perf.shm_regions import cuda_available

    run = perf("-m", "add_sub", "-u", server.url, "--shared-memory", "cuda", *FAST, "-q")
    if cuda_available() is None:
        assert run.returncode == 0, run.stderr
    else:
        assert run.returncode == 2 and "--shared-memory cuda needs a CUDA GPU on this machine" in run.stderr


def test_help_explains_every_flag():
    parser = build_parser()
    text = subprocess.run([PERF, "--help"], capture_output=True, text=True, timeout=60).stdout
    for action in parser._actions:
        if action.option_strings:
            assert action.help, action.option_strings
            assert all(opt in text for opt in action.option_strings), action.option_strings


def test_plots_of_one_server_and_of_two_compared(server, tmp_path):
    from PIL import Image

    png, html, both = tmp_path / "sweep.png", tmp_path / "sweep.html", tmp_path / "both.html"
    run = perf("-m", "add_sub", "-u", server.url, "--concurrency-range", "1:2", *FAST, "--plot", str(png), "-q")
    assert run.returncode == 0, run.stderr
    with Image.open(png) as image:
        assert image.format == "PNG" and image.size[0] > 300
        image.verify()
    run = perf("-m", "add_sub", "-u", server.url, "--concurrency-range", "1:2", *FAST, "--plot", str(html), "-q")
    assert run.returncode == 0, run.stderr
    text = html.read_text()
    assert text.lstrip().lower().startswith("<!doctype html>") and text.rstrip().endswith("</html>")
    assert "Plotly.newPlot" in text  # the figure, drawn by plotly.js inside the file
    assert '"name":"127.0.0.1' in text and "p99" in text
    # --compare: both servers' curves on one figure
    run = perf("-m", "add_sub", "-u", server.url, "--name", "http", "--compare", f"local=local:{server.id}",
               "--pairs", "1", "-p", "200", "--plot", str(both), "-q")
    assert run.returncode == 0, run.stderr
    text = both.read_text()
    assert '"name":"http p50"' in text and '"name":"local p50"' in text


def test_each_curve_joins_its_points_in_concurrency_order(server, tmp_path):
    """Levels measured out of order (2, 3, then 1) are drawn 1, 2, 3: a line joins a curve's
    points by concurrency, never by throughput, so it turns back only where throughput fell."""
    import re

    html, summary = tmp_path / "order.html", tmp_path / "order.json"
    run = perf("-m", "add_sub", "-u", server.url, "--concurrency-range", "2,3,1", *FAST, "--plot", str(html),
               "--summary-json", str(summary), "-q")
    assert run.returncode == 0, run.stderr
    measured = [lv["level"] for lv in json.loads(summary.read_text())["levels"]]
    assert measured == [2, 3, 1], measured
    drawn = re.findall(r'"text":\[([^\]]*)\]', html.read_text())
    assert drawn and set(drawn) == {'"concurrency 1","concurrency 2","concurrency 3"'}, drawn
    # The points of the curve, from the same run's figures, in that order.
    by_level = {lv["level"]: lv["throughput"] for lv in json.loads(summary.read_text())["levels"]}
    xs = json.loads("[" + re.search(r'"x":\[([^\]]*)\]', html.read_text()).group(1) + "]")
    assert xs == pytest.approx([by_level[1], by_level[2], by_level[3]]), (xs, by_level)


def test_a_plot_that_cannot_be_drawn_is_refused_before_measuring(server, tmp_path):
    run = perf("-m", "add_sub", "-u", server.url, "--plot", str(tmp_path / "plot.svg"))
    assert run.returncode == 2 and "must end in .png or .html" in run.stderr
    assert not (tmp_path / "plot.svg").exists()


# -- shmserve-analyzer -----------------------------------------------------------------------------

ANALYZER = str(Path(PYTHON).parent / "shmserve-analyzer")

TINY_MLP_CONFIG = """name: "tiny_mlp"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

TINY_MLP = '''import time

import numpy as np
import triton_python_backend_utils as pb_utils

W = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.004)  # a fixed cost per execution, as a kernel launch has: a batch shares it
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", np.maximum(x @ W, 0))]))
        return responses
'''


def tiny_mlp(root: Path) -> Path:
    """A small MLP that batches (max_batch_size 8) but, as written, has no dynamic batcher."""
    (root / "tiny_mlp" / "1").mkdir(parents=True)
    (root / "tiny_mlp" / "config.pbtxt").write_text(TINY_MLP_CONFIG)
    (root / "tiny_mlp" / "1" / "model.py").write_text(TINY_MLP)
    return root


def test_the_analyzer_finds_a_better_config_and_writes_one_that_loads(server_factory, tmp_path):
    repo, out = tiny_mlp(tmp_path / "repo"), tmp_path / "report"
    before = (repo / "tiny_mlp" / "config.pbtxt").read_text()
    run = subprocess.run(
        [ANALYZER, "--model-repository", str(repo), "-m", "tiny_mlp", "--run-config-search-mode", "brute",
         "--run-config-search-max-instance-count", "1", "--run-config-search-min-model-batch-size", "8",
         "--run-config-search-max-model-batch-size", "8", "--run-config-search-max-preferred-batch-size", "1",
         "--queue-delays", "0", "--run-config-search-max-concurrency", "8", "-p", "300", "-r", "3",
         "--perf-args", "-s 1000", "-e", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (repo / "tiny_mlp" / "config.pbtxt").read_text() == before  # the user's repository is untouched
    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    best = {r["config"]: float(r["inferences_per_second"]) for r in rows if r["chosen"] == "yes"}
    default = max(float(r["inferences_per_second"]) for r in rows if r["config"] == "default")
    assert list(best) == ["instances1_batch8_delay0us"], rows
    assert best["instances1_batch8_delay0us"] > default  # the dynamic batcher shares the 4 ms per execution
    assert {r["concurrency"] for r in rows} == {"1", "2", "4", "8"}
    assert all(float(r["memory_mb"]) > 0 for r in rows)
    lines = run.stdout.splitlines()
    assert lines[lines.index(next(x for x in lines if x.startswith("Top 2 of 2"))) + 1].startswith(
        "1. instances1_batch8_delay0us: ")
    report_html = (out / "report.html").read_text()
    assert report_html.startswith("<!doctype html>") and report_html.count("Plotly.newPlot") == 2
    assert "instances1_batch8_delay0us (chosen)" in report_html
    assert (out / "logs" / "default.log").is_file()
    # The config it wrote loads, with the dynamic batcher on.
    (repo / "tiny_mlp" / "config.pbtxt").write_text((out / "config.pbtxt").read_text())
    served = server_factory.start([repo])
    client = served.client()
    try:
        assert client.is_model_ready("tiny_mlp")
        assert "dynamic_batching" in client.get_model_config("tiny_mlp")
    finally:
        client.close()


def test_the_quick_search_climbs_to_the_best_neighbour():
    from shmserve.tools.analyzer.space import Bounds, Candidate, brute, quick

    bounds = Bounds(instances=(1, 2, 3), batch_sizes=(1, 2, 4, 8), delays_us=(0, 500), max_preferred=1)
    assert len(list(brute(bounds))) == 3 * 4 * 2
    tried: list[Candidate] = []

    def landscape(c: Candidate) -> float:  # best at 2 instances, batch 4, delay 500
        return -abs(c.instances - 2) - abs(c.max_batch_size - 4) - (0 if c.queue_delay_us == 500 else 1)

    def score(c: Candidate) -> float:
        tried.append(c)
        return landscape(c)

    quick(bounds, score)
    assert max(tried, key=landscape) == Candidate(2, 4, (), 500)
    assert len(tried) < len(list(brute(bounds)))  # it did not try everything


def test_the_analyzer_says_what_it_needs(tmp_path):
    repo = tiny_mlp(tmp_path / "repo")
    run = subprocess.run([ANALYZER, "--model-repository", str(repo), "-m", "tiny_mlp", "--triton"],
                         capture_output=True, text=True, timeout=60)
    if shutil.which("tritonserver") is None:
        assert run.returncode == 2 and "tritonserver, and there is none on PATH" in run.stderr
    run = subprocess.run([ANALYZER, "--model-repository", str(repo), "-m", "missing"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "has no config.pbtxt" in run.stderr
    text = subprocess.run([ANALYZER, "--help"], capture_output=True, text=True, timeout=60).stdout
    from shmserve.tools.analyzer.cli import build_parser as analyzer_parser

    for action in analyzer_parser()._actions:
        if action.option_strings:
            assert action.help and all(opt in text for opt in action.option_strings), action.option_strings


def test_input_data_in_perf_analyzers_json_format(tmp_path):
    """Flat lists, base64 (little-endian) and content with a shape; a stream per sequence; -b
    repeats each entry along the batch."""
    import base64

    import numpy as np

    from shmserve.tools.perf.inputs import from_json
    from shmserve.tools.perf.plan import TensorSpec

    specs = (TensorSpec("A", "INT32", (2, 4)), TensorSpec("B", "FP32", (2, 4)), TensorSpec("S", "BYTES", (2, 1)))
    path = tmp_path / "data.json"
    raw = base64.b64encode(np.array([1, 2, 3, 4], dtype="<f4").tobytes()).decode()
    path.write_text(json.dumps({"data": [
        [{"A": [1, 2, 3, 4], "B": {"b64": raw}, "S": ["x"]},
         {"A": {"content": [5, 6, 7, 8], "shape": [4]}, "B": [0, 0, 0, 0], "S": ["y z"]}],
        [{"A": [9, 9, 9, 9], "B": [1, 1, 1, 1], "S": ["w"]}]]}))
    streams = from_json(path, specs, batch=2, batched=True)
    assert [len(s) for s in streams] == [2, 1]
    first, second = streams[0]
    assert first["A"].shape == (2, 4) and (first["A"][1] == [1, 2, 3, 4]).all() and first["A"].dtype == np.int32
    assert (first["B"][0] == [1, 2, 3, 4]).all() and first["B"].dtype == np.float32
    assert second["S"].tolist() == [[b"y z"], [b"y z"]]
    path.write_text(json.dumps({"data": [{"A": [1, 2, 3], "B": [0, 0, 0, 0], "S": ["x"]}]}))
    with pytest.raises(ValueError, match="input A: 3 values where shape \\[4\\] needs 4"):
        from_json(path, specs, batch=2, batched=True)
