"""The dynamic batcher against a real server: batches form, the delay holds, priorities order,
queue policies time out and bound the queue, and a PyTorch model batches too."""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, raw_request, wait_pending, wait_until
from gates import Gate
from shmserve import Client

REPO = Path(__file__).parent / "models" / "batching"
ROOT = Path(__file__).resolve().parent.parent
LONG_DELAY_S = 30.0  # probe_long's and probe_pair's max_queue_delay: far more than any batch here takes to form
ADAPTIVE_DELAY_S = 2.0  # probe_adaptive's


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([REPO, ROOT / "model_repository"])


def infer_with(url: str, model: str, width: int = 3, priority: int = 0, timeout_us: int = 0,
               sleep_s: float = 0.0, batch: int = 1, gate: Gate | None = None,
               barrier: threading.Barrier | None = None) -> dict:
    """One request; what the execute() call that served it saw (requests, total batch, order).
    With ``barrier``, the request is sent once every client of the barrier is ready to send."""
    client = httpclient.InferenceServerClient(url)
    try:
        x = httpclient.InferInput("INPUT0", [batch, width], "FP32")
        x.set_data_from_numpy(np.zeros((batch, width), np.float32))
        parameters = {"sleep_s": sleep_s} if sleep_s else {}
        if gate is not None:
            parameters["gate"] = gate.param
        if barrier is not None:
            barrier.wait()
        started = time.monotonic()
        result = client.infer(model, [x], priority=priority, timeout=timeout_us, parameters=parameters or None)
        return {"reqs": int(result.as_numpy("REQS")[0, 0]), "total": int(result.as_numpy("TOTAL")[0, 0]),
                "order": int(result.as_numpy("ORDER")[0, 0]), "seconds": time.monotonic() - started}
    finally:
        client.close()


def together(url: str, model: str, n: int, **kw) -> list[dict]:
    """``n`` requests sent at once from as many threads."""
    barrier = threading.Barrier(n)
    with cf.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: infer_with(url, model, barrier=barrier, **kw), range(n)))


class Busy:
    """A request (of width 7, a shape no other request here has) that holds ``model``'s one
    instance until the block ends. Requests sent meanwhile with ``send`` wait together, in the
    order sent, so the batches they form do not depend on how fast the host runs the client
    threads: each ``send`` returns once its requests are pending at the server."""

    def __init__(self, server, model: str, folder: Path, **kw) -> None:
        self.server, self.model = server, model
        self.gate = Gate(folder / f"gate-{model}")
        self.pool = cf.ThreadPoolExecutor(8)
        self.pending = 1
        self.future = self.pool.submit(infer_with, server.url, model, 7, gate=self.gate, **kw)

    def __enter__(self) -> "Busy":
        self.gate.wait_started(1)
        return self

    def send(self, n: int, *args, **kw) -> list[cf.Future]:
        futures = [self.pool.submit(infer_with, self.server.url, self.model, *args, **kw) for _ in range(n)]
        self.pending += n
        wait_pending(self.server, self.model, self.pending)
        return futures

    def release(self) -> dict:
        self.gate.open()
        return self.future.result()

    def __exit__(self, *exc: object) -> None:
        self.gate.open()  # (also when the test failed: the module's server serves the next tests)
        self.pool.shutdown()


def test_preferred_batch_size_forms_at_once(server):
    results = together(server.url, "probe_long", 4)
    assert [r["reqs"] for r in results] == [4, 4, 4, 4]
    # The preferred size was reached, so nobody waited for the queue delay.
    assert max(r["seconds"] for r in results) < LONG_DELAY_S


