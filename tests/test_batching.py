"""The dynamic batcher against a real server: batches form, the delay holds, priorities order,
queue policies time out and bound the queue, and a PyTorch model batches too."""
from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

REPO = Path(__file__).parent / "models" / "batching"
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([REPO, ROOT / "model_repository"])


def infer_with(url: str, model: str, width: int = 3, priority: int = 0, timeout_us: int = 0,
               sleep_s: float = 0.0, batch: int = 1) -> dict:
    """One request; what the execute() call that served it saw (requests, total batch, order)."""
    client = httpclient.InferenceServerClient(url)
    try:
        x = httpclient.InferInput("INPUT0", [batch, width], "FP32")
        x.set_data_from_numpy(np.zeros((batch, width), np.float32))
        started = time.monotonic()
        result = client.infer(model, [x], priority=priority, timeout=timeout_us,
                              parameters={"sleep_s": sleep_s} if sleep_s else None)
        return {"reqs": int(result.as_numpy("REQS")[0, 0]), "total": int(result.as_numpy("TOTAL")[0, 0]),
                "order": int(result.as_numpy("ORDER")[0, 0]), "seconds": time.monotonic() - started}
    finally:
        client.close()


def test_preferred_batch_size_forms_at_once(server):
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: infer_with(server.url, "probe"), range(4)))
    assert [r["reqs"] for r in results] == [4, 4, 4, 4]
    # The preferred size was reached, so nobody waited for the 300 ms queue delay.
    assert max(r["seconds"] for r in results) < 0.25


def test_queue_delay_holds_a_partial_batch(server):
    with cf.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: infer_with(server.url, "probe"), range(2)))
    assert [r["reqs"] for r in results] == [2, 2]
    # The delay counts from the oldest request, so the first to arrive waited all 300 ms; the
    # other arrived up to a thread start later and may have waited that much less.
    assert max(r["seconds"] for r in results) >= 0.29
    single = infer_with(server.url, "probe")
    assert single["reqs"] == 1 and 0.29 <= single["seconds"] < 2.0


def test_delay_is_skipped_once_the_traffic_of_a_delay_is_there(server):
    """Closed-loop clients: the first round waits the whole 300 ms delay (3 requests, no
    preferred size); after that, as soon as 3 wait again the batch goes, without the delay. A
    smaller round (2) waits the delay again and the size adapts."""
    def round_of(n: int) -> list[dict]:
        with cf.ThreadPoolExecutor(n) as pool:
            return list(pool.map(lambda _: infer_with(server.url, "probe_adaptive"), range(n)))

    first = round_of(3)
    assert [r["reqs"] for r in first] == [3, 3, 3] and min(r["seconds"] for r in first) >= 0.29
    for _ in range(3):
        again = round_of(3)
        assert [r["reqs"] for r in again] == [3, 3, 3]
        assert max(r["seconds"] for r in again) < 0.25, again
    fewer = round_of(2)
    assert [r["reqs"] for r in fewer] == [2, 2] and min(r["seconds"] for r in fewer) >= 0.29
    quick = round_of(2)
    assert [r["reqs"] for r in quick] == [2, 2] and max(r["seconds"] for r in quick) < 0.25


def test_requests_of_different_shapes_never_share_a_batch(server):
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda w: infer_with(server.url, "probe", width=w), [3, 3, 5, 5]))
    assert [r["reqs"] for r in results] == [2, 2, 2, 2]


def test_batch_sizes_add_up_to_the_batch_dimension(server):
    with cf.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda b: infer_with(server.url, "probe", batch=b), [1, 3]))
    assert [r["total"] for r in results] == [4, 4]  # 1 + 3 reached the preferred size 4


def test_higher_priority_runs_first(server):
    with cf.ThreadPoolExecutor(4) as pool:
        busy = pool.submit(infer_with, server.url, "probe_prio", 7, 0, 0, 0.6)
        time.sleep(0.15)
        low = [pool.submit(infer_with, server.url, "probe_prio", 3, 2) for _ in range(2)]
        time.sleep(0.15)
        high = pool.submit(infer_with, server.url, "probe_prio", 5, 1)
        results = [busy.result(), *(f.result() for f in low), high.result()]
    busy_r, low_a, low_b, high_r = results
    assert high_r["order"] == busy_r["order"] + 1  # straight after the busy batch
    assert low_a["order"] == low_b["order"] == high_r["order"] + 1  # the two low ones batch together
    assert low_a["reqs"] == 2


