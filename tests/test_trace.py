"""Triton's trace extension (TIMESTAMPS): --trace-config, GET/POST v2[/models/<m>]/trace/setting,
and the records frontends, broker and workers write together (see shm/trace.py)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import DEADLINE_S, PRODUCT_MODELS, PYTHON, ROOT, TESTS, raw_request
from shmserve.shm.trace import GRPC_STAMPS, STAMPS, read_trace_file

REPOS = [TESTS / "models" / "batching", ROOT / "model_repository"]
STEP_STAMPS = STAMPS[2:STAMPS.index("REQUEST_END") + 1]  # a composing model's request: REQUEST_START ... REQUEST_END
MODELS = ["--model-control-mode", "explicit", "--load-model", "add_sub", "--load-model", "probe"]


def otel_installed() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.sdk.trace") is not None
    except ModuleNotFoundError:
        return False


def start(factory, path: Path, *config: str, workers: int = 1, models: tuple[str, ...] = ()):
    args = [*MODELS, "--http-workers", str(workers), "--trace-config", f"triton,file={path}"]
    for m in models:
        args += ["--load-model", m]
    for c in config:
        args += ["--trace-config", c]
    return factory.start(REPOS, args)


def add_sub(client: httpclient.InferenceServerClient, request_id: str = "") -> None:
    a = httpclient.InferInput("INPUT0", [16], "INT32")
    a.set_data_from_numpy(np.arange(16, dtype=np.int32))
    b = httpclient.InferInput("INPUT1", [16], "INT32")
    b.set_data_from_numpy(np.ones(16, dtype=np.int32))
    result = client.infer("add_sub", [a, b], request_id=request_id)
    assert result.as_numpy("OUTPUT0").tolist() == list(range(1, 17))


def grpc_add_sub_inputs() -> list[grpcclient.InferInput]:
    a = np.arange(16, dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return inputs


def probe(client: httpclient.InferenceServerClient) -> None:
    x = httpclient.InferInput("INPUT0", [1, 2], "FP32")
    x.set_data_from_numpy(np.ones((1, 2), dtype=np.float32))
    client.infer("probe", [x])


def stamps(record: dict) -> dict[str, int]:
    return {t["name"]: t["ns"] for t in record["timestamps"]}


def records(path: Path, expected: int, timeout: float = DEADLINE_S) -> list[dict]:
    """The file's records once it holds ``expected`` (a record is written after its response),
    and what else came in the 0.2 s after."""
    deadline = time.monotonic() + timeout
    found: list[dict] = []
    while time.monotonic() < deadline:
        found = read_trace_file(str(path)) if path.exists() else []
        if len(found) >= expected:
            break
        time.sleep(0.05)
    time.sleep(0.2)  # nothing more may arrive
    return read_trace_file(str(path)) if path.exists() else []


def assert_ordered(record: dict, names: tuple[str, ...] = STAMPS) -> None:
    ts = stamps(record)
    assert list(ts) == list(names), record
    values = [ts[name] for name in names]
    assert values == sorted(values), record


# -- the file -------------------------------------------------------------------------------------
def test_a_request_the_model_failed_is_traced_with_its_version_and_times(server_factory, tmp_path):
    """As Triton 2.51 traces them: an error response the model answered, and an execute that
    raised, are records of the version that ran them with every timestamp (they had version -1
    and no compute stamps); a request refused before a version's scheduler had it (an unknown
    model, a wrong datatype) has no record."""
    path = tmp_path / "trace.json"
    (tmp_path / "ens" / "ens_doubler" / "1").mkdir(parents=True)
    (tmp_path / "ens" / "ens_doubler" / "config.pbtxt").write_text(
        'name: "ens_doubler"\nplatform: "ensemble"\nmax_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_INT32 dims: [ -1 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "doubler" model_version: -1 input_map { key: "X" value: "X" } '
        'output_map { key: "Y" value: "Y" } } ] }\n')
    s = server_factory.start([TESTS / "models" / "bls", TESTS / "models" / "stats", tmp_path / "ens"], [
        "--model-control-mode", "explicit", "--load-model", "error_source", "--load-model", "doubler",
        "--load-model", "ens_doubler",
        "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=1"])
    client = s.client()
    code = httpclient.InferInput("CODE", [1], "INT32")
    code.set_data_from_numpy(np.array([3], np.int32))
    with pytest.raises(InferenceServerException, match="failed with code 3"):
        client.infer("error_source", [code], request_id="answered-an-error")
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([-999], np.int32))
    with pytest.raises(InferenceServerException, match="told to raise"):
        client.infer("doubler", [x], request_id="raised")
    with pytest.raises(InferenceServerException, match="told to raise"):  # (a failed ensemble: its version too)
        client.infer("ens_doubler", [x], request_id="ensemble-failed")
    wrong = httpclient.InferInput("X", [1], "FP32")
    wrong.set_data_from_numpy(np.array([1], np.float32))
    with pytest.raises(InferenceServerException, match="data-type"):
        client.infer("doubler", [wrong], request_id="wrong-datatype")
    with pytest.raises(InferenceServerException, match="nosuch"):
        client.infer("nosuch", [wrong], request_id="unknown-model")
    found = {r["request_id"]: r for r in records(path, 3)}
    assert set(found) == {"answered-an-error", "raised", "ensemble-failed"}, found
    for record in found.values():
        assert record["model_version"] == 1, record
        if record["model_name"] != "ens_doubler":  # (an ensemble's record has no compute timestamps)
            assert_ordered(record)


def test_an_ensembles_steps_are_traced_as_its_children(server_factory, tmp_path):
    """Triton traces each request an ensemble makes of a composing model as a trace of its own,
    whose ``parent_id`` is the ensemble request's: a nested ensemble's steps are the children of
    that step's trace. Each child takes an id, not a trace of the count, and carries the
    request's id; over gRPC alike. A trace and its children count as one for ``log_frequency``:
    each indexed file holds one request's. (Triton 2.51, side by side: the same records, the
    nested ensemble's with no compute stamps.)"""
    path = tmp_path / "trace.json"
    server = server_factory.start([ROOT / "model_repository", TESTS / "models" / "ensembles"],
                                  ["--model-control-mode", "explicit", "--load-model", "outer",
                                   "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                                   "--trace-config", "rate=1", "--trace-config", "count=2",
                                   "--trace-config", "triton,log-frequency=1"])
    x = np.arange(16, dtype=np.int32)
    with httpclient.InferenceServerClient(server.url) as client:
        inputs = [httpclient.InferInput("X", [16], "INT32"), httpclient.InferInput("Y", [16], "INT32")]
        for i in inputs:
            i.set_data_from_numpy(x)
        assert client.infer("outer", inputs, request_id="ens-1").as_numpy("SUM").tolist() == (4 * x).tolist()
    with grpcclient.InferenceServerClient(server.grpc_url) as grpc:
        inputs = [grpcclient.InferInput("X", [16], "INT32"), grpcclient.InferInput("Y", [16], "INT32")]
        for i in inputs:
            i.set_data_from_numpy(x)
        assert grpc.infer("outer", inputs, request_id="ens-2").as_numpy("SUM").tolist() == (4 * x).tolist()
    files = [records(Path(f"{path}.{index}"), 5) for index in (0, 1)]
    assert [sorted({r["request_id"] for r in group}) for group in files] == [["ens-1"], ["ens-2"]], files
    found = files[0] + files[1]
    assert len(found) == 10, found
    by_id = {r["id"]: r for r in found}
    assert len(by_id) == 10, "every trace has an id of its own"
    for request_id in ("ens-1", "ens-2"):
        mine = [r for r in found if r["request_id"] == request_id]
        (top,) = [r for r in mine if "parent_id" not in r]
        assert top["model_name"] == "outer"
        (inner,) = [r for r in mine if r["model_name"] == "inner"]
        assert inner["parent_id"] == top["id"]
        add_subs = [r for r in mine if r["model_name"] == "add_sub"]
        assert sorted(r["parent_id"] for r in add_subs) == sorted([inner["id"], inner["id"], top["id"]]), mine
        for step in add_subs:
            assert step["model_version"] == 1
            assert_ordered(step, STEP_STAMPS)
            assert stamps(by_id[step["parent_id"]])["REQUEST_START"] <= stamps(step)["REQUEST_START"]
            assert stamps(step)["REQUEST_END"] <= stamps(by_id[step["parent_id"]])["REQUEST_END"]
        assert [name for name in stamps(inner)] == ["REQUEST_START", "QUEUE_START", "REQUEST_END"], inner
    # Two traces of the count were taken: the children took none.
    with httpclient.InferenceServerClient(server.url) as client:
        assert client.get_trace_settings()["trace_count"] == "0"


