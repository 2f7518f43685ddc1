"""Corners of the Python backend API where a Triton model.py must see what Triton 2.51 gives it
(each checked side by side on the reference server): sibling modules import, get_model_dir(),
request.timeout() and parameters(), execute's contract for decoupled models, and an execute that
raises what would end a process."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

REPO = Path(__file__).parent / "models" / "pb_semantics"


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([REPO], ["--model-control-mode", "explicit", "--load-model", "pb_probe",
                                         "--load-model", "dec_returns_list", "--load-model", "bls_unknown",
                                         "--load-model", "bad_returns"])


def _x(value: int, kind=httpclient):
    x = kind.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([value], np.int32))
    return x


def _info(server, **options) -> dict:
    result = server.client().infer("pb_probe", [_x(0)], **options)
    return json.loads(result.as_numpy("INFO")[0])


def test_a_model_imports_its_own_modules_and_reads_what_triton_gives(server):
    info = _info(server, timeout=1234567, parameters={"mode": "api", "n": 5, "on": False})
    assert info["sibling"] == "from the version folder"  # from .sibling import ...
    assert info["folder"] == "from the model's folder"  # import folder_helper
    assert info["module"] == "1.model"  # as Triton's stub imports it
    assert info["model_dir"] == str(REPO / "pb_probe" / "1")  # the folder model.py lies in
    # The server's working directory is not on sys.path (Triton's stub has no such entry): a
    # module there must not shadow a model's own module of the same name.
    assert info["cwd_on_path"] == []
    assert info["timeout"] == 1234567  # it was always 0
    assert info["parameters"] == '{"mode":"api","n":5,"on":false}'  # compact, as Triton's
    # args["model_config"]: the completed config Triton gives (its normalization's fields, defaults)
    assert info["config"] == {"default_model_filename": "model.py", "optimization": True, "optional": False}


@pytest.mark.parametrize("value,raised", [(1, "SystemExit: 3"), (2, "KeyboardInterrupt: kb")])
def test_an_execute_raising_what_ends_a_process_fails_only_that_execution(server, value, raised):
    pid = _info(server)["pid"]
    with pytest.raises(InferenceServerException) as e:
        server.client().infer("pb_probe", [_x(value)])
    assert e.value.status() == "500"
    assert e.value.message().startswith(f"Failed to process the request(s) for model 'pb_probe_0', message: {raised}")
    assert _info(server)["pid"] == pid  # the same instance: no restart, its state kept


def test_a_decoupled_execute_that_returns_responses_fails_its_requests(server):
    """Its clients waited for good (the responses were dropped, and no final flag came)."""
    import queue

    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(server.wait_grpc_ready().grpc_url) as g:
        g.start_stream(callback=lambda result, error: got.put(error if error is not None else result))
        g.async_stream_infer("dec_returns_list", [_x(7, grpcclient)])
        answer = got.get(timeout=60)
        g.stop_stream()
    assert isinstance(answer, InferenceServerException)
    assert answer.message() == ("Failed to process the request(s) for model 'dec_returns_list_0', message: Python "
                                "model 'dec_returns_list_0' is using the decoupled mode and the execute function "
                                "must return None.")


def test_an_auto_complete_config_that_returns_nothing_refuses_the_load(server):
    with pytest.raises(InferenceServerException) as e:
        server.client().load_model("ac_none")
    assert "auto_complete_config function in model 'ac_none' must return a valid pb.ModelConfig object." \
        in e.value.message()
    assert not server.client().is_model_ready("ac_none")


def test_a_streaming_bls_call_refused_at_once_yields_one_error_response(server):
    """exec(decoupled=True) to a model nobody has raised the local client's exception, which is
    no pb_utils type; Triton gives an iterator of one error response."""
    result = server.client().infer("bls_unknown", [_x(1)])
    (has_error, message), (plain_error, plain_message) = json.loads(result.as_numpy("INFO")[0])
    assert has_error and "nosuch" in message
    # exec() without decoupled=True to a decoupled model: Triton's BLS words (not its HTTP frontend's)
    assert plain_error and plain_message == (
        "Model dec_returns_list is using the decoupled. The current BLS request call doesn't support models using "
        "the decoupled transaction policy. Please use 'decoupled=True' argument to the 'exec' or 'async_exec' calls "
        "for decoupled models.'")


@pytest.mark.parametrize("value,text", [
    (0, "Expected a list in the execute return, found type '<class 'tuple'>'."),
    (1, "Number of InferenceResponse objects do not match the number of InferenceRequest objects. "
        "InferenceRequest(s) size is:1, and InferenceResponse(s) size is:0\n"),
    (2, "Expected an 'InferenceResponse' object in the execute function return list, found type '<class 'str'>'."),
])
def test_what_execute_returns_is_checked_in_tritons_words(server, value, text):
    with pytest.raises(InferenceServerException) as e:
        server.client().infer("bad_returns", [_x(value)])
    assert (e.value.status(), e.value.message()) == (
        "500", f"Failed to process the request(s) for model 'bad_returns_0', message: {text}")