def test_queue_timeout_rejects(server):
    other_before = metric(server, "nv_inference_request_failure", "probe_timeout", reason="OTHER")
    with cf.ThreadPoolExecutor(3) as pool:
        busy = pool.submit(infer_with, server.url, "probe_timeout", 7, 0, 0, 0.8)
        time.sleep(0.15)
        waiting = pool.submit(infer_with, server.url, "probe_timeout", 3)
        shorter = pool.submit(infer_with, server.url, "probe_timeout", 4, 0, 50_000)
        assert busy.result()["reqs"] == 1
        for fut in (waiting, shorter):
            with pytest.raises(InferenceServerException) as e:
                fut.result()
            assert "Request timeout expired" in e.value.message()
    assert infer_with(server.url, "probe_timeout")["reqs"] == 1  # and it serves on
    # Triton counts a queue timeout as reason OTHER (not BACKEND: the model never saw them).
    assert metric(server, "nv_inference_request_failure", "probe_timeout", reason="OTHER") - other_before == 2


def test_delay_action_serves_timed_out_requests_last(server):
    with cf.ThreadPoolExecutor(3) as pool:
        busy = pool.submit(infer_with, server.url, "probe_delay_action", 7, 0, 0, 0.9)
        time.sleep(0.1)
        early = pool.submit(infer_with, server.url, "probe_delay_action", 3)  # times out at +0.4 s
        time.sleep(0.6)
        late = pool.submit(infer_with, server.url, "probe_delay_action", 5)  # in time when busy ends
        b, e, l_ = busy.result(), early.result(), late.result()
    assert l_["order"] == b["order"] + 1
    assert e["order"] == l_["order"] + 1  # served, but after the one that had not timed out


def test_full_queue_rejects_with_503(server):
    with cf.ThreadPoolExecutor(4) as pool:
        busy = pool.submit(infer_with, server.url, "probe_qsize", 7, 0, 0, 0.6)
        time.sleep(0.15)
        queued = [pool.submit(infer_with, server.url, "probe_qsize", 3) for _ in range(2)]
        time.sleep(0.15)
        with pytest.raises(InferenceServerException) as e:
            infer_with(server.url, "probe_qsize", 3)
        assert e.value.status() == "503"
        assert "Exceeds maximum queue size" in e.value.message()
        assert busy.result()["reqs"] == 1
        assert all(f.result()["reqs"] >= 1 for f in queued)


def metric(server, name: str, model: str, **labels: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    wanted = [f'model="{model}"', *(f'{k}="{v}"' for k, v in labels.items())]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {model} {labels} not in metrics")


def test_two_instances_batch_through_the_broker(server):
    """A single-instance version batches in its worker; with two instances the broker batches
    and picks the instance. Both form the same batches."""
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: infer_with(server.url, "probe_pair"), range(4)))
    assert [r["reqs"] for r in results] == [4, 4, 4, 4]
    assert max(r["seconds"] for r in results) < 0.25
    # What the broker tells clients: send single-instance batching versions to the worker.
    import orjson

    from shmserve.shm.channel import BrokerSegment
    broker = BrokerSegment.attach(server.id)
    try:
        routes = orjson.loads(broker.routes.read()[1])["models"]
    finally:
        broker.close()
    assert routes["probe"]["1"]["direct"] is True
    assert routes["probe_pair"]["1"]["direct"] is False


def test_requests_queued_in_the_worker_count_as_pending(server):
    def pending() -> float:
        return metric(server, "nv_inference_pending_request_count", "probe_hold")

    with cf.ThreadPoolExecutor(3) as pool:
        busy = pool.submit(infer_with, server.url, "probe_hold", 7, 0, 0, 1.5)
        time.sleep(0.15)
        queued = [pool.submit(infer_with, server.url, "probe_hold", 3) for _ in range(2)]
        deadline = time.monotonic() + 1.0
        while pending() != 3:  # one executing, two waiting for it on the worker's lanes
            assert time.monotonic() < deadline, f"pending count {pending()}, expected 3"
            time.sleep(0.05)
        assert busy.result()["reqs"] == 1
        assert [f.result()["reqs"] for f in queued] == [2, 2]  # they waited together: one batch
    assert pending() == 0


