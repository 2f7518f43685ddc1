"""Python backend behaviours a Triton model.py relies on, against a real server: concurrent
coroutines of a decoupled ``async def execute``, the response sender of a non-decoupled model,
``async_exec(decoupled=True)``'s response iterator, and inputs a model may write into without
touching the client's memory."""
from __future__ import annotations

import itertools
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from conftest import raw_request
from shmserve.shm.client import Client, InferenceServerError

ROOT = Path(__file__).resolve().parent.parent

# Each request of GROUP waits until GROUP requests are in execute() at once: with one instance,
# that happens only if the worker takes new requests while earlier coroutines still run.
MEET = '''
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        self.arrived = 0
        self.changed = None

    async def execute(self, requests):
        if self.changed is None:
            self.changed = asyncio.Condition()
        for request in requests:
            group = int(pb_utils.get_input_tensor_by_name(request, "GROUP").as_numpy()[0])
            sender = request.get_response_sender()
            if group < 0:
                raise ValueError("asked to fail")
            async with self.changed:
                self.arrived += 1
                self.changed.notify_all()
                await asyncio.wait_for(self.changed.wait_for(lambda: self.arrived >= group), 30)
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", np.array([group], np.int32))]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
'''

SENDER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            response = pb_utils.InferenceResponse([pb_utils.Tensor("Y", x * 2)])
            sender = request.get_response_sender()
            if x[0] == 0:  # a second response: refused
                sender.send(response)
            sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
'''

STREAM_ITER = '''
import numpy as np
import triton_python_backend_utils as pb_utils


def words_request(text):
    return pb_utils.InferenceRequest(
        model_name="word_stream", requested_output_names=["text_output"],
        inputs=[pb_utils.Tensor("text_input", np.array([text.encode()], dtype=object))])


def word(response):
    return pb_utils.get_output_tensor_by_name(response, "text_output").as_numpy()[0]


class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            text = pb_utils.get_input_tensor_by_name(request, "TEXT").as_numpy()[0].decode()
            stream = await words_request(text).async_exec(decoupled=True)
            first = next(stream)  # Triton's iterator: next() and for
            seen = [word(first)] + [word(r) async for r in stream]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("WORDS", np.array(seen, dtype=object))]))
        return responses
