"""Faults caused for real: workers killed, crashing, exiting or hanging; the broker and a frontend
killed. Requests on the failed instance fail fast with a clear 500 naming model and instance; the
rest is untouched; what died comes back."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, PYTHON, ROOT, TESTS, TEST_MODELS, pid_alive, raw_request, shm_entries
from gates import Gate
from shmserve import Client

FAULT_MODELS = TESTS / "models" / "faults"
EXECUTION_TIMEOUT_S = 5  # crasher's execution_timeout_s


@pytest.fixture
def faulty(server_factory):
    return server_factory.start([FAULT_MODELS, TEST_MODELS])


def call(url: str, x: int, model: str = "crasher", timeout: float = DEADLINE_S, gate: Gate | None = None) -> int:
    """PID of the worker that answered (the model holds the request at ``gate`` until it opens)."""
    client = httpclient.InferenceServerClient(url, network_timeout=timeout, connection_timeout=timeout)
    try:
        t = httpclient.InferInput("X", [1], "INT32")
        t.set_data_from_numpy(np.array([x], dtype=np.int32))
        parameters = {"gate": gate.param} if gate is not None else None
        return int(client.infer(model, [t], parameters=parameters).as_numpy("PID")[0])
    finally:
        client.close()


def metric(server, name: str, **labels: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=DEADLINE_S).read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{want}}} not exported")


def wait_for(predicate, what: str, timeout: float = DEADLINE_S) -> None:
    """Restarts, drains and cleanups take what a loaded host gives them: wait generously."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} not within {timeout} s"
        time.sleep(0.05)


def other_model_serves(server) -> bool:
    """Other models are untouched: 'raiser' (a test model) doubles its input."""
    client = httpclient.InferenceServerClient(server.url)
    try:
        t = httpclient.InferInput("X", [3], "INT32")
        t.set_data_from_numpy(np.array([1, 2, 3], dtype=np.int32))
        return client.infer("raiser", [t]).as_numpy("Y").tolist() == [2, 4, 6]
    finally:
        client.close()


def test_sigkill_of_a_worker_fails_only_its_request_and_it_comes_back(faulty, tmp_path):
    before = set(faulty.worker_pids("crasher"))
    assert len(before) == 2
    gate = Gate(tmp_path / "gate")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = [pool.submit(call, faulty.url, 0, gate=gate) for _ in range(2)]
        try:
            assert set(gate.wait_started(2)) == before  # one in each instance
            victim = sorted(before)[0]
            os.kill(victim, signal.SIGKILL)
        finally:
            gate.open()  # the other instance's request goes on
        outcomes = []
        for f in held:
            try:
                outcomes.append(("ok", f.result()))
            except InferenceServerException as e:
                outcomes.append(("failed", e))
    assert other_model_serves(faulty)
    failed = [e for kind, e in outcomes if kind == "failed"]
    served = [pid for kind, pid in outcomes if kind == "ok"]
    assert len(failed) == 1 and served and victim not in served, outcomes
    err = failed[0]
    assert err.status() == "500"
    assert "model 'crasher' version 1 instance 'crasher_" in err.message()
    assert "killed by SIGKILL" in err.message()
    wait_for(lambda: len(faulty.worker_pids("crasher")) == 2 and victim not in faulty.worker_pids("crasher"),
             "the killed instance restarted")
    assert {call(faulty.url, 0) for _ in range(20)} <= set(faulty.worker_pids("crasher"))
    assert metric(faulty, "shmserve_worker_restarts", model="crasher", version="1") == 1
    assert metric(faulty, "nv_inference_request_failure", model="crasher", reason="BACKEND", version="1") == 1
    # The log says what the operator needs: how it ended, what it cost, when it restarts, that it is back.
    log = faulty.log()
    assert re.search(r"model 'crasher' version 1 instance 'crasher_[\d_]+' was killed by SIGKILL; 1 request\(s\) "
                     r"failed; restarting it (now|in [\d.]+ s \(back-off\))", log), log[-2000:]
    wait_for(lambda: re.search(r"model 'crasher' version 1 instance 'crasher_[\d_]+' is serving again "
                               r"\(restart 1\)", faulty.log()), "the restarted instance said to serve again")


