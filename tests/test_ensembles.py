"""Ensembles against a real server: results through a DAG of real models, independent steps in
parallel, a failing step named in the error, and the bundled digits pipeline."""
from __future__ import annotations

import concurrent.futures
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from gates import Gate

ROOT = Path(__file__).resolve().parent.parent


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


def test_failing_step_is_named(server):
    with pytest.raises(InferenceServerException) as e:
        server.client().infer("broken", inputs(X=np.ones(4, np.int32)))
    assert "in ensemble 'broken', step 'failer' failed" in e.value.message()
    assert "boom from failer" in e.value.message()
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
    s = server_factory.start([repo, ROOT / "model_repository"], ["--exit-on-error=false"], wait=False)
    s.wait_until(lambda: s.http_status("/v2/models/add_sub/ready") == 200, "add_sub ready")
    index = s.client().get_model_repository_index()
    bad = [m for m in index if m["name"] == "bad_ens"][0]
    assert bad["state"] == "UNAVAILABLE"
    assert "needs tensor(s) ['nowhere']" in bad["reason"]