'''

WRITER = '''
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            x += 1  # allowed in Triton: the model's inputs are its own
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
'''


def io(name: str, dtype: str, dims: str) -> str:
    return f'{{ name: "{name}" data_type: {dtype} dims: [ {dims} ] }}'


def write_model(repo: Path, name: str, source: str, inputs: str, outputs: str, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\ninput [ {inputs} ]\noutput [ {outputs} ]\n'
        f'instance_group [ {{ count: 1 kind: KIND_CPU }} ]\n{extra}')


@pytest.fixture(scope="module")
def server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("parity_models")
    decoupled = "model_transaction_policy { decoupled: true }\n"
    write_model(repo, "meet", MEET, io("GROUP", "TYPE_INT32", "1"), io("SEEN", "TYPE_INT32", "1"), decoupled)
    write_model(repo, "sender_once", SENDER, io("X", "TYPE_INT32", "-1"), io("Y", "TYPE_INT32", "-1"))
    write_model(repo, "stream_iter", STREAM_ITER, io("TEXT", "TYPE_STRING", "1"), io("WORDS", "TYPE_STRING", "-1"))
    write_model(repo, "writer", WRITER, io("X", "TYPE_INT32", "-1"), io("Y", "TYPE_INT32", "-1"))
    write_model(repo, "writer_ro", WRITER, io("X", "TYPE_INT32", "-1"), io("Y", "TYPE_INT32", "-1"),
                'parameters { key: "READ_ONLY_INPUTS" value: { string_value: "yes" } }\n')
    return module_factory.start([repo, ROOT / "model_repository"])


def test_decoupled_async_execute_runs_requests_concurrently(server):
    group = 3
    results: dict[int, list] = {}

    def call(i: int) -> None:
        with Client(server.id) as client:
            try:
                results[i] = [int(r["SEEN"][0]) for r in client.stream("meet", {"GROUP": np.array([group], np.int32)})]
            except InferenceServerError as e:
                results[i] = [e.message]

    threads = [threading.Thread(target=call, args=(i,)) for i in range(group)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: [group] for i in range(group)}
    stats = server.client().get_inference_statistics("meet")["model_stats"][0]
    assert stats["inference_count"] == group
    assert stats["inference_stats"]["success"]["count"] == group
    assert stats["inference_stats"]["fail"]["count"] == 0


def test_decoupled_async_execute_that_raises_ends_its_stream_with_the_error(server):
    with Client(server.id) as client:
        with pytest.raises(InferenceServerError) as e:
            list(client.stream("meet", {"GROUP": np.array([-1], np.int32)}))
        assert "ValueError: asked to fail" in e.value.message
        # The worker took the next request as usual.
        assert [int(r["SEEN"][0]) for r in client.stream("meet", {"GROUP": np.array([1], np.int32)})] == [1]


def test_non_decoupled_model_answers_through_its_response_sender(server):
    client = server.client()
    x = httpclient.InferInput("X", [3], "INT32")
    x.set_data_from_numpy(np.array([1, 2, 3], np.int32))
    assert client.infer("sender_once", [x]).as_numpy("Y").tolist() == [2, 4, 6]
    x = httpclient.InferInput("X", [2], "INT32")
    x.set_data_from_numpy(np.array([0, 1], np.int32))
    with pytest.raises(InferenceServerException, match="Non-decoupled model cannot send more than one response"):
        client.infer("sender_once", [x])
    with Client(server.id) as local:  # a streaming call to it gets its one response
        once = list(local.stream("sender_once", {"X": np.array([5], np.int32)}))
        assert [r["Y"].tolist() for r in once] == [[10]]


def test_async_exec_decoupled_gives_an_iterator_of_responses(server):
    client = server.client()
    t = httpclient.InferInput("TEXT", [1], "BYTES")
    t.set_data_from_numpy(np.array([b"one two three"], dtype=object))
    assert client.infer("stream_iter", [t]).as_numpy("WORDS").tolist() == [b"one", b"two", b"three"]


_keys = itertools.count()


@pytest.fixture
def region(server):
    """A registered system shared memory region holding an INT32 [4] input, unlinked after."""
    client = server.client()
    name, key = f"parity_in_{next(_keys)}", f"/parity_{server.id}_{next(_keys)}"
    handle = shm.create_shared_memory_region(name, key, 16, create_only=True)
    client.register_system_shared_memory(name, key, 16)
    yield name, handle
    raw_request(server.port, "POST", f"/v2/systemsharedmemory/region/{name}/unregister")
    shm.destroy_shared_memory_region(handle)
    client.close()


def region_input(name: str) -> httpclient.InferInput:
    x = httpclient.InferInput("X", [4], "INT32")
    x.set_shared_memory(name, 16)
    return x


def test_a_model_writing_its_inputs_leaves_the_clients_memory_alone(server, region):
    name, handle = region
    shm.set_shared_memory_region(handle, [np.arange(4, dtype=np.int32)])
    result = server.client().infer("writer", [region_input(name)])
    assert result.as_numpy("Y").tolist() == [1, 2, 3, 4]
    assert np.array(shm.get_contents_as_numpy(handle, np.int32, [4]), copy=True).tolist() == [0, 1, 2, 3]
    with Client(server.id) as local:  # inputs in the local client's arena too
        assert local.infer("writer", {"X": np.arange(4, dtype=np.int32)})["Y"].tolist() == [1, 2, 3, 4]


def test_read_only_inputs_refuse_writes_and_leave_the_clients_memory_alone(server, region):
    name, handle = region
    shm.set_shared_memory_region(handle, [np.arange(4, dtype=np.int32)])
    with pytest.raises(InferenceServerException, match="read-only"):
        server.client().infer("writer_ro", [region_input(name)])
    assert np.array(shm.get_contents_as_numpy(handle, np.int32, [4]), copy=True).tolist() == [0, 1, 2, 3]


# -- reshape ------------------------------------------------------------------------------------

# SEEN: the shape the model got for INPUT0; OUT: INPUT0 in its output's reshape shape ([2,2] per row).
RESHAPE_PROBE = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            out = x.reshape(x.shape[:-1] + (2, 2))
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("SEEN", np.array(x.shape, np.int64)),
                                                         pb_utils.Tensor("OUT", out)]))
        return responses
'''


