"""Ensembles that mix batching and non-batching models, against a real server over HTTP and gRPC:
as in Triton's ensemble scheduler, a tensor made without batching gets a batch dimension of 1
going into a batching step and loses it going out, so such pipelines run with the right values;
a batching ensemble may hold a non-batching step, but not a batching step of a smaller
max_batch_size; and tensors a step does not take (type, shape, unmapped or unknown inputs) are
refused at load with Triton's texts."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

MODELS = Path(__file__).parent / "models" / "mixed_batching"
X = np.arange(16, dtype=np.int32)
READY = ["flat_pipeline", "mixed_fan", "direct_batch", "batched_over_flat", "nested_mixed"]

# A batching ensemble over a batching step that allows smaller batches: Triton refuses it.
TOO_LARGE = """name: "too_large"
platform: "ensemble"
max_batch_size: 16
input [ { name: "X" data_type: TYPE_INT32 dims: [ 16 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 16 ] } ]
ensemble_scheduling {
  step [ { model_name: "batch_inc" input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "Y" } } ]
}
"""


def one_step(name: str, x: str, step: str, input_map: str) -> str:
    """A non-batching ensemble of one step, whose input X is declared as ``x``."""
    return (f'name: "{name}" platform: "ensemble" max_batch_size: 0\n'
            f'input [ {{ name: "X" {x} }} ]\n'
            'output [ { name: "Y" data_type: TYPE_INT32 dims: [ 16 ] } ]\n'
            f'ensemble_scheduling {{ step [ {{ model_name: "{step}" input_map [ {input_map} ] '
            f'output_map {{ key: "{"SUM" if step == "batch_add" else "OUT"}" value: "Y" }} }} ] }}\n')


# Ensembles whose tensors their steps do not take: each refused at load with Triton's text.
REFUSED = {
    "too_large": ("ensemble too_large allows maximum batch size 16, but it contains model batch_inc which only "
                  "allows maximum batch size to be 8"),
    "bad_type": ("in ensemble bad_type, ensemble tensor X: inconsistent data type: TYPE_FP32 is inferred from "
                 "model bad_type while TYPE_INT32 is inferred from model batch_inc"),
    "bad_shape": ("in ensemble bad_shape, ensemble tensor X: inconsistent shape: [8] is inferred from model "
                  "bad_shape while [-1,16] is inferred from model batch_inc"),
    "unmapped": "in ensemble unmapped, input B in model batch_add is not mapped to any ensemble tensors",
    "no_such_input": ("in ensemble no_such_input, ensemble tensor X is mapping to non-existing input NOPE in "
                      "model flat_double"),
}
REFUSED_CONFIGS = {
    "too_large": TOO_LARGE,
    "bad_type": one_step("bad_type", 'data_type: TYPE_FP32 dims: [ 16 ]', "batch_inc", '{ key: "IN" value: "X" }'),
    "bad_shape": one_step("bad_shape", 'data_type: TYPE_INT32 dims: [ 8 ]', "batch_inc", '{ key: "IN" value: "X" }'),
    "unmapped": one_step("unmapped", 'data_type: TYPE_INT32 dims: [ 16 ]', "batch_add", '{ key: "A" value: "X" }'),
    "no_such_input": one_step("no_such_input", 'data_type: TYPE_INT32 dims: [ 16 ]', "flat_double",
                              '{ key: "IN" value: "X" }, { key: "NOPE" value: "X" }'),
}


@pytest.fixture(scope="module")
def server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("mixed") / "repo"
    shutil.copytree(MODELS, repo)
    for name, config in REFUSED_CONFIGS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(config)
    s = module_factory.start([repo], ["--exit-on-error=false"], wait=False)
    for name in READY:
        s.wait_until(lambda name=name: s.http_status(f"/v2/models/{name}/ready") == 200, f"{name} ready")
    return s


def infer(server, protocol: str, model: str, x: np.ndarray, outputs: list[str]) -> dict[str, np.ndarray]:
    """The named outputs of one request to ``model`` over HTTP or gRPC."""
    lib = httpclient if protocol == "http" else grpcclient
    url = server.url if protocol == "http" else server.grpc_url
    client = lib.InferenceServerClient(url)
    try:
        i = lib.InferInput("X", list(x.shape), "INT32")
        i.set_data_from_numpy(x)
        result = client.infer(model, [i], outputs=[lib.InferRequestedOutput(n) for n in outputs])
        return {n: result.as_numpy(n) for n in outputs}
    finally:
        client.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_non_batching_batching_non_batching_pipeline(server, protocol):
    out = infer(server, protocol, "flat_pipeline", X, ["Y", "RANK"])
    assert out["Y"].shape == (16,)
    np.testing.assert_array_equal(out["Y"], 2 * (2 * X + 1))
    # The batching step got [1, 16]; its [1, 1] output left the non-batching ensemble as [1].
    assert out["RANK"].tolist() == [2]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_fan_out_and_in_over_both_kinds(server, protocol):
    out = infer(server, protocol, "mixed_fan", X, ["SUM"])
    assert out["SUM"].shape == (16,)
    np.testing.assert_array_equal(out["SUM"], (X + 1) + 2 * X)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_ensemble_input_into_a_batching_step(server, protocol):
    out = infer(server, protocol, "direct_batch", X, ["Y"])
    assert out["Y"].shape == (16,)
    np.testing.assert_array_equal(out["Y"], X + 1)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_batching_ensemble_over_a_non_batching_step(server, protocol):
    out = infer(server, protocol, "batched_over_flat", X.reshape(1, 16), ["Y"])
    assert out["Y"].shape == (1, 16)
    np.testing.assert_array_equal(out["Y"], 2 * X.reshape(1, 16))
    # A batch of 2 cannot be one [16] tensor: the step refuses it, as in Triton.
    with pytest.raises(InferenceServerException) as e:
        infer(server, protocol, "batched_over_flat", np.stack([X, X]), ["Y"])
    assert "unexpected shape for input 'IN' for model 'flat_double'. Expected [16], got [2,16]" in e.value.message()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_nested_ensemble_of_the_other_kind(server, protocol):
    out = infer(server, protocol, "nested_mixed", X, ["Y"])
    assert out["Y"].shape == (16,)
    np.testing.assert_array_equal(out["Y"], 2 * X)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_ensembles_whose_steps_cannot_take_their_tensors_are_refused(server, name):
    index = {m["name"]: m for m in server.client().get_model_repository_index()}
    assert index[name]["state"] == "UNAVAILABLE"
    assert REFUSED[name] in index[name]["reason"]
    assert server.http_status(f"/v2/models/{name}/ready") != 200
