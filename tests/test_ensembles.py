"""Ensembles against a real server: results through a DAG of real models, independent steps in
parallel, a failing step named in the error, the bundled digits pipeline, and nested ensembles
(a step that is itself an ensemble), whose failures, leftovers and cycles are checked too."""
from __future__ import annotations

import concurrent.futures
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from gates import Gate
from shmserve.shm.channel import ClientSegment

ROOT = Path(__file__).resolve().parent.parent
# A nested step that nobody answers would hang the call: it fails after this instead.
NESTED_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([Path(__file__).parent / "models" / "ensembles", ROOT / "model_repository"])


def inputs(**arrays: np.ndarray) -> list:
    out = []
    for name, arr in arrays.items():
        t = httpclient.InferInput(name, list(arr.shape), "INT32")
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def test_dag_results_and_parallel_steps(server, tmp_path):
    x = np.array([1, 2, 3, 4], np.int32)
    y = np.array([10, 20, 30, 40], np.int32)
    gate = Gate(tmp_path / "gate")  # the steps pass the request's parameters on

    def par():
        client = server.client()
        try:
            return client.infer("par", inputs(X=x, Y=y), parameters={"gate": gate.param})
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            call = pool.submit(par)
            # The two independent steps are in their models at the same time: they run in parallel.
            assert len(set(gate.wait_started(2))) == 2
        finally:
            gate.open()
        result = call.result()
    np.testing.assert_array_equal(result.as_numpy("PRODUCT"), x * y)
    np.testing.assert_array_equal(result.as_numpy("RESULT"), (x + y) + x * y)
    add, mul, last = (result.as_numpy(n) for n in ("ADD_SPAN", "MUL_SPAN", "LAST_SPAN"))
    assert add[0] < mul[1] and mul[0] < add[1], (add, mul)  # their executions overlap
    assert last[0] >= max(add[1], mul[1]), (add, mul, last)  # the last step waited for both


def test_requested_output_subset(server):
    result = server.client().infer("par", inputs(X=np.ones(4, np.int32), Y=np.ones(4, np.int32)),
                                   outputs=[httpclient.InferRequestedOutput("PRODUCT")])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["PRODUCT"]


def test_a_step_without_model_version_is_warned_about(server):
    """Triton 2.51 reads an unset model_version as version 0 and refuses the load; here the step
    uses its latest version, and the load says so by name."""
    assert ("ensemble 'par': step 'slow_add' has model_version 0 (or none): Triton 2.51 would need a version 0 "
            "of it and refuse the load; shmserve uses its latest version (set model_version: -1 to say so)"
            in server.log())
    assert "ensemble 'digits_pipeline': step" not in server.log()  # its steps say -1


def test_an_ensembles_response_echoes_the_sequence_fields_as_tritons(server):
    """Triton's ensemble answers with the request's sequence id and flags as its parameters (and
    with no other parameter of the request), over HTTP and gRPC."""
    server.wait_grpc_ready()
    x = np.ones(4, np.int32)
    result = server.client().infer("par", inputs(X=x, Y=x), parameters={"custom": 5})
    assert result.get_response()["parameters"] == {"sequence_id": 0, "sequence_start": False, "sequence_end": False}
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        tensors = [grpcclient.InferInput(name, [4], "INT32") for name in ("X", "Y")]
        for t in tensors:
            t.set_data_from_numpy(x)
        params = g.infer("par", tensors, sequence_id="abc", sequence_end=True).get_response().parameters
        assert {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in params.items()} == {
            "sequence_id": "abc", "sequence_start": False, "sequence_end": True}


def test_failing_step_is_told_in_tritons_words(server):
    """The step's own error after "in ensemble 'E', ", as Triton says it (its text names the model)."""
    with pytest.raises(InferenceServerException) as e:
        server.client().infer("broken", inputs(X=np.ones(4, np.int32)))
    assert e.value.message().startswith("in ensemble 'broken', Failed to process the request(s) for model "
                                        "'failer_0', message: ValueError: boom from failer")
    # The ensemble and its steps keep serving.
    result = server.client().infer("par", inputs(X=np.ones(4, np.int32), Y=np.ones(4, np.int32)))
    np.testing.assert_array_equal(result.as_numpy("RESULT"), np.full(4, 3, np.int32))