def test_a_bls_request_made_with_the_requests_trace_is_traced_as_its_child(server_factory, tmp_path):
    """Triton traces a BLS request made with ``trace=request.trace()`` as a trace of its own whose
    ``parent_id`` is the calling request's (python_backend spawns a child trace): exec() and
    async_exec() alike. They were not traced at all, so a BLS model's time in the models it
    calls did not show. A request not sampled makes untraced BLS requests."""
    path = tmp_path / "trace.json"
    server = server_factory.start([ROOT / "model_repository", TESTS / "models" / "bls"],
                                  ["--model-control-mode", "explicit", "--load-model", "add_sub",
                                   "--load-model", "bls_traced", "--trace-config", f"triton,file={path}",
                                   "--trace-config", "level=TIMESTAMPS", "--trace-config", "rate=2"])
    x = np.arange(16, dtype=np.int32)
    with httpclient.InferenceServerClient(server.url) as client:
        inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
        for i in inputs:
            i.set_data_from_numpy(x)
        for _ in range(2):  # (at rate 2: the second is traced)
            assert client.infer("bls_traced", inputs).as_numpy("SUM").tolist() == (3 * x).tolist()
    found = records(path, 3)
    assert len(found) == 3, found
    (top,) = [r for r in found if "parent_id" not in r]
    assert top["model_name"] == "bls_traced"
    children = [r for r in found if "parent_id" in r]
    assert [(r["model_name"], r["model_version"], r["parent_id"]) for r in children] == [("add_sub", 1, top["id"])] * 2
    assert len({r["id"] for r in found}) == 3, "each has an id of its own"
    for child in children:
        assert_ordered(child, STEP_STAMPS)
        assert stamps(top)["COMPUTE_START"] <= stamps(child)["REQUEST_START"]
        assert stamps(child)["REQUEST_END"] <= stamps(top)["COMPUTE_END"]
    assert stamps(children[0])["REQUEST_END"] <= stamps(children[1])["REQUEST_START"], "the calls in their order"


