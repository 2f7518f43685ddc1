"""A region unregistered while a request uses it is gone by the time its client has the answer.

Triton defers such an unregister until the request is done, and has removed the region before
the client reads the response; a client that asks for the region's status right after
``get_result()`` (or a stream's final response) must find it gone. Each case runs a few rounds
(the order is what is checked, not timing), over HTTP and gRPC, for a request on a worker's lane
(slow_reader as it is), one the broker forwards (slow_reader with two instances and the dynamic
batcher) and an ensemble the broker runs and answers (reader_pipeline); then for gRPC streams: a model that is not decoupled (its one response is final), a
decoupled model that ends a request inside execute and stays there (final_in_execute: the broker
holds the batch until execute returns), and one that speaks from a thread after execute returns
(word_stream: its sender holds the region until the final response).
"""
from __future__ import annotations

import json
import queue
from typing import Any, Callable

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException, serialize_byte_tensor, serialized_byte_size

from conftest import PRODUCT_MODELS, SHM_MODELS, SHM_SERVER_ARGS, TESTS
from gates import Gate
from test_shared_memory import Regions

ROUNDS = 4
X = np.arange(1, 33, dtype=np.int32)

# slow_reader through the broker: two instances and the dynamic batcher (a version that is not direct).
_SLOW_READER_THROUGH_THE_BROKER = json.dumps({
    "name": "slow_reader", "backend": "python", "max_batch_size": 4,
    "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [-1]}],
    "output": [{"name": "SUM", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}},  # the model sums the whole batch
               {"name": "COPY", "data_type": "TYPE_INT32", "dims": [-1]},
               {"name": "PID", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}}],
    "instance_group": [{"count": 2, "kind": "KIND_CPU"}], "dynamic_batching": {}})

