"""Implicit state's ``initial_state`` against a real server: a sequence's first request sees the
configured initial state (zeros of the initial state's dims, or the bytes of a file in the
model's ``initial_state/`` folder), later requests see what the previous one produced, a new
START begins from the initial state again, and a broken initial state fails the model's load."""
from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

MODEL = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """SEEN is the state this request got; the next request of the sequence gets it plus one."""

    def execute(self, requests):
        out = []
        for r in requests:
            state = pb_utils.get_input_tensor_by_name(r, "STATE_IN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", state.astype(np.float32)),
                                                   pb_utils.Tensor("STATE_OUT", (state + 1).astype(np.float32))]))
        return out
'''

CONFIG = '''
name: "{name}"
backend: "python"
max_batch_size: 2
input [ {{ name: "VALUE" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "SEEN" data_type: TYPE_FP32 dims: [ -1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 60000000
  state [ {{ input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ -1 ]
            initial_state {{ data_type: TYPE_FP32 dims: [ 4 ] {init} name: "start" }} }} ]
}}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
'''

FILE_STATE = np.array([1.5, -2.0, 3.25, 8.0], np.float32)


def add_model(repo: Path, name: str, init: str, data: bytes | None = None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(CONFIG.format(name=name, init=init)))
    (repo / name / "1" / "model.py").write_text(MODEL)
    if data is not None:
        (repo / name / "initial_state").mkdir()
        (repo / name / "initial_state" / "start.bin").write_bytes(data)


def step(url: str, model: str, seq: int, start: bool = False, end: bool = False) -> np.ndarray:
    client = httpclient.InferenceServerClient(url)
    try:
        x = httpclient.InferInput("VALUE", [1, 1], "FP32")
        x.set_data_from_numpy(np.zeros((1, 1), np.float32))
        r = client.infer(model, [x], sequence_id=seq, sequence_start=start, sequence_end=end)
        return r.as_numpy("SEEN")
    finally:
        client.close()


@pytest.fixture
def server(server_factory, tmp_path):
    repo = tmp_path / "repo"
    add_model(repo, "state_zero", "zero_data: true")
    add_model(repo, "state_file", 'data_file: "start.bin"', FILE_STATE.tobytes())
    return server_factory.start([repo])


@pytest.mark.parametrize("model,first", [("state_zero", np.zeros(4, np.float32)), ("state_file", FILE_STATE)])
def test_first_request_sees_the_initial_state(server, model, first):
    seen = [step(server.url, model, 7, start=True), step(server.url, model, 7), step(server.url, model, 7, end=True)]
    assert [s.shape for s in seen] == [(1, 4)] * 3
    for i, s in enumerate(seen):
        np.testing.assert_array_equal(s[0], first + i)
    # Another sequence, and the same id started again, begin from the initial state too.
    np.testing.assert_array_equal(step(server.url, model, 8, start=True, end=True)[0], first)
    np.testing.assert_array_equal(step(server.url, model, 7, start=True, end=True)[0], first)


@pytest.mark.parametrize("init,data,why", [
    ('data_file: "start.bin"', None, "cannot read"),
    ('data_file: "start.bin"', b"\0" * 12, "initial_state setting expects 16 bytes, but the data provided from "
                                            "start.bin only has 12 bytes."),
], ids=["missing-file", "short-file"])
def test_a_broken_initial_state_fails_the_load(server_factory, tmp_path, init, data, why):
    repo = tmp_path / "repo"
    add_model(repo, "broken", init, data)
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    client = httpclient.InferenceServerClient(s.url)
    try:
        with pytest.raises(InferenceServerException) as e:
            client.load_model("broken")
        assert why in e.value.message()
    finally:
        client.close()


def test_a_grpc_stream_keeps_the_state_and_sends_only_declared_outputs(server):
    """ModelStreamInfer as Triton: the state carries from one request of the sequence to the
    next, and the state output stays on the server (the response holds SEEN only)."""
    import queue

    import tritonclient.grpc as grpcclient

    got: queue.Queue = queue.Queue()
    x = grpcclient.InferInput("VALUE", [1, 1], "FP32")
    x.set_data_from_numpy(np.zeros((1, 1), np.float32))
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        c.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        for i in range(3):
            c.async_stream_infer("state_zero", [x], sequence_id=11, sequence_start=i == 0, sequence_end=i == 2)
        c.stop_stream()
    results = [got.get_nowait() for _ in range(got.qsize())]
    assert [[o.name for o in r.get_response().outputs] for r in results] == [["SEEN"]] * 3
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r.as_numpy("SEEN")[0], np.full(4, i, np.float32))