def test_every_request_traced_at_rate_1(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    client = s.client()
    assert "trace" in client.get_server_metadata()["extensions"]
    for i in range(6):
        add_sub(client, f"req{i}")
    found = records(path, 6)
    assert len(found) == 6
    assert sorted(r["id"] for r in found) == list(range(1, 7))
    for r in found:
        assert r["model_name"] == "add_sub" and r["model_version"] == 1
        assert_ordered(r)
    assert sorted(r["request_id"] for r in found) == [f"req{i}" for i in range(6)]
    assert s.stop() == 0
    with open(path) as f:  # a complete JSON array once the server stopped, as Triton's
        assert len(json.load(f)) == 6


def test_rate_and_count(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=2")
    client = s.client()
    for _ in range(8):
        add_sub(client)
    assert len(records(path, 4)) == 4  # every second request
    client.update_trace_settings(settings={"trace_rate": "1", "trace_count": "3"})
    for _ in range(6):
        add_sub(client)
    assert len(records(path, 7)) == 7  # three more, then the count is spent
    assert client.get_trace_settings()["trace_count"] == "0"


def test_a_streamed_ensembles_steps_are_traced_once_as_children_of_the_stream(server_factory, tmp_path):
    """A decoupled ensemble on a gRPC stream: its decoupled step and the call of the next step for
    each of its three responses are children of the request's one trace, written once with it."""
    import queue

    path = tmp_path / "trace.json"
    server = server_factory.start([TESTS / "models" / "decens"],
                                  ["--model-control-mode", "explicit", "--load-model", "repeat_pipe",
                                   "--trace-config", f"triton,file={path}", "--trace-config", "level=TIMESTAMPS",
                                   "--trace-config", "rate=1"])
    got: queue.Queue = queue.Queue()
    n = grpcclient.InferInput("N", [1], "INT32")
    n.set_data_from_numpy(np.array([3], np.int32))
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("repeat_pipe", [n], request_id="s-1", enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=DEADLINE_S)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    found = records(path, 5)
    assert len(found) == 5, found
    (top,) = [r for r in found if "parent_id" not in r]
    assert top["model_name"] == "repeat_pipe" and top["request_id"] == "s-1"
    children = sorted(r["model_name"] for r in found if r.get("parent_id") == top["id"])
    assert children == ["repeat", "slow_log", "slow_log", "slow_log"], found


def test_a_count_of_zero_with_the_level_on_is_refused_whichever_post_leaves_it(server_factory, tmp_path):
    """Triton 2.51's rule, checked side by side: a setting whose count is 0 is invalid unless the
    level is OFF, whether a POST sets the count, the count ran out (the global one, or a model's
    own that a global change would carry on), or it was set under OFF and a later POST turns the
    level on; a POST that sets a count again is taken. (Triton keeps part of a global POST it
    refuses for a model; here a refused POST changes nothing.)"""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    client = s.client()

    def post(body: dict, model: str = "") -> tuple[int, dict]:
        response = raw_request(s.port, "POST", f"/v2/models/{model}/trace/setting" if model else
                               "/v2/trace/setting", json.dumps(body).encode())
        return response.status, response.json()

    assert post({"trace_count": "1"})[0] == 200
    add_sub(client)
    add_sub(client)
    assert client.get_trace_settings()["trace_count"] == "0"  # ran out
    for body in ({"trace_rate": "2"}, {"trace_level": ["TIMESTAMPS"]}):
        status, doc = post(body)
        assert status == 400 and doc["error"].startswith("Attempting to set invalid trace setting :"), doc
    assert post({"trace_level": ["OFF"]}) == (200, {**client.get_trace_settings(), "trace_level": ["OFF"]})
    assert post({"trace_count": "0"})[0] == 200  # under OFF
    status, doc = post({"trace_level": ["TIMESTAMPS"]})
    assert status == 400 and doc["error"].startswith("Attempting to set invalid trace setting :"), doc
    status, doc = post({"trace_level": ["TIMESTAMPS"], "trace_count": "2"})
    assert status == 200 and doc["trace_count"] == "2", doc
    status, doc = post({"trace_rate": "3"}, model="add_sub")
    assert status == 200 and (doc["trace_rate"], doc["trace_count"]) == ("3", "2"), doc
    # A model's own count that ran out: a global change the model follows would leave it on with 0.
    assert post({"trace_count": "1"}, model="probe")[0] == 200
    probe(client)
    probe(client)
    assert client.get_trace_settings(model_name="probe")["trace_count"] == "0"
    status, doc = post({"trace_rate": "2"})
    assert status == 400 and doc["error"].startswith("Attempting to set invalid trace setting :"), doc
    assert client.get_trace_settings()["trace_rate"] == "1", "a refused POST changes nothing"
    status, doc = post({"trace_level": ["OFF"]})
    assert status == 200 and client.get_trace_settings(model_name="probe")["trace_level"] == ["OFF"], doc


def test_count_at_start_and_defaults(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", "count=3")
    client = s.client()
    assert client.get_trace_settings() == {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "3",
                                           "log_frequency": "0", "trace_file": str(path), "trace_mode": "triton"}
    for _ in range(5):
        add_sub(client)
    assert len(records(path, 3)) == 3


def test_a_relative_trace_file_is_shown_as_given(server_factory, tmp_path):
    """As Triton: the API shows the file as the flag named it; the traces go where it points from
    the directory the server started in."""
    path = tmp_path / "trace.json"
    given = os.path.relpath(path, ROOT)  # (the servers start in ROOT)
    s = start(server_factory, Path(given), "level=TIMESTAMPS", "rate=1")
    client = s.client()
    assert client.get_trace_settings()["trace_file"] == given
    with grpcclient.InferenceServerClient(s.wait_grpc_ready().grpc_url) as g:
        assert g.get_trace_settings(as_json=True)["settings"]["trace_file"]["value"] == [given]
    add_sub(client)
    assert len(records(path, 1)) == 1
    # What a GET shows may be posted back; a model's own file is its own; null goes back to the flag's.
    assert client.update_trace_settings(settings={"trace_file": given})["trace_file"] == given
    add_sub(client)
    assert len(records(path, 2)) == 2  # (still the flag's file)
    assert client.update_trace_settings(model_name="probe", settings={"trace_file": "probe.json"})["trace_file"] \
        == "probe.json"
    assert client.get_trace_settings()["trace_file"] == given
    assert client.update_trace_settings(settings={"trace_file": "other.json"})["trace_file"] == "other.json"
    assert client.update_trace_settings(settings={"trace_file": given})["trace_file"] == given
    client.update_trace_settings(settings={"trace_file": "other.json"})
    assert client.update_trace_settings(settings={"trace_file": None})["trace_file"] == given
    assert client.get_trace_settings(model_name="probe")["trace_file"] == "probe.json"


def test_a_rate_of_zero_is_taken_only_while_the_level_is_off(server_factory, tmp_path):
    """As Triton 2.51: a setting that traces nothing is refused only while tracing is on."""
    s = start(server_factory, tmp_path / "trace.json")
    client = s.client()
    assert client.update_trace_settings(settings={"trace_rate": "0"})["trace_rate"] == "0"
    add_sub(client)  # (tracing is off: nothing samples at rate 0)
    refusal = "Attempting to set invalid trace setting :sample rate must be non-zero"  # Triton's
    for body in ({"trace_level": ["TIMESTAMPS"]}, {"trace_level": ["TIMESTAMPS"], "trace_rate": "0"}):
        r = raw_request(s.port, "POST", "/v2/trace/setting", json.dumps(body).encode())
        assert (r.status, r.json()) == (400, {"error": refusal}), r
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    assert client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})["trace_rate"] == "1"
    add_sub(client)
    assert len(records(tmp_path / "trace.json", 1)) == 1


def test_untraced_by_default(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path)
    client = s.client()
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    assert client.get_trace_settings()["trace_rate"] == "1000"  # Triton's default
    for _ in range(3):
        add_sub(client)
    assert not path.exists()


# -- settings -------------------------------------------------------------------------------------
def test_per_model_settings_override_and_clear(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path)  # level OFF globally
    client = s.client()
    answer = client.update_trace_settings(model_name="add_sub", settings={"trace_level": ["TIMESTAMPS"],
                                                                         "trace_rate": "1"})
    assert answer["trace_level"] == ["TIMESTAMPS"] and answer["trace_rate"] == "1"
    assert client.get_trace_settings()["trace_level"] == ["OFF"]
    for _ in range(3):
        add_sub(client)
        probe(client)
    found = records(path, 3)
    assert [r["model_name"] for r in found] == ["add_sub"] * 3
    # The keys the model does not set follow the global ones.
    client.update_trace_settings(settings={"log_frequency": "0", "trace_count": "-1", "trace_rate": "7"})
    assert client.get_trace_settings(model_name="add_sub")["trace_rate"] == "1"
    # null clears a key of the model: its level falls back on the global OFF.
    answer = client.update_trace_settings(model_name="add_sub", settings={"trace_level": None})
    assert answer["trace_level"] == ["OFF"] and answer["trace_rate"] == "1"
    for _ in range(3):
        add_sub(client)
    assert len(records(path, 4, timeout=1.0)) == 3  # (none of the three traced: no fourth record comes)
    answer = client.update_trace_settings(model_name="add_sub", settings={"trace_rate": None})
    assert answer == client.get_trace_settings()  # nothing of its own left


def test_runtime_change_reaches_every_frontend_and_count_is_exact(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", "count=5", workers=2)

    def one(i: int) -> None:
        add_sub(httpclient.InferenceServerClient(s.url))  # a new connection: either frontend

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(40)))
    found = records(path, 5)
    assert sorted(r["id"] for r in found) == [1, 2, 3, 4, 5]
    s.client().update_trace_settings(settings={"trace_count": "4"})
    time.sleep(0.6)  # the other frontend follows within a quarter second
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(40)))
    found = records(path, 9)
    assert sorted(r["id"] for r in found) == list(range(1, 10))
    for r in found:
        assert_ordered(r)


