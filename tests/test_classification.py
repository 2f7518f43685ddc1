"""Triton's classification extension through tritonclient's ``class_count``: the expected strings
are what Triton 2.51 answered for the same models and requests (reference server, same inputs)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TESTS, raw_request

X = np.array([[0.1, 0.7, 0.2, 0.7, 0.05], [3.0, -1.0, 2.5, 0.0, 1.0]], dtype=np.float32)


# The same model without a batch dimension: classes ranked over the whole tensor.
FLAT_CONFIG = """name: "classify_flat"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
output [ { name: "PROB" data_type: TYPE_FP32 dims: [ 2, 3 ] }, { name: "IDX" data_type: TYPE_INT32 dims: [ 2, 3 ] } ]
"""



def ensemble_config(name: str, step: str, max_batch_size: int, dims: str, label_file: str = "") -> str:
    """An ensemble that passes X to ``step`` and answers its PROB and IDX; PROB labelled by the
    ensemble's own ``label_file`` (as Triton, which labels with the ensemble's files, else with
    the step's)."""
    label = f' label_filename: "{label_file}"' if label_file else ""
    return (f'name: "{name}" platform: "ensemble" max_batch_size: {max_batch_size}\n'
            f'input [ {{ name: "X" data_type: TYPE_FP32 dims: {dims} }} ]\n'
            f'output [ {{ name: "PROB" data_type: TYPE_FP32 dims: {dims}{label} }}, '
            f'{{ name: "IDX" data_type: TYPE_INT32 dims: {dims} }} ]\n'
            f'ensemble_scheduling {{ step [ {{ model_name: "{step}" input_map {{ key: "X" value: "X" }} '
            'output_map [ { key: "PROB" value: "PROB" }, { key: "IDX" value: "IDX" } ] } ] }\n')


def write_ensemble(repo, name: str, config: str, labels: bool) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    if labels:
        shutil.copy(TESTS / "models" / "classify" / "classify" / "labels.txt", repo / name / "labels.txt")


# A model whose output is text (BYTES), which Triton does not classify.
TEXT_CONFIG = """name: "text_of"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
output [ { name: "PROB" data_type: TYPE_STRING dims: [ 2 ] }, { name: "IDX" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""
TEXT_MODEL = """import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PROB", np.array([b"a", b"b"], dtype=object)),
                                            pb_utils.Tensor("IDX", np.zeros(1, np.int32))]) for _ in requests]