def test_a_partial_batch_waits_and_later_requests_join_it(server, tmp_path):
    """Two requests are held (their batch is short of the preferred 4, and the delay is long);
    two more complete the batch, which then goes at once."""
    marks = Gate(tmp_path / "marks")
    marks.open()  # (only to see when an execution starts)
    with cf.ThreadPoolExecutor(4) as pool:
        first = [pool.submit(infer_with, server.url, "probe_long", gate=marks) for _ in range(2)]
        wait_pending(server, "probe_long", 2)
        assert marks.started() == [], "a partial batch ran before its delay"
        later = [pool.submit(infer_with, server.url, "probe_long", gate=marks) for _ in range(2)]
        results = [f.result() for f in (*first, *later)]
    assert [r["reqs"] for r in results] == [4, 4, 4, 4]
    assert len(marks.started()) == 1
    assert max(r["seconds"] for r in results) < LONG_DELAY_S


def test_queue_delay_holds_a_partial_batch(server):
    # The delay counts from the oldest request: one alone waits all 300 ms, then goes.
    single = infer_with(server.url, "probe")
    assert single["reqs"] == 1 and single["seconds"] >= 0.29


def test_delay_is_skipped_once_the_traffic_of_a_delay_is_there(server):
    """Closed-loop clients: the first round waits the whole delay (3 requests, no preferred
    size); after that, as soon as 3 wait again the batch goes, without the delay. A smaller
    round (2) waits the delay again and the size adapts."""
    first = together(server.url, "probe_adaptive", 3)
    assert [r["reqs"] for r in first] == [3, 3, 3] and min(r["seconds"] for r in first) >= ADAPTIVE_DELAY_S - 0.01
    for _ in range(3):
        again = together(server.url, "probe_adaptive", 3)
        assert [r["reqs"] for r in again] == [3, 3, 3]
        assert max(r["seconds"] for r in again) < ADAPTIVE_DELAY_S, again
    fewer = together(server.url, "probe_adaptive", 2)
    assert [r["reqs"] for r in fewer] == [2, 2] and min(r["seconds"] for r in fewer) >= ADAPTIVE_DELAY_S - 0.01
    quick = together(server.url, "probe_adaptive", 2)
    assert [r["reqs"] for r in quick] == [2, 2] and max(r["seconds"] for r in quick) < ADAPTIVE_DELAY_S


def test_requests_of_different_shapes_never_share_a_batch(server, tmp_path):
    with Busy(server, "probe", tmp_path) as busy:
        queued = [f for w in (3, 3, 5, 5) for f in busy.send(1, w)]
        assert busy.release()["reqs"] == 1
        assert [f.result()["reqs"] for f in queued] == [2, 2, 2, 2]


def test_batch_sizes_add_up_to_the_batch_dimension(server, tmp_path):
    with Busy(server, "probe", tmp_path) as busy:
        queued = [f for b in (1, 3) for f in busy.send(1, batch=b)]
        busy.release()
        assert [f.result()["total"] for f in queued] == [4, 4]  # 1 + 3 reached the preferred size 4


def test_higher_priority_runs_first(server, tmp_path):
    with Busy(server, "probe_prio", tmp_path) as busy:
        low = busy.send(2, 3, 2)
        high = busy.send(1, 5, 1)[0]
        busy_r = busy.release()
        low_a, low_b, high_r = (f.result() for f in (*low, high))
    assert high_r["order"] == busy_r["order"] + 1  # straight after the busy batch
    assert low_a["order"] == low_b["order"] == high_r["order"] + 1  # the two low ones batch together
    assert low_a["reqs"] == 2


def test_an_ensemble_passes_the_clients_priority_to_its_steps(server, tmp_path):
    """Triton lets any priority through an ensemble and gives it to each step's request: here a
    step of prio_pipe sent with priority 1 goes before a direct request of the default level 2
    that waited first. (Its step model queues in the broker, as a step does: the queue of a model
    whose worker batches its own lanes is apart from the broker's, docs/serving.md.)"""
    with Busy(server, "probe_prio_queued", tmp_path) as busy:
        [low] = busy.send(1, 3, 2)
        high = busy.pool.submit(infer_with, server.url, "prio_pipe", 5, 1)
        busy.pending += 1
        wait_pending(server, "probe_prio_queued", busy.pending)  # the step waits in its model's queue
        busy_r = busy.release()
        low_r, high_r = low.result(), high.result()
    assert high_r["order"] == busy_r["order"] + 1
    assert low_r["order"] == high_r["order"] + 1