_WORD_STREAM_THROUGH_THE_BROKER = json.dumps({
    "name": "word_stream", "backend": "python", "max_batch_size": 4,
    "model_transaction_policy": {"decoupled": True},
    "input": [{"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}],
    "output": [{"name": "text_output", "data_type": "TYPE_STRING", "dims": [1]},
               {"name": "index", "data_type": "TYPE_INT32", "dims": [1]}],
    "instance_group": [{"count": 2, "kind": "KIND_CPU"}], "dynamic_batching": {}})


# final_in_execute through the broker: a request that ends inside execute, its batch still running.
_FINAL_IN_EXECUTE_THROUGH_THE_BROKER = json.dumps({
    "name": "final_in_execute", "backend": "python", "max_batch_size": 4,
    "model_transaction_policy": {"decoupled": True},
    "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [-1]}],
    "output": [{"name": "SUM", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}}],
    "instance_group": [{"count": 2, "kind": "KIND_CPU"}], "dynamic_batching": {}})


@pytest.fixture(scope="module")
def shm_server(module_factory):
    """The shared-memory test server, with final_in_execute and reader_pipeline (tests/models/shm_unregister) too."""
    return module_factory.start([PRODUCT_MODELS, SHM_MODELS, TESTS / "models" / "shm_unregister"], SHM_SERVER_ARGS)


@pytest.fixture
def regions(shm_server):
    r = Regions(shm_server)
    yield r
    r.close()


class Protocol:
    """The calls of one tritonclient flavour that a round needs."""

    def __init__(self, server, kind: str) -> None:
        self.kind = kind
        self.mod: Any = httpclient if kind == "http" else grpcclient
        self.client = (server.client(concurrency=2) if kind == "http"
                       else grpcclient.InferenceServerClient(server.wait_grpc_ready().grpc_url))

    def infer_async(self, model: str, inputs: list, parameters: dict) -> Callable[[], Any]:
        """Send the request; returns what waits for its answer (``get_result()`` over HTTP)."""
        if self.kind == "http":
            return self.client.async_infer(model, inputs, parameters=parameters).get_result
        box: queue.Queue = queue.Queue()
        self.client.async_infer(model, inputs, lambda result, error: box.put((result, error)),
                                parameters=parameters)

        def get_result() -> Any:
            result, error = box.get(timeout=60)
            if error is not None:
                raise error
            return result
        return get_result

    def assert_gone(self, name: str) -> None:
        with pytest.raises(InferenceServerException) as e:
            self.client.get_system_shared_memory_status(name)
        assert f"Unable to find system shared memory region: '{name}'" in e.value.message(), e.value.message()

    def listed(self, name: str) -> bool:
        status = self.client.get_system_shared_memory_status(name)
        names = [r["name"] for r in status] if self.kind == "http" else list(status.regions)
        return names == [name]

    def close(self) -> None:
        self.client.close()


@pytest.fixture(params=["http", "grpc"])
def protocol(request, shm_server):
    p = Protocol(shm_server, request.param)
    yield p
    p.close()


def _register(regions: Regions, name: str, payload: list) -> int:
    size = sum(a.nbytes if a.dtype != object else serialized_byte_size(a) for a in payload)
    handle, key = regions.create(name, size)
    regions.register(name, key, size)
    shm.set_shared_memory_region(handle, payload)
    return size


@pytest.mark.parametrize("model,config", [("slow_reader", None), ("slow_reader", _SLOW_READER_THROUGH_THE_BROKER),
                                          ("reader_pipeline", None)], ids=["direct", "through-the-broker", "ensemble"])
def test_region_is_gone_once_the_client_has_the_answer(shm_server, regions, protocol, tmp_path, model, config):
    if model != "slow_reader" or config is not None:
        protocol.client.load_model(model, config=config)
    try:
        for i in range(ROUNDS):
            name = f"fin_{protocol.kind}_{i}"
            size = _register(regions, name, [X])
            gate = Gate(tmp_path / f"gate{i}")
            x = protocol.mod.InferInput("X", [len(X)] if config is None else [1, len(X)], "INT32")
            x.set_shared_memory(name, size)
            get_result = protocol.infer_async(model, [x], {"sleep_s": 0, "gate": gate.param})
            try:
                gate.wait_started(1)  # in the model, before it reads X
                protocol.client.unregister_system_shared_memory(name)
                assert protocol.listed(name), "the region went while its request was in flight"
            finally:
                gate.open()
            result = get_result()
            protocol.assert_gone(name)  # at once: no waiting
            assert result.as_numpy("SUM").reshape(-1).tolist() == [int(X.sum())]
    finally:
        if model != "slow_reader":
            protocol.client.unload_model(model)
        elif config is not None:
            protocol.client.unload_model("slow_reader")  # (a load alone keeps the override, as Triton's does)
            protocol.client.load_model("slow_reader")  # as the repository has it


@pytest.mark.parametrize("config", [None, _SLOW_READER_THROUGH_THE_BROKER], ids=["direct", "through-the-broker"])
def test_region_is_gone_once_a_stream_has_the_one_response(shm_server, regions, tmp_path, config):
    """A model that is not decoupled, called on a gRPC stream: its one response is the final one."""
    client = grpcclient.InferenceServerClient(shm_server.wait_grpc_ready().grpc_url)
    if config is not None:
        client.load_model("slow_reader", config=config)
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for i in range(ROUNDS):
            name = f"fin_one_{i}"
            size = _register(regions, name, [X])
            gate = Gate(tmp_path / f"gate{i}")
            x = grpcclient.InferInput("X", [len(X)] if config is None else [1, len(X)], "INT32")
            x.set_shared_memory(name, size)
            client.async_stream_infer("slow_reader", [x], parameters={"sleep_s": 0, "gate": gate.param})
            try:
                gate.wait_started(1)
                client.unregister_system_shared_memory(name)
                assert list(client.get_system_shared_memory_status(name).regions) == [name]
            finally:
                gate.open()
            result = answers.get(timeout=60)
            assert not isinstance(result, Exception), str(result)
            assert result.get_response().parameters["triton_final_response"].bool_param
            with pytest.raises(InferenceServerException) as e:  # at once: no waiting
                client.get_system_shared_memory_status(name)
            assert f"Unable to find system shared memory region: '{name}'" in e.value.message()
            assert result.as_numpy("SUM").reshape(-1).tolist() == [int(X.sum())]
    finally:
        client.stop_stream()
        if config is not None:
            client.unload_model("slow_reader")  # (a load alone keeps the override, as Triton's does)
            client.load_model("slow_reader")
        client.close()


@pytest.mark.parametrize("config", [None, _FINAL_IN_EXECUTE_THROUGH_THE_BROKER], ids=["direct", "through-the-broker"])
def test_region_is_gone_once_a_stream_that_ends_inside_execute_is_final(shm_server, regions, tmp_path, config):
    """final_in_execute sends its final response from execute and stays there a while: the
    region is gone when that final response arrives, though the batch still runs. The response
    came with the final flag, so it is the final one and no empty one follows (Triton's way)."""
    client = grpcclient.InferenceServerClient(shm_server.wait_grpc_ready().grpc_url)
    client.load_model("final_in_execute", config=config)  # loaded only here
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for i in range(ROUNDS):
            name = f"fin_early_{i}"
            size = _register(regions, name, [X])
            gate = Gate(tmp_path / f"gate{i}")
            x = grpcclient.InferInput("X", [len(X)] if config is None else [1, len(X)], "INT32")
            x.set_shared_memory(name, size)
            client.async_stream_infer("final_in_execute", [x], enable_empty_final_response=True,
                                      parameters={"linger_s": 0.5, "gate": gate.param})
            try:
                gate.wait_started(1)
                client.unregister_system_shared_memory(name)
                assert list(client.get_system_shared_memory_status(name).regions) == [name]
            finally:
                gate.open()
            result = answers.get(timeout=60)  # sent with the final flag: the final one, as in Triton
            assert not isinstance(result, Exception), str(result)
            assert result.as_numpy("SUM").reshape(-1).tolist() == [int(X.sum())]
            assert result.get_response().parameters["triton_final_response"].bool_param
            with pytest.raises(InferenceServerException) as e:  # at once: no waiting
                client.get_system_shared_memory_status(name)
            assert f"Unable to find system shared memory region: '{name}'" in e.value.message()
    finally:
        client.stop_stream()
        client.unload_model("final_in_execute")
        client.close()


@pytest.mark.parametrize("config", [None, _WORD_STREAM_THROUGH_THE_BROKER], ids=["direct", "through-the-broker"])
def test_streamed_region_is_gone_once_the_final_response_is_in(shm_server, regions, tmp_path, config):
    """word_stream speaks from a thread after execute returns; the region, unregistered after the
    first word, is gone when the (empty) final response arrives."""
    http = shm_server.client()
    http.load_model("word_stream", config=config)
    client = grpcclient.InferenceServerClient(shm_server.wait_grpc_ready().grpc_url)
    answers: queue.Queue = queue.Queue()
    try:
        client.start_stream(callback=lambda result, error: answers.put(error or result))
        for i in range(ROUNDS):
            name = f"fin_stream_{i}"
            text = serialize_byte_tensor(np.array([b"one two three"], dtype=object))
            size = _register(regions, name, [text])
            inp = grpcclient.InferInput("text_input", [1] if config is None else [1, 1], "BYTES")
            inp.set_shared_memory(name, size)
            client.async_stream_infer("word_stream", [inp], parameters={"delay_ms": 200},
                                      enable_empty_final_response=True)
            first = answers.get(timeout=60)
            assert not isinstance(first, Exception), str(first)
            client.unregister_system_shared_memory(name)
            assert list(client.get_system_shared_memory_status(name).regions) == [name]
            words = [first]
            while True:
                r = answers.get(timeout=60)
                assert not isinstance(r, Exception), str(r)
                if r.get_response().parameters["triton_final_response"].bool_param:
                    break
                words.append(r)
            with pytest.raises(InferenceServerException) as e:  # at once: no waiting
                client.get_system_shared_memory_status(name)
            assert f"Unable to find system shared memory region: '{name}'" in e.value.message()
            assert [w.as_numpy("text_output")[0] for w in words] == [b"one", b"two", b"three"]
    finally:
        client.stop_stream()
        client.close()
        http.unload_model("word_stream")
        http.close()