@pytest.mark.parametrize("x,why", [(1, "exited unexpectedly (exit code 1)"), (2, "was killed by SIGSEGV")])
def test_model_that_exits_or_segfaults(faulty, x, why):
    with pytest.raises(InferenceServerException) as e:
        call(faulty.url, x)
    assert e.value.status() == "500"
    assert "model 'crasher' version 1 instance 'crasher_" in e.value.message() and why in e.value.message()
    assert call(faulty.url, 0) in faulty.worker_pids("crasher")  # the other instance serves meanwhile
    wait_for(lambda: len(faulty.worker_pids("crasher")) == 2, "the instance restarted")
    assert call(faulty.url, 0) > 0


def test_readiness_reflects_a_model_with_no_live_instance(server_factory, monkeypatch, tmp_path):
    gate = Gate(tmp_path / "lonely")  # holds lonely's restarted instance in initialize() until opened
    monkeypatch.setenv("SHMSERVE_TEST_LONELY_GATE", gate.param)
    faulty = server_factory.start([FAULT_MODELS, TEST_MODELS])
    client = httpclient.InferenceServerClient(faulty.url)
    assert client.is_model_ready("lonely") and client.is_server_ready()
    with pytest.raises(InferenceServerException, match="exited unexpectedly"):
        call(faulty.url, 1, model="lonely")
    assert not client.is_model_ready("lonely")  # restarting (back-off, then initialize)
    assert not client.is_server_ready()
    model_ready = raw_request(faulty.port, "GET", "/v2/models/lonely/ready")
    assert model_ready.status == 400 and model_ready.json() == {"error": "Model version not ready"}  # Triton's
    server_ready = raw_request(faulty.port, "GET", "/v2/health/ready")
    assert server_ready.status == 400 and server_ready.body == b""  # no model's text for the server's state
    assert client.is_model_ready("crasher")
    gate.wait_started(2)  # the restarted instance is in initialize()...
    assert not client.is_model_ready("lonely")  # ... and the model is still not ready
    gate.open()
    wait_for(lambda: client.is_model_ready("lonely"), "lonely ready again")
    assert client.is_server_ready()
    assert call(faulty.url, 0, model="lonely") > 0
    client.close()


def test_hung_execution_is_killed_after_the_execution_timeout(faulty):
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as e:
        call(faulty.url, 3)
    took = time.monotonic() - started
    assert e.value.status() == "500"
    assert f"exceeded its execution timeout of {EXECUTION_TIMEOUT_S} s (parameter execution_timeout_s)" \
        in e.value.message()
    assert "instance 'crasher_" in e.value.message()
    assert took >= EXECUTION_TIMEOUT_S - 0.1, took  # not before its time (and the call's own timeout bounds it)
    wait_for(lambda: len(faulty.worker_pids("crasher")) == 2, "the hung instance restarted")
    assert call(faulty.url, 0) > 0
    assert "exceeded its execution timeout" in faulty.log()