def test_a_closed_local_clients_request_queued_in_the_broker_is_cancelled_there(server, tmp_path):
    """close() cancels a request the broker's queue holds there (a REQ_CANCEL, as ``cancel``
    sends): it never runs and counts as a cancelled request, as Triton counts one. Before, it
    stayed queued until the client's goodbye and was then forgotten, uncounted."""
    with Busy(server, "probe_prio_queued", tmp_path) as busy:
        failed = _fails(server, "probe_prio_queued")
        client = Client(server.id)
        try:
            client.infer_async("probe_prio_queued", {"INPUT0": np.zeros((1, 3), np.float32)})
            wait_pending(server, "probe_prio_queued", 2)
        finally:
            client.close()
        wait_pending(server, "probe_prio_queued", 1)
        assert _fails(server, "probe_prio_queued") == failed + 1
        executions = _stats(server, "probe_prio_queued")["execution_count"]
        busy.release()
    assert _stats(server, "probe_prio_queued")["execution_count"] == executions + 1  # the busy one alone


def _stats(server, model: str) -> dict:
    client = httpclient.InferenceServerClient(server.url)
    try:
        return client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()


def _fails(server, model: str) -> int:
    return int(_stats(server, model)["inference_stats"]["fail"]["count"])


def _fail_ns(server, model: str) -> int:
    return int(_stats(server, model)["inference_stats"]["fail"]["ns"])


def test_queue_timeout_rejects(server, tmp_path):
    other_before = metric(server, "nv_inference_request_failure", "probe_timeout", reason="REJECTED")
    fail_ns_before = _fail_ns(server, "probe_timeout")
    with Busy(server, "probe_timeout", tmp_path) as busy:
        waiting = busy.send(1, 3)[0]
        shorter = busy.send(1, 4, 0, 50_000)[0]
        # Both time out (200 ms, 50 ms) while the instance is still busy, as Triton's scheduler
        # thread times them out: not once the running batch ends.
        for fut in (waiting, shorter):
            with pytest.raises(InferenceServerException) as e:
                fut.result(timeout=DEADLINE_S)
            assert "Request timeout expired" in e.value.message()
        assert not busy.future.done()
        assert busy.release()["reqs"] == 1
    assert infer_with(server.url, "probe_timeout")["reqs"] == 1  # and it serves on
    # Triton 2.51 counts a queue timeout as reason REJECTED (not BACKEND: the model never saw them).
    wait_until(lambda: metric(server, "nv_inference_request_failure", "probe_timeout", reason="REJECTED")
               - other_before >= 2, "the timeouts counted")
    assert metric(server, "nv_inference_request_failure", "probe_timeout", reason="REJECTED") - other_before == 2
    # ... and their time in the server (200 and 50 ms at least) as the failures' duration, as Triton's
    assert _fail_ns(server, "probe_timeout") - fail_ns_before >= 250e6


def test_delay_action_serves_timed_out_requests_last(server, tmp_path):
    with Busy(server, "probe_delay_action", tmp_path) as busy:
        early = busy.send(1, 3, 0, 50_000)[0]  # its own timeout: 50 ms
        time.sleep(0.1)  # it has timed out: it waits behind whatever comes in time
        late = busy.send(1, 5)[0]  # the default timeout (60 s): in time when busy ends
        b = busy.release()
        e, l_ = early.result(), late.result()
    assert l_["order"] == b["order"] + 1
    assert e["order"] == l_["order"] + 1  # served, but after the one that had not timed out


