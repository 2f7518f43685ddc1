"""A model's own error codes (``pb_utils.TritonError``) reach each client as Triton's frontends
answer them: HTTP ``infer`` by Triton's table (four codes fold into 400), ``generate`` 400 for
all, gRPC one status per code, an ensemble with its step's code and text, the local client with
the code itself. Every figure was read from Triton 2.51 with the same models."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import raw_request

MODELS = Path(__file__).parent / "models"

# code: (Triton's HTTP infer status, its gRPC status)
TRITON = {
    0: (400, "StatusCode.UNKNOWN"),
    1: (500, "StatusCode.INTERNAL"),
    2: (404, "StatusCode.NOT_FOUND"),
    3: (400, "StatusCode.INVALID_ARGUMENT"),
    4: (503, "StatusCode.UNAVAILABLE"),
    5: (501, "StatusCode.UNIMPLEMENTED"),
    6: (400, "StatusCode.ALREADY_EXISTS"),
    7: (400, "StatusCode.CANCELLED"),
}


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([MODELS / "model_errors", MODELS / "bls"],
                                ["--model-control-mode", "explicit", "--load-model", "error_ens"]).wait_grpc_ready()


def _infer_body(code: int) -> bytes:
    return json.dumps({"inputs": [{"name": "CODE", "shape": [1], "datatype": "INT32", "data": [code]}]}).encode()


@pytest.mark.parametrize("model,prefix", [("error_source", ""), ("error_ens", "in ensemble 'error_ens', ")])
def test_http_and_grpc_answer_a_models_code_as_triton(server, model, prefix):
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        for code, (http_status, grpc_status) in TRITON.items():
            text = f"{prefix}failed with code {code}"
            r = raw_request(server.port, "POST", f"/v2/models/{model}/infer", _infer_body(code),
                            {"Content-Type": "application/json"})
            assert (r.status, r.json()) == (http_status, {"error": text}), code
            r = raw_request(server.port, "POST", f"/v2/models/{model}/generate", json.dumps({"CODE": code}).encode(),
                            {"Content-Type": "application/json"})
            assert (r.status, r.json()) == (400, {"error": text}), code
            i = grpcclient.InferInput("CODE", [1], "INT32")
            i.set_data_from_numpy(np.array([code], np.int32))
            with pytest.raises(InferenceServerException) as e:
                g.infer(model, [i])
            assert (e.value.status(), e.value.message()) == (grpc_status, text), code


def test_tritonclient_http_sees_the_status(server):
    i = httpclient.InferInput("CODE", [1], "INT32")
    i.set_data_from_numpy(np.array([6], np.int32))
    with pytest.raises(InferenceServerException) as e:
        server.client().infer("error_source", [i])
    assert (e.value.status(), e.value.message()) == ("400", "failed with code 6")


def test_the_local_client_gets_the_code(server):
    from shmserve import Client, ErrorCode, InferenceServerError

    with Client(server.id) as local:
        for code in (0, 6, 2):
            for model in ("error_source", "error_ens"):
                with pytest.raises(InferenceServerError) as e:
                    local.infer(model, {"CODE": np.array([code], np.int32)})
                assert e.value.code is ErrorCode(code)
                assert e.value.message.endswith(f"failed with code {code}")
        with pytest.raises(InferenceServerError) as e:  # the server's own error: no model code
            local.infer("error_source", {"CODE": np.array([1.5], np.float32)})
        assert (e.value.status, e.value.code) == (400, None)


def test_an_answers_code_is_read_back_and_checked():
    """The code crosses in the answer's header; one no producer writes (unknown, or without the
    error flag) makes the answer corrupt, as any other bad header field."""
    from shmserve.shm.answer import AnswerCorrupt, AnswerDescriptor, ErrorCode, decode_answer

    def block(answer: AnswerDescriptor) -> bytearray:  # a descriptor and the room to its data start
        return bytearray(answer.encode()).ljust(64, b"\0")

    for code in (None, *ErrorCode):
        raw = block(AnswerDescriptor(error="no", code=code))
        answer, _ = decode_answer(memoryview(raw), 0)
        assert (answer.error, answer.code) == ("no", code)
    code_at = 4  # magic (2 bytes), flags, trace stamp count, then the code
    raw = block(AnswerDescriptor(error="no", code=ErrorCode.CANCELLED))
    raw[code_at] = len(ErrorCode) + 1
    with pytest.raises(AnswerCorrupt, match="error code 8 is unknown"):
        decode_answer(memoryview(raw), 0)
    raw = block(AnswerDescriptor())
    raw[code_at] = 1
    with pytest.raises(AnswerCorrupt, match="no error flag"):
        decode_answer(memoryview(raw), 0)