def test_ensemble_metadata_and_config(server):
    client = server.client()
    meta = client.get_model_metadata("par")
    assert [i["name"] for i in meta["inputs"]] == ["X", "Y"]
    assert client.get_model_config("par")["platform"] == "ensemble"
    assert client.is_model_ready("digits_pipeline")


def test_bundled_digits_pipeline_classifies(server):
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = digits.images[:64].astype(np.uint8)
    t = httpclient.InferInput("IMAGE", list(images.shape), "UINT8")
    t.set_data_from_numpy(images)
    result = server.client().infer("digits_pipeline", [t])
    labels = result.as_numpy("LABEL").reshape(-1)
    assert (labels == digits.target[:64]).mean() >= 0.95
    assert result.as_numpy("PROB").shape == (64, 1)


def test_invalid_ensemble_config_is_refused(server_factory, tmp_path):
    repo = tmp_path / "repo"
    (repo / "bad_ens" / "1").mkdir(parents=True)
    (repo / "bad_ens" / "config.pbtxt").write_text(
        'name: "bad_ens" platform: "ensemble" max_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ 4 ] } ]\n'
        'output [ { name: "Z" data_type: TYPE_INT32 dims: [ 4 ] } ]\n'
        'ensemble_scheduling { step [ { model_name: "add_sub" input_map { key: "INPUT0" value: "nowhere" } '
        'output_map { key: "OUTPUT0" value: "Z" } } ] }\n')
    # Two steps write Z: its value would be whichever finished last (Triton refuses it, in these words)
    (repo / "twice_ens" / "1").mkdir(parents=True)
    step = ('{ model_name: "add_sub" model_version: -1 input_map [ { key: "INPUT0" value: "A" }, '
            '{ key: "INPUT1" value: "B" } ] output_map { key: "%s" value: "Z" } }')
    (repo / "twice_ens" / "config.pbtxt").write_text(
        'name: "twice_ens" platform: "ensemble" max_batch_size: 0\n'
        'input [ { name: "A" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "B" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
        'output [ { name: "Z" data_type: TYPE_FP32 dims: [ 16 ] } ]\n'
        f'ensemble_scheduling {{ step [ {step % "OUTPUT0"}, {step % "OUTPUT1"} ] }}\n')
    s = server_factory.start([repo, ROOT / "model_repository"], ["--exit-on-error=false"], wait=False)
    s.wait_until(lambda: s.http_status("/v2/models/add_sub/ready") == 200, "add_sub ready")
    index = {m["name"]: m for m in s.client().get_model_repository_index()}
    assert index["bad_ens"]["state"] == "UNAVAILABLE"
    assert "needs tensor(s) ['nowhere']" in index["bad_ens"]["reason"]
    assert index["twice_ens"]["state"] == "UNAVAILABLE"
    assert ("ensemble tensor 'Z' can appear in an output map only once for ensemble 'twice_ens' step 1"
            in index["twice_ens"]["reason"]), index["twice_ens"]


def nested_client(server) -> httpclient.InferenceServerClient:
    return server.client(network_timeout=NESTED_TIMEOUT_S, connection_timeout=NESTED_TIMEOUT_S)


def test_nested_ensemble_results(server):
    x = np.arange(16, dtype=np.int32)
    y = np.arange(100, 116, dtype=np.int32)
    client = nested_client(server)
    result = client.infer("outer", inputs(X=x, Y=y))  # outer's first step is the ensemble "inner"
    np.testing.assert_array_equal(result.as_numpy("SUM"), 2 * x + 2 * y)
    np.testing.assert_array_equal(result.as_numpy("DIFF"), 2 * x - 2 * y)
    np.testing.assert_array_equal(result.as_numpy("TWO_X"), 2 * x)  # inner's output passed straight out
    result = client.infer("deep", inputs(X=x))  # three levels: deep -> outer -> inner
    np.testing.assert_array_equal(result.as_numpy("OUT"), 4 * x)


def test_nested_ensemble_failure_reaches_the_outer_caller(server):
    client = nested_client(server)
    with pytest.raises(InferenceServerException) as direct:
        client.infer("broken", inputs(X=np.ones(4, np.int32)))
    with pytest.raises(InferenceServerException) as e:
        client.infer("outer_broken", inputs(X=np.ones(4, np.int32)))
    message = e.value.message()
    assert message == f"in ensemble 'outer_broken', {direct.value.message()}"  # the inner one's own text
    assert "boom from failer" in message
    assert e.value.status() == direct.value.status()