def test_log_frequency_starts_new_files(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", "triton,log-frequency=2")
    client = s.client()
    assert client.get_trace_settings()["log_frequency"] == "2"
    for _ in range(5):
        add_sub(client)
    first = Path(f"{path}.0")
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and not Path(f"{path}.2").exists():
        time.sleep(0.05)
    for k in (0, 1):  # full files are complete JSON arrays at once
        with open(f"{path}.{k}") as f:
            assert len(json.load(f)) == 2
    assert first.exists() and not path.exists()
    assert s.stop() == 0
    with open(f"{path}.2") as f:
        assert len(json.load(f)) == 1
    ids = [r["id"] for k in range(3) for r in json.load(open(f"{path}.{k}"))]
    assert sorted(ids) == [1, 2, 3, 4, 5]


def test_trace_file_changes_only_inside_its_directory(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    client = s.client()
    other = tmp_path / "other.json"
    assert client.update_trace_settings(settings={"trace_file": str(other)})["trace_file"] == str(other)
    add_sub(client)
    assert len(records(other, 1)) == 1
    for bad in ("/tmp/elsewhere.json", str(tmp_path / "sub" / "x.json"), str(tmp_path / ".." / "x.json")):
        with pytest.raises(InferenceServerException, match="trace_file"):
            client.update_trace_settings(settings={"trace_file": bad})


@pytest.mark.parametrize("body,needle", [
    ({"trace_rate": "abc"}, "trace_rate"),
    ({"trace_count": "-2"}, "trace_count"),
    ({"trace_level": ["TIMESTAMPS"], "trace_count": "0"}, "Attempting to set invalid trace setting :"),  # Triton's
    ({"log_frequency": "-1"}, "log_frequency"),
    ({"trace_level": ["TENSORS"]}, "TENSORS"),
    ({"trace_level": ["LOUD"]}, "LOUD"),
    ({"trace_level": ["timestamps"]}, "unknown trace level 'timestamps'"),  # (Triton's POST is exact: ignored there)
    ({"trace_level": "TIMESTAMPS", "trace_file": ""}, "trace file"),
    ({"trace_mode": "opentelemetry"}, "trace_mode"),
    ({"trace_colour": "red"}, "trace_colour"),
    ({"trace_level": ["OFF", "TIMESTAMPS"]}, "Expect only one trace level 'OFF' is specified"),  # Triton's
    ([1, 2], "JSON object"),
])
def test_bad_values_are_400(bad_values_server, body, needle):
    s = bad_values_server
    r = raw_request(s.port, "POST", "/v2/trace/setting", json.dumps(body).encode())
    assert r.status == 400 and needle in r.json()["error"], r


@pytest.fixture(scope="module")
def bad_values_server(module_factory, tmp_path_factory):
    """One server for the parametrized checks (bad values change nothing)."""
    s = start(module_factory, tmp_path_factory.mktemp("trace") / "trace.json")
    yield s
    assert s.client().get_trace_settings()["trace_rate"] == "1000"


def test_a_cleared_global_key_goes_back_to_its_start_value(server_factory, tmp_path):
    """As Triton 2.51: null resets a global key to what the server started with, and an empty
    trace_level list changes nothing (it was refused, and switched tracing off)."""
    s = start(server_factory, tmp_path / "trace.json")
    client = s.client()
    started = client.get_trace_settings()
    client.update_trace_settings(settings={"trace_rate": "7", "log_frequency": "3"})
    assert client.get_trace_settings()["trace_rate"] == "7"
    r = raw_request(s.port, "POST", "/v2/trace/setting", b'{"trace_rate": null, "trace_level": []}')
    assert r.status == 200, r
    now = client.get_trace_settings()
    assert (now["trace_rate"], now["trace_level"], now["log_frequency"]) == (
        started["trace_rate"], started["trace_level"], "3")


def test_unknown_model_and_bad_json(server_factory, tmp_path):
    s = start(server_factory, tmp_path / "trace.json")
    r = raw_request(s.port, "POST", "/v2/models/nope/trace/setting", b'{"trace_rate": "1"}')
    assert r.status == 400 and r.json() == {"error": "Request for unknown model : nope"}  # Triton 2.51's
    r = raw_request(s.port, "POST", "/v2/trace/setting", b"{not json")
    assert r.status == 400
    assert s.client().get_trace_settings()["trace_rate"] == "1000"


# -- what each process adds --------------------------------------------------------------------------
def test_batched_and_direct_requests_are_timed_end_to_end(server_factory, tmp_path):
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    client = s.client()
    add_sub(client)  # direct: frontend -> worker
    probe(client)  # dynamic batching: through the broker, which holds it up to 0.3 s for a batch
    found = {r["model_name"]: r for r in records(path, 2)}
    assert set(found) == {"add_sub", "probe"}
    for r in found.values():
        assert_ordered(r)
        ts = stamps(r)
        assert ts["QUEUE_START"] <= ts["COMPUTE_START"] <= ts["COMPUTE_END"] <= ts["REQUEST_END"]
    batched = stamps(found["probe"])
    assert batched["COMPUTE_START"] - batched["QUEUE_START"] > 0.2e9  # the broker's queue, not the lane's
    assert batched["QUEUE_START"] > batched["REQUEST_START"]


def test_grpc_inferences_are_traced_with_grpc_timestamps(server_factory, tmp_path):
    """gRPC ModelInfer calls share the server's trace ids and count with HTTP requests; their
    records name the frontend's stamps as Triton's gRPC frontend does. A TraceSetting call applies
    in the gRPC frontend at once."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1")
    add_sub(s.client(), "http")
    inputs = grpc_add_sub_inputs()
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        for i in range(2):
            g.infer("add_sub", inputs, request_id=f"grpc{i}")
        g.update_trace_settings(settings={"trace_count": "1"})  # one more trace
        for i in range(2, 5):
            g.infer("add_sub", inputs, request_id=f"grpc{i}")
    found = records(path, 4)
    assert sorted(r["id"] for r in found) == [1, 2, 3, 4]
    by_request = {r["request_id"]: r for r in found}
    assert sorted(by_request) == ["grpc0", "grpc1", "grpc2", "http"]
    assert_ordered(by_request["http"])
    for name in ("grpc0", "grpc1", "grpc2"):
        assert by_request[name]["model_name"] == "add_sub" and by_request[name]["model_version"] == 1
        assert_ordered(by_request[name], GRPC_STAMPS)


def test_a_grpc_call_refused_for_its_inputs_is_not_traced(server_factory, tmp_path):
    """Triton samples a ModelInfer call once its request is built: a call whose input carries no
    data is refused untraced and takes nothing from trace_count, which the next call then uses."""
    path = tmp_path / "trace.json"
    s = start(server_factory, path, "level=TIMESTAMPS", "rate=1", "count=1")
    a = np.arange(16, dtype=np.int32)
    inputs = [grpcclient.InferInput("INPUT0", [16], "INT32"), grpcclient.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(a)  # INPUT1 has none
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        with pytest.raises(InferenceServerException) as e:
            g.infer("add_sub", inputs, request_id="refused")
        assert "unable to find data for input tensor 'INPUT1'" in e.value.message(), e.value.message()
        inputs[1].set_data_from_numpy(a)
        g.infer("add_sub", inputs, request_id="served")
        g.infer("add_sub", inputs, request_id="past the count")
    found = records(path, 1)
    assert [r["request_id"] for r in found] == ["served"], found
    assert_ordered(found[0], GRPC_STAMPS)


def test_traced_requests_with_large_bodies_and_answers(server_factory, tmp_path):
    """Traced requests take the ASGI path, where a large answer joined on both cores arrives as a
    memoryview: 8 MiB each way, in the body and back, byte for byte, and timed."""
    path = tmp_path / "trace.json"
    s = server_factory.start([TESTS / "models" / "main"], ["--model-control-mode", "explicit", "--load-model",
                                                           "identity_all", "--trace-config", f"triton,file={path}",
                                                           "--trace-config", "level=TIMESTAMPS",
                                                           "--trace-config", "rate=1"])
    client = s.client()
    data = np.random.default_rng(3).random((2, 1 << 20), dtype=np.float32)
    for binary in (True, False):  # the answer as binary data, and as JSON (a large body all the same)
        x = httpclient.InferInput("IN_FP32", list(data.shape), "FP32")
        x.set_data_from_numpy(data)
        result = client.infer("identity_all", [x], outputs=[httpclient.InferRequestedOutput("OUT_FP32",
                                                                                             binary_data=binary)])
        np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), data)
    found = records(path, 2)
    assert len(found) == 2
    for r in found:
        assert r["model_name"] == "identity_all"
        assert_ordered(r)


# -- flags and OpenTelemetry -----------------------------------------------------------------------------
@pytest.mark.parametrize("flag,needle", [
    ("rate=-1", "trace_rate"),
    ("level=TENSORS", "TENSORS"),
    ("colour=red", "unknown setting 'colour'"),
    ("jaeger,url=x", "unknown mode"),
    ("level", "--trace-config option format is '<trace mode>,<setting>=<value>'. Got level"),
    ("opentelemetry,bsp_schedule_delay=soon", "bsp_schedule_delay"),
    ("opentelemetry,resource=shmserve", "a resource is <key>=<value>"),
    ("opentelemetry,bsp_max_export_batch_size=4096", "exceeds bsp_max_queue_size=2048"),
])
def test_bad_flags_are_one_line_errors(flag, needle, tmp_path):
    cmd = [PYTHON, "-m", "shmserve", "--model-repository", str(ROOT / "model_repository"), "--trace-config", flag]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and needle in p.stderr, p.stderr


@pytest.mark.parametrize("setting", ["rate=0", "count=0"])
def test_a_setting_that_traces_nothing_with_tracing_on_is_refused_at_start(tmp_path, setting):
    cmd = [PYTHON, "-m", "shmserve", "--model-repository", str(ROOT / "model_repository"),
           "--trace-config", "level=TIMESTAMPS", "--trace-config", f"triton,file={tmp_path / 't.json'}",
           "--trace-config", setting]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and f"{setting} traces nothing" in p.stderr, p.stderr


def test_timestamps_without_file_is_refused():
    cmd = [PYTHON, "-m", "shmserve", "--model-repository", str(ROOT / "model_repository"),
           "--trace-config", "level=TIMESTAMPS"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert p.returncode == 2 and "triton,file=" in p.stderr


def test_opentelemetry_mode_without_the_sdk_exits_2(tmp_path):
    """The dev set-up installs the SDK; a package first on the path that refuses to import hides
    it, as on a host where it was never installed."""
    import os

    hidden = tmp_path / "opentelemetry"
    hidden.mkdir()
    (hidden / "__init__.py").write_text("raise ImportError('opentelemetry is not installed here')\n")
    cmd = [PYTHON, "-m", "shmserve", "--model-repository", str(ROOT / "model_repository"),
           "--trace-config", "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30, env=env)
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "OpenTelemetry SDK" in p.stderr, p.stderr


class _Collector(BaseHTTPRequestHandler):
    bodies: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        if self.path == "/v1/traces":
            _Collector.bodies.append(body)
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def collected_spans(expected: int) -> list:
    """The spans the collector received, once there are ``expected`` (or the deadline passed)."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    spans: list = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline and len(spans) < expected:
        time.sleep(0.2)
        spans = []
        for body in list(_Collector.bodies):
            req = ExportTraceServiceRequest.FromString(body)
            spans += [sp for rs in req.resource_spans for ss in rs.scope_spans for sp in ss.spans]
    return spans


def test_opentelemetry_spans_reach_an_otlp_collector(server_factory):
    assert otel_installed(), "the dev set-up installs shmserve[trace]"
    _Collector.bodies.clear()
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
        s = server_factory.start(REPOS, [*MODELS, "--trace-config", "mode=opentelemetry", "--trace-config",
                                         "level=max", "--trace-config", "rate=1", "--trace-config",
                                         f"opentelemetry,url={url}", "--trace-config",
                                         "opentelemetry,resource=deployment.environment=test", "--trace-config",
                                         "opentelemetry,bsp_schedule_delay=200"])
        client = s.client()
        # As Triton's: no trace file in this mode, and the mode's settings as given, then the
        # batch span processor's defaults ("max", Triton's old name of the level, is TIMESTAMPS)
        assert client.get_trace_settings() == {
            "trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1", "trace_mode": "opentelemetry",
            "url": url, "resource": "deployment.environment=test", "bsp_schedule_delay": "200",
            "bsp_max_queue_size": "2048", "bsp_max_export_batch_size": "512"}
        grpc_settings = grpcclient.InferenceServerClient(s.grpc_url).get_trace_settings(as_json=True)["settings"]
        assert grpc_settings["bsp_schedule_delay"] == {"value": ["200"]} and "trace_file" not in grpc_settings
        for _ in range(3):
            add_sub(client)
        spans = collected_spans(3)
        assert len(spans) == 3
        for sp in spans:
            assert sp.name == "InferRequest"
            assert [e.name for e in sp.events] == list(STAMPS)
            times = [e.time_unix_nano for e in sp.events]
            assert times == sorted(times)
            attrs = {a.key: a.value for a in sp.attributes}
            assert attrs["triton.model_name"].string_value == "add_sub"
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        resource = {a.key: a.value.string_value for body in _Collector.bodies
                    for rs in ExportTraceServiceRequest.FromString(body).resource_spans for a in rs.resource.attributes}
        assert resource["deployment.environment"] == "test" and resource["service.name"] == "shmserve"
    finally:
        collector.shutdown()


def test_trace_segments_reads_http_and_grpc_traces_side_by_side(server_factory, tmp_path):
    """tools/trace_segments.py: the median of every segment of the path, a column per file set
    (HTTP requests in one file, gRPC in another), each column counting its complete requests."""
    http_file, grpc_file = tmp_path / "http.json", tmp_path / "grpc.json"
    s = start(server_factory, http_file, "level=TIMESTAMPS", "rate=1")
    client = s.client()
    for _ in range(4):
        add_sub(client)
    client.update_trace_settings(settings={"trace_file": str(grpc_file)})
    inputs = grpc_add_sub_inputs()
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        for _ in range(3):
            g.infer("add_sub", inputs)
    records(http_file, 4)
    records(grpc_file, 3)
    run = subprocess.run([PYTHON, "-m", "shmserve.tools.trace_segments", f"http={http_file}*", f"grpc={grpc_file}*"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in run.stdout.splitlines()[2:]}
    assert rows["requests"] == ["4", "3"]
    segments = [f"{a} to {b}" for a, b in zip(STAMPS, STAMPS[1:])]
    assert list(rows)[:len(segments)] == segments  # named after the first column's path
    whole = rows["the whole request in the server"]
    for k in range(2):
        parts = [float(rows[name][k]) for name in segments]
        assert all(p >= 0 for p in parts) and float(whole[k]) > 0
    missing = subprocess.run([PYTHON, "-m", "shmserve.tools.trace_segments", f"none={tmp_path}/nothing*"],
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "expected NAME=GLOB" in missing.stderr


def test_a_setting_changed_through_one_frontend_applies_to_the_next_request_of_another(server_factory, tmp_path):
    """Triton applies a trace setting at once. Here each frontend is a process of its own: one that
    answered the change follows it at once, and the others must too, at their next request, not on
    their next tick (until then their old setting objects claimed no trace: requests went untraced)."""
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    s = start(server_factory, first)  # level OFF
    client = s.client()
    inputs = grpc_add_sub_inputs()
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        g.infer("add_sub", inputs)  # the gRPC frontend is up and has read the settings
        add_sub(client)
        for _ in range(20):
            # on through gRPC, then at once an HTTP request
            g.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"})
            add_sub(client, "http-after-on")
            # a new file through HTTP, then at once a gRPC request
            client.update_trace_settings(settings={"trace_file": str(second)})
            g.infer("add_sub", inputs, request_id="grpc-after-file")
            client.update_trace_settings(settings={"trace_level": ["OFF"], "trace_file": str(first)})
    in_first = [r["request_id"] for r in records(first, 20)]
    in_second = [r["request_id"] for r in records(second, 20)]
    assert in_first == ["http-after-on"] * 20
    assert in_second == ["grpc-after-file"] * 20


def test_tracing_switched_on_without_a_file_is_refused_in_tritons_words(server_factory):
    """A server started with no trace file: switching tracing on names none, Triton's 400 (its
    text, the colon where Triton puts it: clients match on it)."""
    s = server_factory.start([PRODUCT_MODELS])
    r = raw_request(s.port, "POST", "/v2/trace/setting", json.dumps({"trace_level": ["TIMESTAMPS"]}).encode())
    assert (r.status, r.json()) == (400, {"error": "Attempting to set invalid trace setting :trace file name is "
                                                   "not given"})



def test_an_ensembles_steps_are_spans_under_its_own(server_factory):
    """In OpenTelemetry mode an ensemble's composing requests are spans whose parent is the span of
    the request that made them (the ensemble's, or a nested ensemble step's), in its trace."""
    _Collector.bodies.clear()
    collector = ThreadingHTTPServer(("127.0.0.1", 0), _Collector)
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
        s = server_factory.start([ROOT / "model_repository", TESTS / "models" / "ensembles"],
                                 ["--model-control-mode", "explicit", "--load-model", "outer", "--trace-config",
                                  "mode=opentelemetry", "--trace-config", "level=TIMESTAMPS", "--trace-config",
                                  "rate=1", "--trace-config", f"opentelemetry,url={url}", "--trace-config",
                                  "opentelemetry,bsp_schedule_delay=200"])
        x = np.arange(16, dtype=np.int32)
        inputs = [httpclient.InferInput("X", [16], "INT32"), httpclient.InferInput("Y", [16], "INT32")]
        for i in inputs:
            i.set_data_from_numpy(x)
        s.client().infer("outer", inputs)
        spans = collected_spans(5)
        assert len(spans) == 5, spans
        model = {sp.span_id: {a.key: a.value for a in sp.attributes}["triton.model_name"].string_value for sp in spans}
        (top,) = [sp for sp in spans if not sp.parent_span_id]
        assert model[top.span_id] == "outer" and {sp.trace_id for sp in spans} == {top.trace_id}
        (inner,) = [sp for sp in spans if model[sp.span_id] == "inner"]
        assert inner.parent_span_id == top.span_id
        assert sorted(sp.parent_span_id for sp in spans if model[sp.span_id] == "add_sub") == \
            sorted([inner.span_id, inner.span_id, top.span_id])
    finally:
        collector.shutdown()