def write_reshape_model(repo: Path, name: str, max_batch_size: int) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(RESHAPE_PROBE)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: {max_batch_size}\n'
        'input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 2, 2 ] reshape { shape: [ 4 ] } } ]\n'
        'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 2, 2 ] } },\n'
        '         { name: "SEEN" data_type: TYPE_INT64 dims: [ -1 ] } ]\n'
        'instance_group [ { count: 1 kind: KIND_CPU } ]\n')


@pytest.fixture(scope="module")
def reshape_server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("reshape_models")
    write_reshape_model(repo, "reshape_batch", 4)
    write_reshape_model(repo, "reshape_plain", 0)
    return module_factory.start([repo])


@pytest.mark.parametrize("model, rows", [("reshape_batch", [1]), ("reshape_plain", [])])
def test_reshape_gives_the_model_its_shape_and_the_client_the_config_dims(reshape_server, model, rows):
    """As in Triton: the model sees INPUT0 as [batch] + reshape and clients get OUT as [batch] +
    dims, over HTTP, gRPC and the local client alike."""
    import tritonclient.grpc as grpcclient

    x = np.arange(4, dtype=np.float32).reshape(rows + [2, 2])
    seen, out_shape = rows + [4], rows + [4]
    h = httpclient.InferInput("INPUT0", list(x.shape), "FP32")
    h.set_data_from_numpy(x)
    result = reshape_server.client().infer(model, [h])
    assert result.as_numpy("SEEN").tolist() == seen
    assert result.as_numpy("OUT").shape == tuple(out_shape)
    assert result.as_numpy("OUT").reshape(-1).tolist() == [0, 1, 2, 3]
    with grpcclient.InferenceServerClient(reshape_server.grpc_url) as g:
        i = grpcclient.InferInput("INPUT0", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        result = g.infer(model, [i])
        assert result.as_numpy("SEEN").tolist() == seen
        assert list(result.get_output("OUT").shape) == out_shape
    with Client(reshape_server.id) as local:
        got = local.infer(model, {"INPUT0": x})
        assert got["SEEN"].tolist() == seen and got["OUT"].shape == tuple(out_shape)


# -- outputs the config does not declare ---------------------------------------------------------

EXTRA_OUTPUT = '''
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([1, 2], np.int32)),
                                            pb_utils.Tensor("EXTRA", np.array([7], np.int32))])
                for _ in requests]
'''


@pytest.fixture(scope="module")
def extra_server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("extra_models")
    write_model(repo, "extra_out", EXTRA_OUTPUT, io("X", "TYPE_INT32", "-1"), io("Y", "TYPE_INT32", "-1"))
    return module_factory.start([repo])


def test_an_output_the_config_does_not_declare_never_reaches_the_client(extra_server):
    """Triton's Python backend drops (silently) what the model returns beyond its config's outputs."""
    import tritonclient.grpc as grpcclient

    x = np.array([3], np.int32)
    h = httpclient.InferInput("X", [1], "INT32")
    h.set_data_from_numpy(x)
    result = extra_server.client().infer("extra_out", [h])
    assert [o["name"] for o in result.get_response()["outputs"]] == ["Y"]
    with grpcclient.InferenceServerClient(extra_server.grpc_url) as g:
        i = grpcclient.InferInput("X", [1], "INT32")
        i.set_data_from_numpy(x)
        assert [o.name for o in g.infer("extra_out", [i]).get_response().outputs] == ["Y"]
    with Client(extra_server.id) as local:
        assert list(local.infer("extra_out", {"X": x})) == ["Y"]
