"""Triton's ragged batching against a real server: requests whose ragged input differs in length
run as one batch; a Python model sees each request as its client sent it, a PyTorch or ONNX model
sees one flat tensor of the batch's elements with the batch inputs Triton generates, and a batch
output goes back to each request with its input's shape."""
from __future__ import annotations

import concurrent.futures as cf
import textwrap
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

import onnx_models as om
from conftest import wait_until

BATCHING = Path(__file__).parent / "models" / "batching"
LENGTHS = [2, 4, 1, 3]  # one batch: the models' preferred_batch_size is 4 and their delay 30 s
DYNAMIC = "dynamic_batching { preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 30000000 }\n"

TORCH_CONFIG = textwrap.dedent("""\
    name: "ragged_torch"
    backend: "pytorch"
    max_batch_size: 8
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
    output [
      { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
      { name: "END" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "START" data_type: TYPE_INT32 dims: [ 1 ] },
      { name: "LONGEST" data_type: TYPE_INT64 dims: [ 1 ] }, { name: "ITEM" data_type: TYPE_INT32 dims: [ 1 ] },
      { name: "ITEM_FLAT" data_type: TYPE_FP32 dims: [ 1 ] }, { name: "DOUBLED" data_type: TYPE_FP32 dims: [ -1 ] } ]
    batch_input [
      { kind: BATCH_ELEMENT_COUNT target_name: "ELEMENTS" data_type: TYPE_INT32 source_input: "INPUT0" },
      { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ENDS" data_type: TYPE_FP32 source_input: "INPUT0" },
      { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "OFFSETS" data_type: TYPE_INT32
        source_input: "INPUT0" },
      { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "MAXED" data_type: TYPE_FP32 source_input: "INPUT0" },
      { kind: BATCH_ITEM_SHAPE target_name: "ITEMS" data_type: TYPE_INT32 source_input: "INPUT0" },
      { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: "ITEMS_FLAT" data_type: TYPE_FP32 source_input: "INPUT0" } ]
    batch_output [ { target_name: "DOUBLED" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT0" } ]
    instance_group [ { count: 1 kind: KIND_CPU } ]
    """) + DYNAMIC

ONNX_CONFIG = textwrap.dedent("""\
    name: "ragged_onnx"
    platform: "onnxruntime_onnx"
    max_batch_size: 4
    input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true } ]
    output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] }, { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
    batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "COUNTS" data_type: TYPE_INT32 source_input: "INPUT0" } ]
    batch_output [ { target_name: "OUTPUT0" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT0" } ]
    instance_group [ { count: 2 kind: KIND_CPU } ]
    """)


def write_torch_model(repo: Path) -> None:
    """A TorchScript model that reads the batch through every kind of batch input: each request's
    sum (found through OFFSETS), and each batch input cut back to the request's own row."""
    import torch

    class Ragged(torch.nn.Module):
        def forward(self, INPUT0, ELEMENTS, ENDS, OFFSETS, MAXED, ITEMS, ITEMS_FLAT):  # noqa: N803 - config names
            n = ELEMENTS.shape[0]
            sums = [INPUT0[int(OFFSETS[i]):int(OFFSETS[i + 1])].sum() for i in range(n)]
            longest = torch.full((n, 1), MAXED.shape[0], dtype=torch.int64)
            return (torch.stack(sums).view(n, 1), ELEMENTS.view(n, 1), ENDS.view(n, 1), OFFSETS[:n].view(n, 1),
                    longest, ITEMS, ITEMS_FLAT.view(n, 1), INPUT0 * 2)

    (repo / "ragged_torch" / "1").mkdir(parents=True)
    (repo / "ragged_torch" / "config.pbtxt").write_text(TORCH_CONFIG)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)  # torch.jit.script: TorchScript is what loads
        torch.jit.script(Ragged()).save(str(repo / "ragged_torch" / "1" / "model.pt"))


@pytest.fixture(scope="module")
def server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("ragged_repo")
    write_torch_model(repo)
    om.write(repo, "ragged_onnx", om.ragged_io(), ONNX_CONFIG + DYNAMIC)
    om.write(repo, "ragged_onnx_alone", om.ragged_io(), ONNX_CONFIG.replace("ragged_onnx", "ragged_onnx_alone"))
    models = ["ragged_py", "ragged_py_pair", "ragged_torch", "ragged_onnx", "ragged_onnx_alone"]
    args = ["--model-control-mode", "explicit"] + [a for m in models for a in ("--load-model", m)]
    return module_factory.start([BATCHING, repo], args)


