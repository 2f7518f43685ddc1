"""The benchmark tools against a real server: they must measure what they say, or the README's
figures mean nothing."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import tritonclient.http as httpclient
from conftest import PYTHON, ROOT, CpuHogs

from shmserve.tools import proc_cpu
from shmserve.tools.harness import cmdline, descendants, free_port

PERF = str(Path(PYTHON).parent / "shmserve-perf")


def compared(out: Path) -> dict:
    """The first level of --compare's summary: its slices, ratios and costs."""
    return json.loads(out.read_text())["compare"]["levels"][0]


def add_sub_request() -> tuple[list, list]:
    inputs = [httpclient.InferInput(name, [16], "INT32") for name in ("INPUT0", "INPUT1")]
    for t in inputs:
        t.set_data_from_numpy(np.arange(16, dtype=np.int32))
    return inputs, [httpclient.InferRequestedOutput("OUTPUT0")]


def test_compare_alternates_servers_and_reports_ratios(server, tmp_path):
    out = tmp_path / "paired.json"
    run = subprocess.run(
        [PERF, "-m", "add_sub", "--concurrency-range", "2", "--pairs", "2", "-p", "300", "--warmup", "50",
         "-u", server.url, "--name", "http", "--compare", f"local=local:{server.id}", "--summary-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    result = compared(out)
    # A B B A: the order alternates so that a drifting host weighs on both alike.
    assert [s["target"] for s in result["slices"]] == ["http", "local", "local", "http"]
    for s in result["slices"]:
        assert s["rps"] > 0 and s["p50_us"] > 0 and s["p99_us"] >= s["p50_us"], s
        assert s["client_cpu_us"] > 0, s  # a closed loop of calls costs its process CPU
        assert 0 <= s["idle"] <= 1, s
        # The HTTP target's processes are found by its port and are busy while it serves; a
        # local target has no port to find them by, and says nothing rather than a wrong figure.
        assert (s["server_cpu_us"] > 0) if s["target"] == "http" else ("server_cpu_us" not in s), s
        if proc_cpu.WAITS_KNOWN:  # the kernel keeps schedstat: waits for a core are read too
            assert s["client_wait_us"] >= 0, s
            assert (s["server_wait_us"] >= 0) if s["target"] == "http" else ("server_wait_us" not in s), s
        else:
            assert "client_wait_us" not in s and "server_wait_us" not in s, s
    costs = result["costs"]
    assert costs["http"]["server_cpu_us"] > 0 and costs["local"]["server_cpu_us"] is None, costs
    assert "http per request (medians of its slices): a client" in run.stdout
    summary = result["vs_baseline"]["local"]
    assert summary["pairs"] == 2
    assert math.isfinite(summary["rps_ratio_median"]) and summary["rps_ratio_median"] > 0
    assert summary["rps_ratio_min"] <= summary["rps_ratio_median"] <= summary["rps_ratio_max"]
    assert "local / http: throughput" in run.stdout


def test_the_server_tree_is_found_by_its_port(server):
    """The launcher holds the listening socket: the tree is it and all it started (broker,
    workers, frontends), and nothing listens on a free port."""
    tree = proc_cpu.server_tree(server.port)
    assert server.pid in tree
    titles = [cmdline(p) for p in tree]
    assert any(t.startswith(f"shmserve broker {server.id}") for t in titles), titles
    assert any(t.startswith("shmserve worker add_sub") for t in titles), titles
    assert any(t.startswith(f"shmserve frontend {server.id}") for t in titles), titles
    assert os.getpid() not in tree
    before = proc_cpu.usage(tree)
    client = server.client()
    inputs, outputs = add_sub_request()
    for _ in range(300):  # enough CPU to show in clock ticks, the unit /proc/<pid>/stat counts in
        client.infer("add_sub", inputs, outputs=outputs)
    client.close()
    spent = proc_cpu.usage(tree) - before
    assert spent.cpu_us > 0 and spent.voluntary + spent.involuntary > 0, spent
    assert proc_cpu.server_tree(free_port()) == []


def test_the_grpc_port_finds_the_whole_server_tree(server):
    """The gRPC process binds its own port below the launcher: by that port the tree is still
    the launcher's, broker and workers included, so its CPU per request is the server's."""
    tree = proc_cpu.server_tree(server.grpc_port)
    assert tree == proc_cpu.server_tree(server.port)
    titles = [cmdline(p) for p in tree]
    assert server.pid in tree
    assert any(t.startswith(f"shmserve grpc {server.id}") for t in titles), titles
    assert any(t.startswith(f"shmserve broker {server.id}") for t in titles), titles


def test_compare_measures_grpc_servers(server, tmp_path):
    out = tmp_path / "paired-grpc.json"
    run = subprocess.run(
        [PERF, "-m", "add_sub", "--pairs", "1", "-p", "300", "--warmup", "50", "-u", server.url, "--name", "http",
         "--compare", f"grpc=grpc:{server.grpc_url}", "--summary-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    result = compared(out)
    assert [s["target"] for s in result["slices"]] == ["http", "grpc"]
    for s in result["slices"]:
        assert s["rps"] > 0 and s["p50_us"] > 0, s
        assert s["server_cpu_us"] > 0, s  # found by the gRPC port too
    assert result["costs"]["grpc"]["server_cpu_us"] > 0
    assert "grpc / http: throughput" in run.stdout


@contextmanager
def floor_server(module: str, client_module: Any) -> Iterator[tuple[str, Any]]:
    """A floor (tools/<module>.py) on a free port once it answers ready: (address, a client)."""
    address = f"127.0.0.1:{free_port()}"
    floor = subprocess.Popen([PYTHON, "-m", f"shmserve.tools.{module}", "--port", address.rsplit(":", 1)[1]], cwd=ROOT)
    try:
        with client_module.InferenceServerClient(address) as c:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if c.is_server_ready():
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    if time.monotonic() > deadline:
                        raise
                time.sleep(0.1)
            yield address, c
    finally:
        floor.terminate()
        floor.wait(10)


def priced_beside(server_address: str, floor_address: str, tmp_path: Path, *protocol: str) -> None:
    """shmserve-perf --compare measures the floor beside the server and finds both servers' CPU."""
    out = tmp_path / "paired-floor.json"
    run = subprocess.run(
        [PERF, "-m", "add_sub", "--pairs", "1", "-p", "300", "--warmup", "50", *protocol, "-u", server_address,
         "--name", "shmserve", "--compare", f"floor={floor_address}", "--summary-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    costs = compared(out)["costs"]
    assert costs["floor"]["server_cpu_us"] > 0 and costs["shmserve"]["server_cpu_us"] > 0


def test_grpc_floor_echoes_and_is_measured_beside_the_server(server, tmp_path):
    """The floor answers tritonclient's add_sub call with its inputs, and --compare prices it."""
    import tritonclient.grpc as grpcclient

    with floor_server("grpc_floor", grpcclient) as (address, c):
        a = np.arange(16, dtype=np.int32)
        inputs = [grpcclient.InferInput(n, [16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(a * 2)
        result = c.infer("add_sub", inputs)
        assert (result.as_numpy("OUTPUT0") == a).all() and (result.as_numpy("OUTPUT1") == a * 2).all()
        priced_beside(server.grpc_url, f"grpc:{address}", tmp_path, "-i", "grpc")


def test_http_floor_echoes_and_is_measured_beside_the_server(server, tmp_path):
    """The uvicorn floor answers tritonclient's add_sub call with its inputs (binary and JSON
    alike), refuses what it does not serve, and --compare prices it."""
    with floor_server("http_floor", httpclient) as (address, c):
        a = np.arange(16, dtype=np.int32)
        inputs = [httpclient.InferInput(n, [16], "INT32") for n in ("INPUT0", "INPUT1")]
        inputs[0].set_data_from_numpy(a, binary_data=False)
        inputs[1].set_data_from_numpy(a * 2)
        outputs = [httpclient.InferRequestedOutput(n) for n in ("SUM", "DIFF")]
        result = c.infer("add_sub", inputs, outputs=outputs)
        assert (result.as_numpy("SUM") == a).all() and (result.as_numpy("DIFF") == a * 2).all()
        with pytest.raises(Exception, match="not found"):
            c.get_model_metadata("add_sub")
        priced_beside(server.url, address, tmp_path)


def test_proc_cpu_splits_a_servers_cost_per_request_by_process(server):
    """Under a load, each process of the server that ran has its row; the worker and the frontend
    that served it cost something a request, and the rows add up to the whole."""
    import threading

    stop = threading.Event()

    def load() -> None:
        with server.client() as c:
            inputs, outputs = add_sub_request()
            while not stop.is_set():
                c.infer("add_sub", inputs, outputs=outputs)

    thread = threading.Thread(target=load)
    thread.start()
    try:
        run = subprocess.run([PYTHON, "-m", "shmserve.tools.proc_cpu", "--port", str(server.port), "--model",
                              "add_sub", "--seconds", "1.5"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    finally:
        stop.set()
        thread.join(30)
    assert run.returncode == 0, run.stderr
    rows = {}
    for line in run.stdout.splitlines()[2:]:
        name, cpu = line[:48].strip(), float(line[48:].split()[0])
        rows[name] = cpu
    worker = [cpu for name, cpu in rows.items() if name.startswith("shmserve worker add_sub")]
    frontend = [cpu for name, cpu in rows.items() if name.startswith("shmserve frontend")]
    assert worker and worker[0] > 0 and frontend and frontend[0] > 0, run.stdout
    parts = sum(cpu for name, cpu in rows.items() if name != "whole server")
    assert abs(parts - rows["whole server"]) <= 0.1 * len(rows), run.stdout
    idle = subprocess.run([PYTHON, "-m", "shmserve.tools.proc_cpu", "--port", str(server.port), "--model",
                           "add_sub", "--seconds", "0.3"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert idle.returncode != 0 and "served no request" in idle.stderr


def test_waits_for_a_core_are_read_from_schedstat():
    """Two processes that never block, pinned to one core, each wait for it about half the time."""
    assert proc_cpu.WAITS_KNOWN == os.path.exists(f"/proc/{os.getpid()}/schedstat")
    if not proc_cpu.WAITS_KNOWN:
        pytest.fail("this kernel keeps no schedstat; the waits for a core cannot be checked here")
    with CpuHogs(2, limit_s=10.0, core=min(os.sched_getaffinity(0))) as hogs:
        pids = [h.pid for h in hogs.procs]
        before, started = proc_cpu.usage(pids), time.monotonic()
        time.sleep(0.5)
        spent, elapsed_us = proc_cpu.usage(pids) - before, (time.monotonic() - started) * 1e6
    # One core for two: together they ran at most the elapsed time and waited about as long.
    assert spent.cpu_us <= elapsed_us * 1.2, (spent, elapsed_us)
    assert spent.waited_us >= elapsed_us * 0.5, (spent, elapsed_us)


def test_compare_refuses_bad_servers():
    run = subprocess.run([PERF, "-m", "add_sub", "-u", "127.0.0.1:1", "--compare", "nameless"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "bad server 'nameless'" in run.stderr
    run = subprocess.run([PERF, "-m", "add_sub", "-u", "127.0.0.1:1", "--compare", "127.0.0.1:1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "every server needs its own name" in run.stderr
    run = subprocess.run([PERF, "-m", "add_sub", "--shared-memory", "system", "-u", "127.0.0.1:1",
                          "--compare", "b=grpc:127.0.0.1:2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--compare with --shared-memory system is for http and local servers" in run.stderr


def test_a_run_stopped_by_sigterm_takes_its_client_processes_along(server):
    """`timeout` stops a run with SIGTERM: its client processes go too."""
    run = subprocess.Popen([PERF, "-m", "add_sub", "--concurrency-range", "2", "--pairs", "50", "-p", "500",
                            "-u", server.url, "--name", "a", "--compare", f"b={server.url}", "-q"],
                           cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 120
        clients: list[int] = []
        while len(clients) < 2 and time.monotonic() < deadline:
            clients = [pid for pid in descendants(run.pid) if "spawn_main" in cmdline(pid)]
            time.sleep(0.1)
        assert len(clients) == 2, clients
        time.sleep(1.0)  # the clients are up and measuring
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    deadline = time.monotonic() + 60  # (a loaded host may take its time to reap them)
    while any(os.path.exists(f"/proc/{pid}") for pid in clients) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in clients if os.path.exists(f"/proc/{pid}")]


def test_compare_stops_with_an_error_when_a_server_is_gone(server):
    run = subprocess.run([PERF, "-m", "add_sub", "--pairs", "1", "-p", "100", "-i", "local", "-u", server.id,
                          "--name", "up", "--compare", "gone=local:no_such_server", "-q"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "no shmserve server with id 'no_such_server'" in run.stderr


def test_a_port_nobody_listens_on_is_named_in_the_error():
    """A newcomer's wrong -u: the one line names where it tried, not only 'Connection refused'."""
    port = free_port()
    run = subprocess.run([PERF, "-m", "add_sub", "-u", f"127.0.0.1:{port}", "-p", "100", "-q"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run
    assert run.stderr.startswith(f"error: cannot reach http:127.0.0.1:{port}: "), run.stderr
    assert "Traceback" not in run.stderr, run.stderr


def test_the_cache_benchmark_serving_md_names_runs():
    """`python -m shmserve.tools.bench_cache micro` (serving.md's cost figures) measures every
    case, and leaves nothing in /dev/shm."""
    run = subprocess.run([PYTHON, "-m", "shmserve.tools.bench_cache", "micro", "--iterations", "200"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["case"] for r in rows] == ["add_sub", "1MiB"], run.stdout
    assert all(r["miss_adds_us"] > 0 and r["hit_costs_us"] > 0 for r in rows), rows
    assert not [n for n in os.listdir("/dev/shm") if "benchcache" in n]


def test_compare_through_shared_memory_regions_leaves_none_behind(server, tmp_path):
    """--shared-memory system: HTTP servers get tritonclient's registered regions, the local client
    a region of its own; every region is gone afterwards."""
    out = tmp_path / "paired-shm.json"
    run = subprocess.run(
        [PERF, "-m", "add_sub", "--pairs", "1", "-p", "300", "--warmup", "50", "--shared-memory", "system",
         "-u", server.url, "--name", "http", "--compare", f"local=local:{server.id}", "--summary-json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    assert json.loads(out.read_text())["shared_memory"] == "system"
    result = compared(out)
    assert all(s["rps"] > 0 for s in result["slices"]), result["slices"]
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith("shmperf_")]
    assert not leftovers, leftovers
    client = server.client()
    assert client.get_system_shared_memory_status() == [], "the tool's regions are still registered"
    client.close()


def test_the_side_by_side_bench_measures_every_shmserve_path_on_the_cpu(tmp_path):
    """tools/bench_gpu_triton.py's shmserve part, as gpu_run.sh's dry run runs it: a row per backend
    and path with its rate, batch formed and server CPU, the HTTP/local ratios, the markdown table,
    and nothing left in /dev/shm."""
    out = tmp_path / "side-by-side.json"
    run = finished([PYTHON, "-m", "shmserve.tools.bench_gpu_triton", "--device", "cpu", "--model", "small",
                    "--servers", "shmserve-python", "shmserve-torchscript", "--instances", "1",
                    "--seconds", "1", "--warmup", "0.5", "--floor-seconds", "0.5", "--clients", "2",
                    "--json", str(out)], tmp_path)
    doc = json.loads(out.read_text())
    rows = {(r["backend"], r["path"]): r for r in doc["rows"]}
    assert set(rows) == {(b, p) for b in ("python", "torchscript") for p in ("http", "grpc", "local")}
    for row in rows.values():
        assert row["server"] == "shmserve" and row["instances"] == 1 and row["errors"] == 0
        assert row["throughput_rps"] > 0 and row["avg_batch"] >= 1 and row["server_cpu_us_per_inference"] > 0
    assert {r["backend"] for r in doc["http_over_local"]} == {"python", "torchscript"}
    assert [f["batch"] for f in doc["floor"]][0] == 1
    assert "| 1 | shmserve | python | http |" in run.stdout and "HTTP / local" in run.stdout


def test_the_side_by_side_models_answer_alike_on_both_backends(tmp_path):
    """The Python-backend model.py and the TorchScript file are the same net: one input, one answer."""
    import argparse

    from shmserve.tools import bench_gpu, bench_gpu_triton
    from shmserve.tools.harness import ServerProcess

    args = argparse.Namespace(model="small", device="cpu", instances=1, queue_delay_us=100)
    py_model = bench_gpu_triton.write_python_repository(tmp_path / "py", args, 1)
    ts_model, _ = bench_gpu.write_repository(tmp_path / "ts", args)
    server = ServerProcess([tmp_path / "py", tmp_path / "ts"])
    try:
        bench_gpu.wait_model_ready(server, py_model)
        bench_gpu.wait_model_ready(server, ts_model)
        x = np.random.default_rng(1).random((2, *bench_gpu.SHAPE), dtype=np.float32)
        answers = []
        with httpclient.InferenceServerClient(server.url) as client:
            for model in (py_model, ts_model):
                inp = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
                inp.set_data_from_numpy(x)
                answers.append(client.infer(model, [inp]).as_numpy("OUTPUT__0"))
        assert answers[0].shape == (2, bench_gpu.CLASSES)
        np.testing.assert_allclose(answers[0], answers[1], rtol=1e-4, atol=1e-5)
    finally:
        server.stop()


def test_the_cudashm_bench_rehearses_on_the_cpu():
    """tools/bench_cudashm.py --device cpu: the same models (KIND_CPU) answer the identity with the
    tensor in the body; one row per model, nothing left behind."""
    run = finished([PYTHON, "-m", "shmserve.tools.bench_cudashm", "--device", "cpu", "--mib", "1",
                    "--servers", "shmserve"], ROOT)
    rows = json.loads(run.stdout)["identity_through_cuda_shm"]
    assert [(r["server"], r["model"], r["output_equals_input"]) for r in rows] == [
        ("shmserve", m, True) for m in ("host_path", "device_path", "torchscript")]


def finished(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """A tool run to its end with exit 0, and nothing left in /dev/shm by the servers it started
    (tools.harness names them ``tool<its pid>``)."""
    tool = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = tool.communicate(timeout=400)
    finally:
        if tool.poll() is None:
            tool.kill()
            tool.wait()
    assert tool.returncode == 0, err[-3000:]
    stem = f"shmserve.tool{tool.pid}."
    assert not [n for n in os.listdir("/dev/shm") if n.startswith((stem, "sem." + stem))]
    return subprocess.CompletedProcess(command, tool.returncode, out, err)


def test_a_tools_server_takes_a_repository_relative_to_the_callers_folder(tmp_path, monkeypatch):
    """tools.harness runs its servers in the package's folder (on the GPU machine, an installed
    copy): a repository named relative to the caller's folder must still be found there."""
    import shutil

    from shmserve.tools.harness import ServerProcess

    shutil.copytree(ROOT / "model_repository" / "add_sub", tmp_path / "repo" / "add_sub")
    monkeypatch.chdir(tmp_path)
    server = ServerProcess(["repo"])
    try:
        with httpclient.InferenceServerClient(server.url) as client:
            assert client.is_model_ready("add_sub")
    finally:
        server.stop()


def test_the_soak_drives_every_kind_of_client_through_reloads_and_kills():
    """`python -m shmserve.tools.soak` (performance.md's long run), shortened: every kind of client
    served throughout a reload and a worker kill, each lasting process's RSS reported, nothing left."""
    command = [PYTHON, "-m", "shmserve.tools.soak", "--seconds", "12", "--reload-every", "5", "--kill-every", "6"]
    tool = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = tool.communicate(timeout=300)
    finally:
        if tool.poll() is None:
            os.killpg(tool.pid, signal.SIGKILL)
            tool.wait()
        # its server is in a session of its own: a soak killed above must not leave it running
        subprocess.run(["pkill", "-KILL", "-f", f"shmserve launcher soak{tool.pid}$"], check=False)
    assert tool.returncode == 0, out[-3000:]
    served = {line.split(" served ")[0].strip(): int(line.split(" served ")[1].split()[0])
              for line in out.splitlines() if " served " in line}
    assert set(served) == {"http add_sub", "grpc add_sub", "grpc stream", "local add_sub", "http shm region",
                           "http bls", "http sequences"}, out
    assert all(n > 0 for n in served.values()), out
    assert "1 worker kills" in out or "2 worker kills" in out, out
    roles = [line.split()[1] for line in out.splitlines() if " RSS " in line]
    assert sorted(roles) == ["broker", "frontend", "grpc", "launcher"], out
    assert "/dev/shm objects left after stop: 0" in out, out
    stem = f"shmserve.soak{tool.pid}."
    assert not [n for n in os.listdir("/dev/shm") if n.startswith((stem, "sem." + stem))]
