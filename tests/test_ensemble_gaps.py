"""Ensembles where a tensor never comes, against a real server, answered as Triton 2.51's
ensemble scheduler answers them: an output a step did not return is absent (left out of the
response, or a missing input of the step that reads it, which then runs without it)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

MODELS = Path(__file__).parent / "models" / "ensgaps"


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([MODELS], ["--cache-config", "local,size=1048576"])


def a_input(module=httpclient, name: str = "A", values=(1, 2, 3, 4)) -> list:
    t = module.InferInput(name, [4], "INT32")
    t.set_data_from_numpy(np.array(values, np.int32))
    return [t]


def outputs_of(result) -> dict[str, list]:
    return {o["name"]: result.as_numpy(o["name"]).tolist() for o in result.get_response().get("outputs", [])}


def test_an_output_a_step_leaves_out_is_left_out_of_the_response(server):
    client = server.client()
    try:
        assert outputs_of(client.infer("omit_all", a_input())) == {"E1": [1, 2, 3, 4]}
        only_e2 = client.infer("omit_all", a_input(), outputs=[httpclient.InferRequestedOutput("E2")])
        assert only_e2.get_response().get("outputs", []) == []
    finally:
        client.close()
    server.wait_grpc_ready()
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        result = g.infer("omit_all", a_input(grpcclient))
        assert [o.name for o in result.get_response().outputs] == ["E1"]


def test_an_answer_without_an_output_is_answered_again_from_the_cache(server):
    client = server.client()
    try:
        values = (7, 8, 9, 10)
        for _ in range(2):
            assert outputs_of(client.infer("omit_cached", a_input(values=values))) == {"E1": list(values)}
        stats = client.get_inference_statistics("omit_cached")["model_stats"][0]["inference_stats"]
        assert (stats["cache_hit"]["count"], stats["cache_miss"]["count"]) == (1, 1)
    finally:
        client.close()


def test_an_output_a_step_leaves_out_is_a_missing_optional_input_of_the_next(server):
    client = server.client()
    try:
        assert outputs_of(client.infer("omit_optional", a_input())) == {"E1": [1, 2, 3, 4],
                                                                        "Z": [1001, 1002, 1003, 1004]}
    finally:
        client.close()


def test_an_output_a_step_leaves_out_fails_the_step_that_requires_it_in_its_own_words(server):
    """Triton's core only counts a step request's inputs: while the count fits, the model runs
    without the required one and fails in its own words (here the model reads A as given)."""
    client = server.client()
    try:
        with pytest.raises(InferenceServerException) as e:
            client.infer("omit_required", a_input())
        assert e.value.status() == "500", e.value.message()
        assert e.value.message().startswith(
            "in ensemble 'omit_required', Failed to process the request(s) for model 'optm_0', message: "
            "AttributeError: 'NoneType' object has no attribute 'as_numpy'"), e.value.message()
        # The same inputs from a client are still refused for the missing required input.
        with pytest.raises(InferenceServerException) as direct:
            client.infer("optm", a_input(name="B"))
        assert (direct.value.status(), direct.value.message()) == ("400", (
            "[request id: <id_unknown>] expected number of inputs between 1 and 2 but got 1 inputs for model 'optm'. "
            "Got input(s) ['B'], but missing required input(s) ['A']. Please provide all required input(s)."))
    finally:
        client.close()


def test_an_optional_ensemble_input_left_out_is_left_out_of_the_step(server):
    client = server.client()
    try:
        both = a_input() + a_input(name="B")
        assert outputs_of(client.infer("opt_in", both)) == {"Y": [2, 4, 6, 8]}
        assert outputs_of(client.infer("opt_in", a_input())) == {"Y": [1001, 1002, 1003, 1004]}
        # Fed to a required input, it fails that step with Triton's refusal.
        with pytest.raises(InferenceServerException) as e:
            client.infer("opt_required", a_input())
        assert (e.value.status(), e.value.message()) == ("400", (
            "in ensemble 'opt_required', [request id: <id_unknown>] expected 1 inputs but got 0 inputs for model "
            "'needs_in'. Got input(s) [], but missing required input(s) ['IN']. Please provide all required "
            "input(s)."))
    finally:
        client.close()
    server.wait_grpc_ready()
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        assert g.infer("opt_in", a_input(grpcclient)).as_numpy("Y").tolist() == [1001, 1002, 1003, 1004]


def test_a_step_reads_the_clients_timeout(server):
    """Triton copies the request's timeout into each step's request, as its id and parameters."""
    client = server.client()
    try:
        assert client.infer("timeout_pipe", a_input(), timeout=7000000).as_numpy("T").tolist() == [7000000]
        assert client.infer("timeout_pipe", a_input()).as_numpy("T").tolist() == [0]
    finally:
        client.close()
    server.wait_grpc_ready()
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        assert g.infer("timeout_pipe", a_input(grpcclient), timeout=7000000).as_numpy("T").tolist() == [7000000]


def executions(client, model: str) -> int:
    return int(client.get_inference_statistics(model)["model_stats"][0]["execution_count"])


def test_a_step_that_makes_nothing_wanted_does_not_run(server):
    """Triton does not run a step none of whose outputs reach a requested output: its cost and
    its error stay out of the request."""
    client = server.client()
    try:
        failed = executions(client, "fail")
        x = client.infer("prune_par", a_input(), outputs=[httpclient.InferRequestedOutput("X")])
        assert outputs_of(x) == {"X": [1, 2, 3, 4]}
        assert executions(client, "fail") == failed
        with pytest.raises(InferenceServerException) as e:  # asked for, it runs and fails
            client.infer("prune_par", a_input())
        assert "boom from fail" in e.value.message()
        assert executions(client, "fail") == failed + 1
        # The ensemble counts the failure with its duration, as Triton does (once: docs/compatibility.md).
        fail = client.get_inference_statistics("prune_par")["model_stats"][0]["inference_stats"]["fail"]
        assert fail["count"] == 1 and fail["ns"] > 0, fail
    finally:
        client.close()


def test_a_step_whose_output_a_later_step_reads_runs_when_that_one_is_wanted(server):
    """Triton 2.51 counts such an output twice and prunes its step, so these requests fail there
    with its deadlock error; here a step is left out only when nothing wanted comes of it."""
    client = server.client()
    try:
        ran = executions(client, "optm")
        z = client.infer("prune_chain", a_input(), outputs=[httpclient.InferRequestedOutput("Z")])
        assert outputs_of(z) == {"Z": [1001, 1002, 1003, 1004]}
        assert executions(client, "optm") == ran + 1
        s = client.infer("prune_chain", a_input(), outputs=[httpclient.InferRequestedOutput("S")])
        assert outputs_of(s) == {"S": [1, 2, 3, 4]}
        assert executions(client, "optm") == ran + 1  # Z not wanted: its step did not run
        assert outputs_of(client.infer("prune_chain", a_input())) == {"S": [1, 2, 3, 4], "Z": [1001, 1002, 1003, 1004]}
    finally:
        client.close()
