"""Triton's classification extension through tritonclient's ``class_count``: the expected strings
are what Triton 2.51 answered for the same models and requests (reference server, same inputs)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
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


@pytest.fixture(scope="module")
def server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("classify")
    shutil.copytree(TESTS / "models" / "classify" / "classify", repo / "classify")
    shutil.copytree(TESTS / "models" / "classify" / "classify" / "1", repo / "classify_flat" / "1")
    (repo / "classify_flat" / "config.pbtxt").write_text(FLAT_CONFIG)
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
    s = server_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])
    client = s.client()
    assert not client.is_model_ready("classify")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["classify"]["state"] == "UNAVAILABLE"
    assert "failed to open text file for read" in index["classify"]["reason"]
    assert "labels.txt: No such file or directory" in index["classify"]["reason"]
    with pytest.raises(InferenceServerException):
        infer(s, "classify", X, [("PROB", 1)])