def arena_use(server) -> dict[tuple[str, str], float]:
    """Bytes in use in the broker's arena and each version's workers' output arenas."""
    for _ in range(2):  # the first scrape's answer lets the broker reclaim what was freed before it
        text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read()
    family = next(f for f in text_string_to_metric_families(text.decode()) if f.name == "shmserve_arena_bytes_in_use")
    return {(s.labels["owner"], s.labels.get("model", "")): s.value for s in family.samples}


def test_nested_ensembles_leave_nothing_behind(server):
    """Every step answer (a worker's block, or an inner ensemble's answer in the broker's arena) is
    freed and every slot of the broker's own client segment is free again."""
    x = np.arange(16, dtype=np.int32)
    client = nested_client(server)

    def one_round() -> None:
        client.infer("deep", inputs(X=x))
        client.infer("outer", inputs(X=x, Y=x))
        with pytest.raises(InferenceServerException):
            client.infer("outer_broken", inputs(X=np.ones(4, np.int32)))

    one_round()
    before = arena_use(server)
    for _ in range(8):
        one_round()
    after = arena_use(server)
    # A block never freed stalls its arena: all allocated after it stays in use and grows per round.
    for owner, used in after.items():
        assert used <= before.get(owner, 0) + 4096, (owner, before, after)
    own = ClientSegment.attach(f"/shmserve.{server.id}.client.broker")
    try:
        busy = [slot for slot in range(own.nslots) if own.slot_states[slot]]
    finally:
        own.close()
    assert busy == []


def write_ensemble(repo: Path, name: str, step: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}" platform: "ensemble" max_batch_size: 0\n'
        'input [ { name: "X" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        'output [ { name: "Z" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
        f'ensemble_scheduling {{ step [ {{ model_name: "{step}" input_map {{ key: "X" value: "X" }} '
        'output_map { key: "Z" value: "Z" } } ] }\n')


def test_ensemble_cycle_is_refused_at_load(server_factory, tmp_path):
    repo = tmp_path / "repo"
    write_ensemble(repo, "cyc_a", "cyc_b")
    write_ensemble(repo, "cyc_b", "cyc_a")
    write_ensemble(repo, "cyc_self", "cyc_self")
    s = server_factory.start([repo, ROOT / "model_repository"], ["--exit-on-error=false"], wait=False)
    s.wait_until(lambda: s.http_status("/v2/models/add_sub/ready") == 200, "add_sub ready")
    index = {m["name"]: m for m in s.client().get_model_repository_index()}
    assert index["cyc_a"]["state"] == "UNAVAILABLE"
    assert "circular dependency between ensembles: cyc_a -> ... -> cyc_b -> cyc_a" in index["cyc_a"]["reason"]
    assert index["cyc_b"]["state"] == "UNAVAILABLE"
    assert "circular dependency between ensembles: cyc_b -> ... -> cyc_a -> cyc_b" in index["cyc_b"]["reason"]
    assert index["cyc_self"]["state"] == "UNAVAILABLE"
    assert "circular dependency between ensembles: cyc_self" in index["cyc_self"]["reason"]
    assert s.http_status("/v2/models/cyc_a/ready") != 200


def test_a_local_client_gets_an_ensembles_outputs_in_the_room_it_reserved(server):
    """The local client reserves room in its request's block for outputs of a known size; the
    broker writes an ensemble's answer there (it used to take that room for a region and die)."""
    from shmserve import Client

    x, y = np.arange(16, dtype=np.int32), np.full(16, 3, dtype=np.int32)
    with Client(server.id) as local:
        for _ in range(3):
            result = local.infer("inner", {"X": x, "Y": y})
            np.testing.assert_array_equal(result["TWO_X"], 2 * x)
            np.testing.assert_array_equal(result["TWO_Y"], 2 * y)
        result = local.infer("digits_pipeline", {"IMAGE": np.zeros((2, 8, 8), np.uint8)})
        assert result["LABEL"].shape == (2, 1) and result["PROB"].shape == (2, 1)
    assert server.client().is_server_live()