def test_full_queue_rejects_with_503(server, tmp_path):
    """Triton 2.51's text, and its count: a request its scheduler refuses is counted nowhere."""
    failed_before = {r: metric(server, "nv_inference_request_failure", "probe_qsize", reason=r)
                     for r in ("REJECTED", "OTHER", "BACKEND")}
    with Busy(server, "probe_qsize", tmp_path) as busy:
        queued = busy.send(2, 3)
        third = busy.pool.submit(infer_with, server.url, "probe_qsize", 3)
        with pytest.raises(InferenceServerException) as e:  # at once, while the batch still runs
            third.result(timeout=DEADLINE_S)
        assert not busy.future.done()
        assert e.value.status() == "503"
        assert e.value.message() == "[request id: <id_unknown>] Exceeds maximum queue size"  # Triton's, whole
        assert busy.release()["reqs"] == 1
        assert all(f.result()["reqs"] >= 1 for f in queued)
    assert {r: metric(server, "nv_inference_request_failure", "probe_qsize", reason=r) for r in failed_before} \
        == failed_before


def test_delayed_requests_count_in_the_queue_size(server, tmp_path):
    """Requests that timed out under DELAY still wait in their level's queue: with
    max_queue_size 2 and both delayed, a third is refused, as Triton counts a queue's delayed
    requests in its size."""
    with Busy(server, "probe_delay_qsize", tmp_path) as busy:
        delayed = busy.send(2, 3, 0, 50_000)  # their own timeout: 50 ms
        time.sleep(0.2)  # both timed out: delayed, still queued
        third = busy.pool.submit(infer_with, server.url, "probe_delay_qsize", 3)
        with pytest.raises(InferenceServerException) as e:
            third.result(timeout=DEADLINE_S)
        assert e.value.message() == "[request id: <id_unknown>] Exceeds maximum queue size"
        busy.release()
        assert all(f.result()["reqs"] == 1 for f in delayed)  # served, after their wait


def metric(server, name: str, model: str, **labels: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=60).read().decode()
    wanted = [f'model="{model}"', *(f'{k}="{v}"' for k, v in labels.items())]
    for line in text.splitlines():
        if line.startswith(name + "{") and all(w in line for w in wanted):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {model} {labels} not in metrics")


def test_two_instances_batch_through_the_broker(server):
    """A single-instance version batches in its worker; with two instances the broker batches
    and picks the instance. Both form the same batches."""
    results = together(server.url, "probe_pair", 4)
    assert [r["reqs"] for r in results] == [4, 4, 4, 4]
    assert max(r["seconds"] for r in results) < LONG_DELAY_S  # the preferred size went at once
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


def test_requests_queued_in_the_worker_count_as_pending(server, tmp_path):
    def pending() -> float:
        return metric(server, "nv_inference_pending_request_count", "probe_hold")

    with Busy(server, "probe_hold", tmp_path) as busy:
        queued = busy.send(2, 3)  # (returns once the count shows them)
        assert pending() == 2  # two waiting on the worker's lanes; the one executing is not pending (Triton's)
        assert busy.release()["reqs"] == 1
        assert [f.result()["reqs"] for f in queued] == [2, 2]  # they waited together: one batch
    wait_until(lambda: pending() == 0, "the pending count back to 0")


def test_dynamic_batching_asked_for_by_auto_complete_config_batches(server, tmp_path):
    client = httpclient.InferenceServerClient(server.url)
    try:
        config = client.get_model_config("probe_auto")
    finally:
        client.close()
    assert config["max_batch_size"] == 16 and "dynamic_batching" in config
    with Busy(server, "probe_auto", tmp_path) as busy:
        queued = busy.send(3, 3)
        assert busy.release()["reqs"] == 1
        assert [f.result()["reqs"] for f in queued] == [3, 3, 3]  # they gathered while it ran