def test_under_load_a_killed_instance_loses_at_most_its_in_flight_requests(faulty):
    stop = threading.Event()
    served: list[int] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client_loop() -> None:
        client = httpclient.InferenceServerClient(faulty.url, network_timeout=DEADLINE_S)
        t = httpclient.InferInput("X", [1], "INT32")
        t.set_data_from_numpy(np.array([0], dtype=np.int32))
        while not stop.is_set():
            try:
                pid = int(client.infer("crasher", [t]).as_numpy("PID")[0])
                with lock:
                    served.append(pid)
            except InferenceServerException as e:
                with lock:
                    failures.append(e.message())
        client.close()

    def served_by(pids: set[int]) -> int:
        with lock:
            return sum(pid in pids for pid in served)

    before = set(faulty.worker_pids("crasher"))
    threads = [threading.Thread(target=client_loop) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: all(served_by({pid}) >= 10 for pid in before), "both instances serving the load")
        victim = sorted(before)[0]
        os.kill(victim, signal.SIGKILL)
        seen: dict[str, set[int]] = {}

        def replaced() -> bool:
            """Two instances again, the victim not among them (one reading of /proc, kept)."""
            pids = set(faulty.worker_pids("crasher"))
            seen["pids"] = pids
            return len(pids) == 2 and victim not in pids

        wait_for(replaced, "restart under load")
        restarted = seen["pids"] - before
        assert len(restarted) == 1, (before, seen["pids"])
        wait_for(lambda: served_by(restarted) >= 10, "the restarted instance serving the load")
    finally:
        stop.set()
        for t in threads:
            t.join(DEADLINE_S)
    assert len(failures) <= 4, failures  # at most one in flight per client on the killed instance
    assert all("killed by SIGKILL" in m for m in failures), failures
    assert other_model_serves(faulty)


def test_broker_death_answers_503_meanwhile_and_it_is_restarted(faulty):
    broker = next(pid for pid, t in faulty.titles().items() if t.startswith("shmserve broker "))
    assert call(faulty.url, 0) > 0
    os.kill(broker, signal.SIGKILL)
    saw_503 = False
    deadline = time.monotonic() + 2 * DEADLINE_S  # a new broker, and every model's workers
    while True:
        assert time.monotonic() < deadline, "the server did not come back"
        try:
            # A request that hung while the broker is down fails here, on the call's own timeout
            # (a socket timeout, not an answer).
            call(faulty.url, 0)
            if saw_503:
                break
        except InferenceServerException as e:
            assert e.status() in ("503", "404"), (e.status(), e.message())  # 404: model not loaded yet
            saw_503 = saw_503 or e.status() == "503"
        time.sleep(0.05)
    assert saw_503
    assert not pid_alive(broker)
    assert "the broker died" in faulty.log()


HOLDING_CLIENT = """
import sys, time
from shmserve import Client
client = Client(sys.argv[1])
print(client._conn.name, flush=True)
time.sleep(600)
"""