def together(url: str, model: str, lengths: list[int], outputs: list[str]) -> list[dict[str, np.ndarray]]:
    """One request per length, sent at once from as many threads; request i's INPUT0 is [1, n]
    holding i*10 + 1, i*10 + 2, ... so that every request's elements are its own."""
    barrier = threading.Barrier(len(lengths))

    def one(i: int) -> dict[str, np.ndarray]:
        client = httpclient.InferenceServerClient(url)
        try:
            x = httpclient.InferInput("INPUT0", [1, lengths[i]], "FP32")
            x.set_data_from_numpy(data(i, lengths[i]))
            barrier.wait()
            result = client.infer(model, [x], outputs=[httpclient.InferRequestedOutput(o) for o in outputs])
            return {o: result.as_numpy(o) for o in outputs}
        finally:
            client.close()

    with cf.ThreadPoolExecutor(len(lengths)) as pool:
        return list(pool.map(one, range(len(lengths))))


def data(i: int, n: int) -> np.ndarray:
    return (i * 10 + np.arange(1, n + 1, dtype=np.float32)).reshape(1, n)


def counts(server, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of the model's statistics."""
    client = server.client()
    try:
        stats = client.get_inference_statistics(model)["model_stats"][0]
    finally:
        client.close()
    return int(stats["inference_count"]), int(stats["execution_count"])


def run_as_one_batch(server, model: str, outputs: list[str]) -> list[dict[str, np.ndarray]]:
    """The requests of LENGTHS sent together; asserts they ran in one execution."""
    inferences, executions = counts(server, model)
    results = together(server.url, model, LENGTHS, outputs)
    wait_until(lambda: counts(server, model)[0] - inferences >= len(LENGTHS), f"{model}'s statistics")
    assert counts(server, model) == (inferences + len(LENGTHS), executions + 1)
    return results


@pytest.mark.parametrize("model", ["ragged_py", "ragged_py_pair"])  # batched in the worker / in the broker
def test_a_python_model_gets_requests_of_different_lengths_in_one_execution(server, model):
    results = run_as_one_batch(server, model, ["SUM", "REQS", "SHAPE", "NAMES"])
    for i, (n, r) in enumerate(zip(LENGTHS, results)):
        assert r["REQS"].tolist() == [[4]]
        assert r["SUM"].tolist() == [[float(data(i, n).sum())]]
        # As in Triton: the request's own tensor as sent, and no batch inputs in a Python model.
        assert r["SHAPE"].tolist() == [[1, n]]
        assert r["NAMES"].tolist() == [[b"INPUT0"]]


def test_a_pytorch_model_gets_the_flat_batch_and_every_kind_of_batch_input(server):
    results = run_as_one_batch(server, "ragged_torch",
                               ["SUM", "COUNT", "END", "START", "LONGEST", "ITEM", "ITEM_FLAT", "DOUBLED"])
    for i, (n, r) in enumerate(zip(LENGTHS, results)):
        assert r["SUM"].tolist() == [[float(data(i, n).sum())]]  # its own elements, found through OFFSETS
        assert r["COUNT"].tolist() == [[n]] and r["ITEM"].tolist() == [[n]] and r["ITEM_FLAT"].tolist() == [[n]]
        assert r["END"][0, 0] == r["START"][0, 0] + n
        assert r["LONGEST"].tolist() == [[max(LENGTHS)]]
        np.testing.assert_array_equal(r["DOUBLED"], data(i, n) * 2)  # scattered with INPUT0's shape [1, n]
    # In the batch's order (the order the requests reached the batcher), they tile the flat input.
    starts = sorted((int(r["START"][0, 0]), int(r["END"][0, 0])) for r in results)
    assert starts[0][0] == 0 and all(a[1] == b[0] for a, b in zip(starts, starts[1:]))
    assert starts[-1][1] == sum(LENGTHS)


def test_an_onnx_model_gets_the_flat_batch_and_its_output_is_scattered(server):
    """Triton's ragged_io pattern, batched in the broker (two instances)."""
    results = run_as_one_batch(server, "ragged_onnx", ["OUTPUT0", "N"])
    for i, (n, r) in enumerate(zip(LENGTHS, results)):
        np.testing.assert_array_equal(r["OUTPUT0"], data(i, n))
        assert r["N"].tolist() == [[n]]


def test_a_request_that_runs_alone_is_a_batch_of_one(server):
    """Without a batcher each request runs on its own, fed as Triton feeds a batch of one: its
    input flat, the batch inputs made, the batch output scattered."""
    client = server.client()
    try:
        x = httpclient.InferInput("INPUT0", [1, 5], "FP32")
        x.set_data_from_numpy(data(0, 5))
        result = client.infer("ragged_onnx_alone", [x],
                              outputs=[httpclient.InferRequestedOutput(o) for o in ("OUTPUT0", "N")])
    finally:
        client.close()
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data(0, 5))
    assert result.as_numpy("N").tolist() == [[5]]