@pytest.mark.parametrize("model", ["probe_hold", "probe_pair"])  # batched in the worker / in the broker
def test_descriptors_with_extreme_queue_fields_harm_nothing(server, model):
    """A local program writes its descriptors itself: the layout holds only unsigned 64-bit
    priorities, timeouts and send times (the library refuses to encode another), and the largest
    of each is served without harm to the batcher's arithmetic."""
    from shmserve.shm.client import Client
    from shmserve.shm.descriptor import InferRequest, InputTensor
    pids = server.worker_pids(model)
    x = np.zeros((1, 3), np.float32)
    with Client(server.id) as client:
        conn = client._conn  # noqa: SLF001 - the raw connection, to send what the library never would
        for field, value in (("priority", "high"), ("timeout_us", -5), ("sent_ns", "soon"), ("priority", 1 << 64)):
            doc = InferRequest(model, "", [InputTensor("INPUT0", "FP32", [1, 3], 12, 0)], **{field: value})
            with pytest.raises(ValueError, match="cannot be encoded"):
                conn.infer(doc, [x], lambda c: c.release())
        for field, value in (("priority", (1 << 64) - 1), ("timeout_us", (1 << 64) - 1), ("sent_ns", (1 << 64) - 1)):
            doc = InferRequest(model, "", [InputTensor("INPUT0", "FP32", [1, 3], 12, 0)], **{field: value})
            answers: list = []
            done = threading.Event()

            def answered(c, answers=answers, done=done) -> None:
                answers.append((c.status, c.answer))
                c.release()
                done.set()

            conn.infer(doc, [x], answered)
            assert done.wait(60), f"no answer for {field}={value!r}"
            status, body = answers[0]
            assert status == 200, (field, body)
        # A batch of the preferred size 4 (probe_pair would hold a smaller one for its long delay)
        assert client.infer(model, {"INPUT0": np.zeros((4, 3), np.float32)})["REQS"].tolist() == [[1]] * 4
    assert server.worker_pids(model) == pids


KID = """
import sys, time, numpy as np
from shmserve.shm.client import Client
c = Client(sys.argv[1])
c.infer_async("probe_hold", {"INPUT0": np.zeros((1, 3), np.float32)})
print("sent", flush=True)
time.sleep(60)
"""


def test_a_client_killed_while_its_request_waits_in_the_worker(server, tmp_path):
    """Its queued request is dropped (or answered into the void); the others are served and the
    pending count returns to zero."""
    import subprocess
    import sys

    from conftest import ROOT as PROJECT
    with Busy(server, "probe_hold", tmp_path) as busy:
        kid = subprocess.Popen([sys.executable, "-c", KID, server.id], cwd=PROJECT, stdout=subprocess.PIPE, text=True)
        try:
            assert kid.stdout.readline().strip() == "sent"
            busy.pending += 1
            wait_pending(server, "probe_hold", busy.pending)  # the kid's request waits in the worker
            other = busy.send(1, 3)[0]
            kid.kill()
            kid.wait(60)
        finally:
            if kid.poll() is None:
                kid.kill()
                kid.wait(60)
            kid.stdout.close()
        assert busy.release()["reqs"] == 1
        assert other.result()["reqs"] >= 1
    wait_until(lambda: metric(server, "nv_inference_pending_request_count", "probe_hold") == 0,
               "the killed client's request no longer pending")
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
        deadline = time.monotonic() + 60  # the broker sees the departure within 1 s (on an idle host)
        while metric(server, "nv_inference_pending_request_count", "add_sub") != 0:
            assert time.monotonic() < deadline, "the unannounced record stays pending"
            np.testing.assert_array_equal(client.infer("add_sub", inputs).as_numpy("OUTPUT0"), 2 * a)
            time.sleep(0.2)
    finally:
        client.close()