def test_dynamic_batching_asked_for_by_auto_complete_config_batches(server):
    client = httpclient.InferenceServerClient(server.url)
    try:
        config = client.get_model_config("probe_auto")
    finally:
        client.close()
    assert config["max_batch_size"] == 16 and "dynamic_batching" in config
    with cf.ThreadPoolExecutor(4) as pool:
        busy = pool.submit(infer_with, server.url, "probe_auto", 7, 0, 0, 1.0)
        time.sleep(0.2)
        queued = [pool.submit(infer_with, server.url, "probe_auto", 3) for _ in range(3)]
        assert busy.result()["reqs"] == 1
        assert [f.result()["reqs"] for f in queued] == [3, 3, 3]  # they gathered while it ran


@pytest.mark.parametrize("model", ["probe_hold", "probe_pair"])  # batched in the worker / in the broker
def test_descriptors_with_bad_queue_fields_are_400_and_harm_nothing(server, model):
    """A local program writes its descriptors itself: a priority, timeout or send time that is not
    a non-negative integer is its error, not the server's."""
    import threading

    from shmserve.shm.client import Client
    pids = server.worker_pids(model)
    x = np.zeros((1, 3), np.float32)
    with Client(server.id) as client:
        conn = client._conn  # noqa: SLF001 - the raw connection, to send what the library never would
        for field, value in (("priority", "high"), ("timeout", -5), ("t", "soon"), ("priority", True)):
            doc = {"model": model, "version": "", "outputs": None, field: value,
                   "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 3], "data": 0, "size": 12}]}
            answers: list = []
            done = threading.Event()

            def answered(c, answers=answers, done=done) -> None:
                answers.append((c.status, c.doc()))
                c.release()
                done.set()

            conn.infer(doc, [x], answered)
            assert done.wait(10), f"no answer for {field}={value!r}"
            status, body = answers[0]
            assert status == 400 and f"'{field}' must be a non-negative integer" in body["error"], body
        assert client.infer(model, {"INPUT0": x})["REQS"].tolist() == [[1]]
    assert server.worker_pids(model) == pids


KID = """
import sys, time, numpy as np
from shmserve.shm.client import Client
c = Client(sys.argv[1])
c.infer_async("probe_hold", {"INPUT0": np.zeros((1, 3), np.float32)})
print("sent", flush=True)
time.sleep(60)
"""


def test_a_client_killed_while_its_request_waits_in_the_worker(server):
    """Its queued request is dropped (or answered into the void); the others are served and the
    pending count returns to zero."""
    import subprocess
    import sys

    from conftest import ROOT as PROJECT
    with cf.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(infer_with, server.url, "probe_hold", 7, 0, 0, 1.0)
        time.sleep(0.15)
        kid = subprocess.Popen([sys.executable, "-c", KID, server.id], cwd=PROJECT, stdout=subprocess.PIPE, text=True)
        try:
            assert kid.stdout.readline().strip() == "sent"
            other = pool.submit(infer_with, server.url, "probe_hold", 3)
            time.sleep(0.1)
            kid.kill()
            kid.wait(10)
        finally:
            if kid.poll() is None:
                kid.kill()
                kid.wait(10)
            kid.stdout.close()
        assert busy.result()["reqs"] == 1
        assert other.result()["reqs"] >= 1
    deadline = time.monotonic() + 5
    while metric(server, "nv_inference_pending_request_count", "probe_hold") != 0:
        assert time.monotonic() < deadline, "the killed client's request stays pending"
        time.sleep(0.1)
    assert infer_with(server.url, "probe_hold")["reqs"] == 1


SILENT_KID = """
import importlib.abc, importlib.util, pathlib, sys, time, numpy as np


class FromSource(importlib.abc.MetaPathFinder):
    # The compiled modules' methods cannot be replaced: this client runs their Python source.
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in ("shm", "server", "workers"):
            return None
        base = pathlib.Path.cwd().joinpath(*name.split("."))
        source = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        return importlib.util.spec_from_file_location(name, source) if source.exists() else None


sys.meta_path.insert(0, FromSource())
from shmserve.shm.channel import WorkerSegment
assert WorkerSegment.__module__ == "shmserve.shm.channel" and sys.modules["shmserve.shm.channel"].__file__.endswith(".py")
from shmserve.shm.client import Client
WorkerSegment.ring_bell = lambda self, lane: None  # as if killed between its put and its bell
c = Client(sys.argv[1])
c.infer_async("add_sub", {"INPUT0": np.zeros(16, np.int32), "INPUT1": np.zeros(16, np.int32)})
print("sent", flush=True)
time.sleep(60)
"""


def test_a_record_whose_bell_never_rang_is_drained_when_its_client_is_gone(server):
    """Workers find lane records by the bell their client rings after each put. A client killed
    between the two leaves a record no bell announces: once the client is gone the worker looks
    at every lane's counters, drains it, and the pending count returns to zero."""
    import subprocess
    import sys

    from conftest import ROOT as PROJECT
    # The worker also rings every lane that holds records each 10 s and whenever any client of
    # the server departs (other tests' clients share this server); a sweep that falls in the 0.3 s
    # below drains the record before it is seen pending, so such a try is repeated.
    for attempt in range(3):
        kid = subprocess.Popen([sys.executable, "-c", SILENT_KID, server.id], cwd=PROJECT, stdout=subprocess.PIPE,
                               text=True)
        try:
            assert kid.stdout.readline().strip() == "sent"
            time.sleep(0.3)
            pending = metric(server, "nv_inference_pending_request_count", "add_sub")
        finally:
            kid.kill()
            kid.wait(10)
            kid.stdout.close()
        if pending == 1:  # the silent record
            break
        assert pending == 0, pending
    assert pending == 1, "every silent record was drained at once: a sweep three times running?"
    client = httpclient.InferenceServerClient(server.url)
    try:
        a = np.arange(16, dtype=np.int32)
        inputs = [httpclient.InferInput(n, [16], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(a)
        deadline = time.monotonic() + 15  # the broker sees the departure within 1 s
        while metric(server, "nv_inference_pending_request_count", "add_sub") != 0:
            assert time.monotonic() < deadline, "the unannounced record stays pending"
            np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), 2 * a)
            time.sleep(0.2)
    finally:
        client.close()


def test_unload_serves_what_waits_in_the_worker_first(server_factory):
    s = server_factory.start([REPO], ["--model-control-mode", "explicit", "--load-model", "probe_hold"])
    with cf.ThreadPoolExecutor(3) as pool:
        busy = pool.submit(infer_with, s.url, "probe_hold", 7, 0, 0, 1.2)
        time.sleep(0.15)
        queued = [pool.submit(infer_with, s.url, "probe_hold", 3) for _ in range(2)]
        time.sleep(0.3)
        client = httpclient.InferenceServerClient(s.url)
        try:
            client.unload_model("probe_hold")
            assert busy.result()["reqs"] == 1
            assert [f.result()["reqs"] for f in queued] == [2, 2]
            deadline = time.monotonic() + 10
            while client.is_model_ready("probe_hold"):
                assert time.monotonic() < deadline
                time.sleep(0.1)
        finally:
            client.close()


def test_pytorch_model_batches_under_concurrency(server):
    from sklearn.datasets import load_digits

    images = (load_digits().images[:64] / 16.0).astype(np.float32).reshape(64, 1, 1, 8, 8)

    def classify(img: np.ndarray) -> np.ndarray:
        c = httpclient.InferenceServerClient(server.url)
        try:
            x = httpclient.InferInput("INPUT__0", [1, 1, 8, 8], "FP32")
            x.set_data_from_numpy(img)
            return c.infer("digits", [x]).as_numpy("OUTPUT__0")
        finally:
            c.close()

    before_count = metric(server, "nv_inference_count", "digits")
    before_exec = metric(server, "nv_inference_exec_count", "digits")
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(classify, images))
    assert all(o.shape == (1, 10) for o in outs)
    count = metric(server, "nv_inference_count", "digits") - before_count
    execs = metric(server, "nv_inference_exec_count", "digits") - before_exec
    assert count == 64
    assert execs < count  # some requests ran together in one forward