def test_a_client_that_dies_while_the_broker_is_down_leaves_nothing(faulty):
    """Before, the launcher kept every client segment across a broker restart, and the new broker
    never knew the clients of the old one: a client that died meanwhile left its segment (64 MiB
    of /dev/shm by size) until the server stopped."""
    client = subprocess.Popen([PYTHON, "-c", HOLDING_CLIENT, faulty.id], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        segment = client.stdout.readline().strip().lstrip("/")
        assert segment in shm_entries(faulty.id)
        broker = next(pid for pid, t in faulty.titles().items() if t.startswith("shmserve broker "))
        os.kill(broker, signal.SIGKILL)
        client.kill()
    finally:
        client.kill()
        client.wait(10)

    def serves() -> bool:
        try:
            return call(faulty.url, 0, timeout=5) > 0
        except Exception:  # noqa: BLE001 - 503s while the new broker loads its models
            return False

    def new_broker() -> bool:  # (a worker of the dead one may still answer on its lane meanwhile)
        return any(t.startswith("shmserve broker ") and pid != broker for pid, t in faulty.titles().items())

    wait_for(new_broker, "a new broker")
    wait_for(serves, "the restarted broker serving", timeout=2 * DEADLINE_S)
    assert not [n for n in shm_entries(faulty.id) if n.startswith(segment) or n == "sem." + segment]


def test_objects_removed_from_dev_shm_by_another_program_make_a_new_broker(faulty):
    """As systemd-logind does (RemoveIPC) when the server's user logs out, or a cleanup script:
    every object of the server goes while it runs. Before, the processes went on with their
    mappings and nothing new could connect or start; the launcher now restarts the broker, which
    makes them anew, and says why."""
    broker = next(pid for pid, t in faulty.titles().items() if t.startswith("shmserve broker "))
    assert call(faulty.url, 0) > 0
    for name in shm_entries(faulty.id):
        os.unlink(f"/dev/shm/{name}")

    def serves() -> bool:
        try:
            return call(faulty.url, 0, timeout=5) > 0
        except Exception:  # noqa: BLE001 - 503s while the new broker loads its models
            return False

    wait_for(lambda: not pid_alive(broker), "the broker whose objects went stopped")
    wait_for(lambda: any(t.startswith("shmserve broker ") for t in faulty.titles().values()), "a new broker")
    wait_for(serves, "a new broker serving", timeout=2 * DEADLINE_S)
    wait_for(lambda: os.path.exists(f"/dev/shm/shmserve.{faulty.id}.broker.0"), "the new broker's segment")
    assert "the server's shared-memory objects were removed from /dev/shm by another program" in faulty.log()
    with Client(faulty.id) as local:  # a new client finds the new broker
        assert int(local.infer("crasher", {"X": np.array([0], dtype=np.int32)})["PID"][0]) > 0


def test_frontend_death_is_restarted(faulty):
    frontend = next(pid for pid, t in faulty.titles().items() if t.startswith("shmserve frontend "))
    assert call(faulty.url, 0) > 0
    os.kill(frontend, signal.SIGKILL)

    def serves() -> bool:
        try:
            return call(faulty.url, 0, timeout=5) > 0
        except Exception:  # noqa: BLE001 - connection refused while it restarts
            return False

    wait_for(serves, "a restarted frontend serving")
    assert frontend not in faulty.titles()
    assert "HTTP frontend #0 died" in faulty.log()


def test_grpc_frontend_death_is_restarted_and_named_as_its_process(faulty):
    """The log names the gRPC process as ``ps`` shows it, not as one more numbered frontend."""
    grpc_pid = next(pid for pid, t in faulty.titles().items() if t.startswith("shmserve grpc "))
    os.kill(grpc_pid, signal.SIGKILL)

    def serves() -> bool:
        try:
            with grpcclient.InferenceServerClient(faulty.grpc_url) as client:
                return client.is_server_live()
        except Exception:  # noqa: BLE001 - unavailable while it restarts
            return False

    wait_for(lambda: grpc_pid not in faulty.titles(), "the killed gRPC frontend gone")
    wait_for(serves, "a restarted gRPC frontend serving")
    assert "the gRPC frontend died (exit code -9)" in faulty.log()


def test_sigterm_finishes_in_flight_requests_then_exits_clean(faulty, tmp_path):
    from conftest import shm_entries

    tree = faulty.tree()
    marks = Gate(tmp_path / "marks")
    marks.open()  # (only to see when both executions have started)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = [pool.submit(call, faulty.url, 5, gate=marks) for _ in range(2)]  # 1.5 s each, one per instance
        marks.wait_started(2)
        faulty.proc.send_signal(signal.SIGTERM)
        assert all(f.result() > 0 for f in slow)  # in-flight work finished

    def refused() -> bool:
        try:
            call(faulty.url, 0, timeout=5)
        except Exception:  # noqa: BLE001 - no longer accepting: refused or reset
            return True
        return False

    wait_for(refused, "new requests refused")
    assert faulty.wait_exit(DEADLINE_S) == 0, faulty.log_tail()
    assert shm_entries(faulty.id) == []
    wait_for(lambda: not any(pid_alive(p) for p in tree), "every process gone")


def test_workers_run_openmp_without_spinning(faulty):
    """Workers share the cores with the rest of the server: their OpenMP pools sleep when idle
    (a spinning pool took the CPU of the frontend and the broker between small batches)."""
    client = httpclient.InferenceServerClient(faulty.url)
    name = httpclient.InferInput("NAME", [1], "BYTES")
    name.set_data_from_numpy(np.array([b"OMP_WAIT_POLICY"], dtype=object))
    assert client.infer("env_probe", [name]).as_numpy("VALUE").tolist() == [b"PASSIVE"]
    client.close()