def test_unload_serves_what_waits_in_the_worker_first(server_factory, tmp_path):
    s = server_factory.start([REPO], ["--model-control-mode", "explicit", "--load-model", "probe_hold"])
    client = httpclient.InferenceServerClient(s.url)
    try:
        with Busy(s, "probe_hold", tmp_path) as busy:
            queued = busy.send(2, 3)
            # The unload answers once the version has drained: the busy request is still held.
            unload = busy.pool.submit(raw_request, s.port, "POST", "/v2/repository/models/probe_hold/unload", b"{}",
                                      timeout=120)
            wait_until(lambda: not client.is_model_ready("probe_hold") or unload.done(), "the unload begun")
            assert not unload.done(), "the unload did not wait for the requests in the worker"
            assert busy.release()["reqs"] == 1
            assert [f.result()["reqs"] for f in queued] == [2, 2]
            assert unload.result().status == 200
        assert not client.is_model_ready("probe_hold")
    finally:
        client.close()


def test_pytorch_model_batches_under_concurrency(server):
    """64 requests sent at once (a local client's futures: no HTTP connection between them and the
    model's queue) run in fewer forwards, and each gets the rows of its own image."""
    from sklearn.datasets import load_digits

    from shmserve.shm.client import Client

    images = (load_digits().images[:64] / 16.0).astype(np.float32).reshape(64, 1, 1, 8, 8)
    before_count = metric(server, "nv_inference_count", "digits")
    before_exec = metric(server, "nv_inference_exec_count", "digits")
    with Client(server.id) as client:
        alone = client.infer("digits", {"INPUT__0": images[0]})["OUTPUT__0"].copy()
        futures = [client.infer_async("digits", {"INPUT__0": img}) for img in images]
        outs = [f.result(timeout=60)["OUTPUT__0"].copy() for f in futures]
    assert all(o.shape == (1, 10) for o in outs)
    np.testing.assert_allclose(outs[0], alone, rtol=1e-5, atol=1e-5)
    wait_until(lambda: metric(server, "nv_inference_count", "digits") - before_count >= 65, "the requests counted")
    count = metric(server, "nv_inference_count", "digits") - before_count
    execs = metric(server, "nv_inference_exec_count", "digits") - before_exec
    assert count == 65
    assert execs < count  # some requests ran together in one forward


def test_a_drained_queue_answers_each_batch_as_it_ends_and_takes_what_arrives_meanwhile(server, tmp_path):
    """One instance, a queue of batches that cannot share (widths differ): each answer goes out
    when its batch ends, not once the queue has drained (a round held them all, as Triton never
    does); and a request of higher priority that arrives while the queue drains runs next, not
    after the queue."""
    with Busy(server, "probe_prio", tmp_path) as busy:
        queued = [busy.send(1, width, 2, sleep_s=0.4)[0] for width in (3, 4)]  # low priority
        busy.release()
        time.sleep(0.15)  # the first queued batch runs now
        high = busy.pool.submit(infer_with, server.url, "probe_prio", 5, 1, sleep_s=0.4)
        first, second, urgent = queued[0].result(), queued[1].result(), high.result()
    assert urgent["order"] == first["order"] + 1 and second["order"] == urgent["order"] + 1
    # each answered as its batch ended: 0.4 s apart (they were all sent before the first ran)
    assert second["seconds"] - first["seconds"] >= 0.6, (first, second)


def test_a_model_that_does_not_batch_takes_the_dynamic_batchers_queue(server, tmp_path):
    """``max_batch_size: 0`` with ``dynamic_batching`` loads, as in Triton: the queue keeps its
    priorities, and each execution takes one request at once (the 30 s delay holds nothing)."""
    assert infer_with(server.url, "probe_unbatched")["seconds"] < LONG_DELAY_S / 2
    with Busy(server, "probe_unbatched", tmp_path) as busy:
        low = busy.send(2, 3, 2)
        high = busy.send(1, 5, 1)[0]
        busy_r = busy.release()
        low_a, low_b, high_r = (f.result() for f in (*low, high))
    assert high_r["order"] == busy_r["order"] + 1  # the higher priority first
    assert sorted([low_a["order"], low_b["order"]]) == [high_r["order"] + 1, high_r["order"] + 2]
    assert low_a["reqs"] == low_b["reqs"] == high_r["reqs"] == 1