"""
# The classify model with one dimension of any length (no batch dimension).
WIDE_CONFIG = FLAT_CONFIG.replace("classify_flat", "classify_wide").replace("[ 2, 3 ]", "[ -1 ]")


@pytest.fixture(scope="module")
def server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("classify")
    shutil.copytree(TESTS / "models" / "classify" / "classify", repo / "classify")
    shutil.copytree(TESTS / "models" / "classify" / "classify" / "1", repo / "classify_flat" / "1")
    (repo / "classify_flat" / "config.pbtxt").write_text(FLAT_CONFIG)
    write_ensemble(repo, "classify_ens", ensemble_config("classify_ens", "classify", 4, "[ 5 ]", "labels.txt"), True)
    write_ensemble(repo, "classify_flat_ens", ensemble_config("classify_flat_ens", "classify_flat", 0, "[ 2, 3 ]"),
                   False)
    write_ensemble(repo, "unlabelled_ens", ensemble_config("unlabelled_ens", "classify", 4, "[ 5 ]"), False)
    (repo / "text_of" / "1").mkdir(parents=True)
    (repo / "text_of" / "1" / "model.py").write_text(TEXT_MODEL)
    (repo / "text_of" / "config.pbtxt").write_text(TEXT_CONFIG)
    write_ensemble(repo, "text_ens", ensemble_config("text_ens", "text_of", 0, "[ 2, 3 ]")
                   .replace('{ name: "PROB" data_type: TYPE_FP32 dims: [ 2, 3 ] }',
                            '{ name: "PROB" data_type: TYPE_STRING dims: [ 2 ] }')
                   .replace('{ name: "IDX" data_type: TYPE_INT32 dims: [ 2, 3 ] }',
                            '{ name: "IDX" data_type: TYPE_INT32 dims: [ 1 ] }'), False)
    shutil.copytree(TESTS / "models" / "classify" / "classify" / "1", repo / "classify_wide" / "1")
    (repo / "classify_wide" / "config.pbtxt").write_text(WIDE_CONFIG)
    write_ensemble(repo, "wide_ens", ensemble_config("wide_ens", "classify_wide", 0, "[ -1 ]"), False)
    return module_factory.start([repo])


def infer(server, model: str, x: np.ndarray, outputs: list[tuple[str, int]], binary: bool = True):
    client = httpclient.InferenceServerClient(server.url)
    try:
        i = httpclient.InferInput("X", list(x.shape), "FP32")
        i.set_data_from_numpy(x, binary_data=binary)
        wanted = [httpclient.InferRequestedOutput(n, binary_data=binary, class_count=k) for n, k in outputs]
        return client.infer(model, [i], outputs=wanted)
    finally:
        client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
def test_top_classes_with_labels_per_batch_row(server, binary):
    result = infer(server, "classify", X, [("PROB", 3)], binary)
    out = result.get_output("PROB")
    assert out["datatype"] == "BYTES" and out["shape"] == [2, 3]
    got = [[v.decode() if isinstance(v, bytes) else v for v in row] for row in result.as_numpy("PROB").tolist()]
    # Equal values in index order (1 before 3); index 4 has no line in labels.txt, so no label.
    assert got == [["0.700000:1:dog", "0.700000:3:fish", "0.200000:2:bird"],
                   ["3.000000:0:cat", "2.500000:2:bird", "1.000000:4"]]


def test_integers_unlabelled_beside_a_plain_output(server):
    result = infer(server, "classify", X, [("IDX", 2), ("PROB", 0)])
    assert result.as_numpy("IDX").tolist() == [[b"7:1", b"7:3"], [b"30:0", b"25:2"]]
    np.testing.assert_array_equal(result.as_numpy("PROB"), X)  # a count of 0 is the tensor itself


def test_count_beyond_the_classes_is_cut(server):
    result = infer(server, "classify", X[:1], [("PROB", 7)])
    assert result.get_output("PROB")["shape"] == [1, 5]
    assert result.as_numpy("PROB").tolist() == [[b"0.700000:1:dog", b"0.700000:3:fish", b"0.200000:2:bird",
                                                 b"0.100000:0:cat", b"0.050000:4"]]


def test_a_model_without_batch_dimension_ranks_the_whole_tensor(server):
    x = np.array([[1.5, 2.5, 0.5], [9.0, -3.0, 4.25]], dtype=np.float32)
    result = infer(server, "classify_flat", x, [("PROB", 2), ("IDX", 4)])
    assert result.get_output("PROB")["shape"] == [2]
    assert result.as_numpy("PROB").tolist() == [b"9.000000:3", b"4.250000:5"]
    assert result.as_numpy("IDX").tolist() == [b"90:3", b"42:5", b"25:1", b"15:0"]


def classes(server, protocol: str, model: str, x: np.ndarray, outputs: list[tuple[str, int]]) -> dict:
    """Each output's (shape, strings) as ``model`` answers ``class_count`` over HTTP or gRPC."""
    if protocol == "http":
        result = infer(server, model, x, outputs)
    else:
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            i = grpcclient.InferInput("X", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            result = client.infer(model, [i], outputs=[grpcclient.InferRequestedOutput(n, class_count=k)
                                                       for n, k in outputs])
    return {n: (list(result.as_numpy(n).shape), result.as_numpy(n).tolist()) for n, _ in outputs}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_ensemble_output_is_classified_as_its_model_does(server, protocol):
    # Labelled (the ensemble's label file, the same lines as its step's) and unlabelled, per batch row.
    direct = classes(server, protocol, "classify", X, [("PROB", 3), ("IDX", 2)])
    assert direct["PROB"][1][0][0] == b"0.700000:1:dog"
    assert classes(server, protocol, "classify_ens", X, [("PROB", 3), ("IDX", 2)]) == direct
    # Without a batch dimension: ranked over the whole tensor; a count of 0 is the tensor itself.
    x = np.array([[1.5, 2.5, 0.5], [9.0, -3.0, 4.25]], dtype=np.float32)
    direct = classes(server, protocol, "classify_flat", x, [("PROB", 2), ("IDX", 0)])
    assert direct["PROB"] == ([2], [b"9.000000:3", b"4.250000:5"])
    assert classes(server, protocol, "classify_flat_ens", x, [("PROB", 2), ("IDX", 0)]) == direct


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_an_ensemble_output_with_no_label_file_takes_its_steps_labels(server, protocol):
    """As Triton 2.51: the classes of an ensemble output without a label_filename of its own are
    labelled by the step output it comes from."""
    direct = classes(server, protocol, "classify", X, [("PROB", 3)])
    assert direct["PROB"][1][0][0] == b"0.700000:1:dog"
    assert classes(server, protocol, "unlabelled_ens", X, [("PROB", 3)]) == direct


@pytest.mark.parametrize("protocol", ["http", "grpc"])
@pytest.mark.parametrize("model", ["text_of", "text_ens"])
def test_text_is_not_classified(server, protocol, model):
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(InferenceServerException) as e:
        classes(server, protocol, model, x, [("PROB", 1)])
    assert "class result not available for output due to unsupported type 'BYTES'" in e.value.message()
    assert classes(server, protocol, model, x, [("IDX", 1)])["IDX"] == ([1], [b"0:0"])  # it keeps serving


@pytest.mark.parametrize("model", ["classify_wide", "wide_ens"])
def test_more_than_a_million_values_are_not_ranked(server, model):
    # Newer Triton's limit per batch row; it bounds what one request costs the broker's loop.
    x = np.zeros(1_000_001, np.float32)
    x[123_456] = 1.0
    with pytest.raises(InferenceServerException) as e:
        classes(server, "http", model, x, [("PROB", 1)])
    assert "classification output tensor too large" in e.value.message()
    assert classes(server, "http", model, x[:1_000_000], [("PROB", 1)])["PROB"] == ([1], [b"1.000000:123456"])


@pytest.mark.parametrize("count", [-1, "3", True, 2.5])
def test_a_bad_count_is_a_400(server, count):
    body = {"inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 5], "data": X[0].tolist()}],
            "outputs": [{"name": "PROB", "parameters": {"classification": count}}]}
    raw = raw_request(server.port, "POST", "/v2/models/classify/infer", json.dumps(body).encode())
    assert raw.status == 400 and "classification" in raw.json()["error"], raw
    assert infer(server, "classify", X, [("PROB", 1)]).as_numpy("PROB").tolist() == [[b"0.700000:1:dog"],
                                                                                      [b"3.000000:0:cat"]]


def test_server_metadata_lists_the_extension(server):
    client = httpclient.InferenceServerClient(server.url)
    assert "classification" in client.get_server_metadata()["extensions"]
    client.close()


def test_a_missing_label_file_fails_the_load(server_factory, tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(TESTS / "models" / "classify" / "classify", repo / "classify")
    (repo / "classify" / "labels.txt").unlink()
    write_ensemble(repo, "classify_ens", ensemble_config("classify_ens", "classify", 4, "[ 5 ]", "labels.txt"), False)
    s = server_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])
    client = s.client()
    assert not client.is_model_ready("classify")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["classify"]["state"] == "UNAVAILABLE"
    assert "failed to open text file for read" in index["classify"]["reason"]
    assert "labels.txt: No such file or directory" in index["classify"]["reason"]
    assert index["classify_ens"]["state"] == "UNAVAILABLE"  # an ensemble's label file too, as in Triton
    ensemble_labels = repo / "classify_ens" / "labels.txt"
    assert f"failed to open text file for read {ensemble_labels}" in index["classify_ens"]["reason"]
    with pytest.raises(InferenceServerException):
        infer(s, "classify", X, [("PROB", 1)])
