"""The model repository API's corners, each as Triton 2.51 answers it: an ensemble whose steps
cannot serve does not load (a 400 naming the step: one no repository holds, or one whose own load
failed); a model whose load failed keeps its failure in the index after an unload; load and
unload parameters Triton refuses are refused in its words."""
from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import raw_request, wait_until

REPO = Path(__file__).parent / "models" / "repository_api"
EXAMPLES = Path(__file__).resolve().parent.parent / "model_repository"
INIT_FAILED = "failed to load 'init_fail' version 1: RuntimeError: boom at init"


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([REPO, EXAMPLES], ["--model-control-mode", "explicit"]).wait_grpc_ready()


def _index(client) -> dict[str, dict]:
    return {entry["name"]: entry for entry in client.get_model_repository_index()}


def _load_error(load) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as e:
        load()
    return e.value


def test_an_ensemble_whose_step_no_repository_holds_does_not_load(server):
    c = server.client()
    text = "failed to load 'ens_missing', ensemble ens_missing contains models that are not available or ambiguous: ghost"
    e = _load_error(lambda: c.load_model("ens_missing"))
    assert (e.status(), e.message()) == ("400", text)
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        e = _load_error(lambda: g.load_model("ens_missing"))
        assert (e.status(), e.message()) == ("StatusCode.INVALID_ARGUMENT", text)
    assert _index(c)["ens_missing"] == {"name": "ens_missing", "state": "UNAVAILABLE", "reason": text}
    e = _load_error(lambda: c.get_model_metadata("ens_missing"))
    assert (e.status(), e.message()) == ("404", "Request for unknown model: 'ens_missing' has no available versions")
    assert not c.is_model_ready("ens_missing")


def test_an_ensemble_whose_step_failed_to_load_does_not_load(server):
    c = server.client()
    e = _load_error(lambda: c.load_model("ens_init_fail"))
    assert (e.status(), e.message()) == ("400", "failed to load 'ens_init_fail', ensemble 'ens_init_fail' depends on "
                                                "'init_fail' which has no loaded version. Model 'init_fail' loading "
                                                f"failed with error: {INIT_FAILED}")
    index = _index(c)
    assert index["init_fail"] == {"name": "init_fail", "version": "1", "state": "UNAVAILABLE", "reason": INIT_FAILED}
    assert index["ens_init_fail"]["state"] == "UNAVAILABLE"
    e = _load_error(lambda: c.get_model_metadata("ens_init_fail"))
    assert e.message() == "Request for unknown model: 'ens_init_fail' has no available versions"


def test_a_failed_load_stays_in_the_index_after_an_unload(server):
    c = server.client()
    _load_error(lambda: c.load_model("init_fail"))
    c.unload_model("init_fail")
    assert _index(c)["init_fail"] == {"name": "init_fail", "version": "1", "state": "UNAVAILABLE",
                                      "reason": INIT_FAILED}
    e = _load_error(lambda: c.get_model_metadata("init_fail"))
    assert (e.status(), e.message()) == ("404", "Request for unknown model: 'init_fail' has no available versions")
    # An unloaded ensemble whose load failed forgets it, as Triton does for a load that had no versions.
    c.unload_model("ens_missing")
    assert _index(c)["ens_missing"] == {"name": "ens_missing"}



def test_versions_let_go_when_another_failed_are_listed_as_unloaded(server):
    """As Triton 2.51: when one version of a load fails, the versions that loaded beside it are
    released, so the index lists them UNAVAILABLE "unloaded" (over HTTP and gRPC), and only the
    failed version carries the failure's reason: an operator sees which version to fix."""
    c = server.client()
    failed = "failed to load 'versions_fail' version 2: RuntimeError: boom at init"
    e = _load_error(lambda: c.load_model("versions_fail"))
    assert (e.status(), e.message()) == ("400", failed)
    want = [{"name": "versions_fail", "version": str(v), "state": "UNAVAILABLE", "reason": why}
            for v, why in ((1, "unloaded"), (2, failed), (3, "unloaded"))]
    assert [e for e in c.get_model_repository_index() if e["name"] == "versions_fail"] == want
    with grpcclient.InferenceServerClient(server.grpc_url) as g:
        models = g.get_model_repository_index(as_json=True)["models"]
        assert [m for m in models if m["name"] == "versions_fail"] == want
    r = raw_request(server.port, "GET", "/v2/models/versions_fail/versions/1")
    assert (r.status, r.json()) == (503, {"error": "Request for unknown model: 'versions_fail' version 1 is not at "
                                                   "ready state"})

def _grpc_call(server, unload: bool, **params) -> tuple[str, str]:
    """A load or unload of add_sub with parameters of the types given (tritonclient sends only
    those it knows): (status, details)."""
    kind = service_pb2.RepositoryModelUnloadRequest if unload else service_pb2.RepositoryModelLoadRequest
    request = kind(model_name="add_sub")
    for key, (field, value) in params.items():
        setattr(request.parameters[key], field, value)
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        try:
            (stub.RepositoryModelUnload if unload else stub.RepositoryModelLoad)(request, timeout=60)
            return "OK", ""
        except grpc.RpcError as e:
            return str(e.code()), e.details()


def test_load_and_unload_parameters_triton_refuses(server):
    bad = "StatusCode.INVALID_ARGUMENT"
    assert _grpc_call(server, False, unknown=("string_param", "x")) == (bad, "unrecognized load parameter 'unknown'.")
    assert _grpc_call(server, False, config=("bytes_param", b"{}")) == (
        bad, "invalid value type for load parameter 'config', expected string_param.")
    assert _grpc_call(server, False, **{"file:1/model.py": ("string_param", "x")}) == (
        bad, "invalid value type for load parameter 'file:1/model.py', expected bytes_param.")
    assert _grpc_call(server, True, unload_dependents=("string_param", "true")) == (
        bad, "invalid value type for 'unload_dependents' parameter, expected bool_param.")
    r = raw_request(server.port, "POST", "/v2/repository/models/add_sub/load", b'{"parameters": {"unknown": "x"}}')
    assert (r.status, r.json()) == (400, {"error": "unrecognized load parameter 'unknown'."})
    for value in (b"null", b"5"):  # (Triton: a 500, "attempt to access JSON non-string as string")
        r = raw_request(server.port, "POST", "/v2/repository/models/add_sub/load", b'{"parameters": {"config": %s}}' % value)
        assert (r.status, r.json()) == (400, {"error": "failed to load 'add_sub', the 'config' parameter must be a "
                                                       "JSON string"})
    assert not server.client().is_model_ready("add_sub")  # nothing refused was loaded
    assert _grpc_call(server, False) == ("OK", "")
    assert _grpc_call(server, True, unknown=("string_param", "x")) == ("OK", "")  # as Triton: unload ignores it
    assert not server.client().is_model_ready("add_sub")


def test_a_config_override_that_is_not_an_object_is_refused(server):
    """protobuf's JSON parser reads a list as a config with no fields: the model would load with
    the repository's config, as if no override had been sent."""
    for override in ("[]", "[1]", '[{"name": "add_sub"}]', '"add_sub"', " 5"):
        e = _load_error(lambda: server.client().load_model("add_sub", config=override))
        assert (e.status(), e.message()) == ("400", "failed to load 'add_sub', model 'add_sub': config override: the "
                                                    "override must be a JSON object"), override
    assert not server.client().is_model_ready("add_sub")


def test_request_bodies_of_the_wrong_json_type_get_triton_s_words(server):
    """A load whose ``parameters`` is no object is refused with TritonJson's words (Triton: a 500,
    and nothing loads), as is an index request whose ``ready`` is no boolean (a 400 here, as
    every JSON type error: docs/compatibility.md)."""
    for parameters in (b"1", b"null", b"[]"):
        r = raw_request(server.port, "POST", "/v2/repository/models/add_sub/load", b'{"parameters": %s}' % parameters)
        assert (r.status, r.json()) == (400, {"error": "attempt to get members for non-object"}), parameters
    assert not server.client().is_model_ready("add_sub")
    for ready in (b'"true"', b"1", b"null"):
        r = raw_request(server.port, "POST", "/v2/repository/index", b'{"ready": %s}' % ready)
        assert (r.status, r.json()) == (400, {"error": "attempt to access JSON non-boolean as boolean"}), ready


def test_a_repository_named_in_a_call_is_refused_as_triton_does(server):
    """Triton serves its repositories as one: naming one in a load or unload is its 501
    (UNIMPLEMENTED), while the index ignores the name over HTTP."""
    text = "'repository_name' specification is not supported"
    for action in ("load", "unload"):
        r = raw_request(server.port, "POST", f"/v2/repository/some_repo/models/add_sub/{action}")
        assert (r.status, r.json()) == (501, {"error": text})
    r = raw_request(server.port, "POST", "/v2/repository/some_repo/index")
    assert r.status == 200 and "add_sub" in [entry["name"] for entry in r.json()]
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for call, request in ((stub.RepositoryIndex, service_pb2.RepositoryIndexRequest(repository_name="r")),
                              (stub.RepositoryModelLoad, service_pb2.RepositoryModelLoadRequest(
                                  repository_name="r", model_name="add_sub")),
                              (stub.RepositoryModelUnload, service_pb2.RepositoryModelUnloadRequest(
                                  repository_name="r", model_name="add_sub"))):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=60)
            assert (e.value.code(), e.value.details()) == (grpc.StatusCode.UNIMPLEMENTED, text)
    assert not server.client().is_model_ready("add_sub")


def test_a_call_that_returns_nothing_answers_an_empty_json_body(server):
    """As Triton's: a load, an unload and a shared-memory unregister answer 200 with no body."""
    for path in ("/v2/repository/models/add_sub/load", "/v2/repository/models/add_sub/unload",
                 "/v2/systemsharedmemory/unregister", "/v2/cudasharedmemory/unregister"):
        r = raw_request(server.port, "POST", path)
        assert (r.status, r.body) == (200, b""), path


ADD_ONE = '''import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "B", pb_utils.get_input_tensor_by_name(r, "A").as_numpy() + 1)]) for r in requests]
'''


def test_in_poll_mode_an_ensemble_loads_once_its_missing_step_appears(server_factory, tmp_path):
    """As Triton's polling: the ensemble that failed for a step no repository held loads again
    once that step is added and loads."""
    import shutil

    import numpy as np

    repo = tmp_path / "repo"
    shutil.copytree(REPO / "ens_missing", repo / "ens_missing")
    s = server_factory.start([repo], ["--model-control-mode", "poll", "--repository-poll-secs", "1",
                                      "--exit-on-error", "false", "--strict-readiness", "false"])
    c = s.client()
    assert not c.is_model_ready("ens_missing")
    staged = tmp_path / "ghost"
    (staged / "1").mkdir(parents=True)
    (staged / "config.pbtxt").write_text((REPO / "init_fail" / "config.pbtxt").read_text().replace("init_fail", "ghost"))
    (staged / "1" / "model.py").write_text(ADD_ONE)
    staged.rename(repo / "ghost")
    s.wait_until(lambda: c.is_model_ready("ens_missing"), "the ensemble ready once its step loaded")
    x = httpclient.InferInput("X", [4], "INT32")
    x.set_data_from_numpy(np.arange(4, dtype=np.int32))
    assert c.infer("ens_missing", [x]).as_numpy("Y").tolist() == [1, 2, 3, 4]


def test_the_index_lists_the_repository_as_it_is_now(server_factory, tmp_path):
    """As Triton's index polls the repository: a model folder added after the start is listed
    (and loads), one removed is not, whether it failed or still serves (it answers on)."""
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(EXAMPLES / "add_sub", repo / "add_sub")
    (repo / "broken").mkdir()  # no version, no config: its load fails
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    c = s.client()
    assert set(_index(c)) == {"add_sub", "broken"}
    with pytest.raises(InferenceServerException):
        c.load_model("broken")
    shutil.copytree(EXAMPLES / "add_sub", repo / "fresh")
    config = repo / "fresh" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "add_sub"', 'name: "fresh"'))
    assert _index(c)["fresh"] == {"name": "fresh"}
    c.load_model("fresh")
    assert _index(c)["fresh"]["state"] == "READY"
    shutil.rmtree(repo / "broken")
    shutil.rmtree(repo / "fresh")  # its loaded version serves on, unlisted, as in Triton
    index = _index(c)
    assert "broken" not in index and "fresh" not in index, index
    assert c.is_model_ready("fresh")


def test_unload_dependents_keeps_steps_loaded_by_name_or_used_by_another_ensemble(server_factory):
    """As Triton's cascading unload: an ensemble unloaded with unload_dependents takes along the
    steps it brought, but not one a client loaded by name, nor one another ensemble still uses."""
    s = server_factory.start([Path(__file__).parent / "models" / "ensembles", EXAMPLES],
                             ["--model-control-mode", "explicit"])
    c = s.client()

    def states() -> dict[str, str]:
        """Once the steps that go with an ensemble are done draining."""
        wait_until(lambda: "UNLOADING" not in {e.get("state") for e in _index(c).values()}, "the unloads", 30)
        return {name: e.get("state", "") for name, e in _index(c).items()}

    c.load_model("par")  # brings slow_add and slow_mul
    c.load_model("slow_add")  # ... and now slow_add by name too
    c.unload_model("par", unload_dependents=True)
    after = states()
    assert (after["par"], after["slow_add"], after["slow_mul"]) == ("UNAVAILABLE", "READY", "UNAVAILABLE"), after
    c.load_model("inner")  # brings add_sub
    c.load_model("outer")  # uses inner and add_sub
    c.unload_model("outer", unload_dependents=True)
    after = states()
    assert (after["outer"], after["inner"], after["add_sub"]) == ("UNAVAILABLE", "READY", "READY"), after
    c.unload_model("inner", unload_dependents=True)
    after = states()
    assert (after["inner"], after["add_sub"]) == ("UNAVAILABLE", "UNAVAILABLE"), after


def test_unload_dependents_keeps_a_step_named_at_start_after_its_ensemble(server_factory):
    """``--load-model par --load-model slow_add``: the ensemble's load starts its step first, and
    the step's own start-up load finds it loading; it is still a model named at start, which
    unloading the ensemble with its dependents leaves serving (Triton's)."""
    s = server_factory.start([Path(__file__).parent / "models" / "ensembles", EXAMPLES],
                             ["--model-control-mode", "explicit", "--load-model", "par", "--load-model", "slow_add"])
    c = s.client()
    c.unload_model("par", unload_dependents=True)
    wait_until(lambda: "UNLOADING" not in {e.get("state") for e in _index(c).values()}, "the unloads", 30)
    after = {name: e.get("state", "") for name, e in _index(c).items()}
    assert (after["par"], after["slow_add"], after["slow_mul"]) == ("UNAVAILABLE", "READY", "UNAVAILABLE"), after


def _add_sub_copy(repo: Path, name: str, *, config_name: str | None = None, versions: bool = True,
                  extra: str = "") -> None:
    """add_sub's folder as ``name`` (its config naming ``config_name``), with or without its version folder."""
    import shutil

    shutil.copytree(EXAMPLES / "add_sub", repo / name)
    if not versions:
        shutil.rmtree(repo / name / "1")
    config = repo / name / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "add_sub"', f'name: "{config_name or name}"') + extra)


def test_a_version_of_a_model_that_never_had_one_is_not_found(server_factory, tmp_path):
    """As Triton 2.51: a model whose load failed before it had a version answers a request for a
    version with a final 404 (gRPC NOT_FOUND), not a 503 that invites retries: "version 1 is not
    found" when its policy selected none (no version folder, a policy naming none there), "is not
    found" when Triton's poll refuses its config (a name that is not its folder's, no config.pbtxt
    under --strict-model-config). The index keeps them UNAVAILABLE with the reason (Triton drops
    them, or lists the name alone): an operator sees the failure."""
    import shutil

    repo = tmp_path / "repo"
    repo.mkdir()
    _add_sub_copy(repo, "noversion", versions=False)
    _add_sub_copy(repo, "nopolicy", extra="version_policy { specific { versions: [ 9 ] } }\n")
    _add_sub_copy(repo, "wrongname", config_name="othername")
    shutil.copytree(EXAMPLES / "add_sub" / "1", repo / "noconfig" / "1")
    s = server_factory.start([repo], ["--model-control-mode", "explicit", "--strict-model-config", "true"])
    s.wait_grpc_ready()
    c = s.client()
    texts = {"noversion": "'noversion' version {v} is not found", "nopolicy": "'nopolicy' version {v} is not found",
             "wrongname": "'wrongname' is not found", "noconfig": "'noconfig' is not found"}
    with grpcclient.InferenceServerClient(s.grpc_url) as g:
        for name, text in texts.items():
            _load_error(lambda: c.load_model(name))
            assert _index(c)[name]["state"] == "UNAVAILABLE"
            assert "reason" in _index(c)[name]
            for v in (1, 9):
                want = "Request for unknown model: " + text.format(v=v)
                for path in (f"/v2/models/{name}/versions/{v}", f"/v2/models/{name}/versions/{v}/config"):
                    r = raw_request(s.port, "GET", path)
                    assert (r.status, r.json()) == (404, {"error": want}), path
                r = raw_request(s.port, "POST", f"/v2/models/{name}/versions/{v}/infer",
                                b'{"inputs":[{"name":"INPUT0","datatype":"INT32","shape":[16],"data":[0]}]}')
                assert (r.status, r.json()) == (404, {"error": want})
                assert not c.is_model_ready(name, str(v))
                for call in (lambda: g.get_model_metadata(name, str(v)), lambda: g.get_model_config(name, str(v)),
                             lambda: g.infer(name, [grpcclient.InferInput("INPUT0", [16], "INT32")], str(v))):
                    e = _load_error(call)
                    assert (e.status(), e.message()) == ("StatusCode.NOT_FOUND", want)
                assert not g.is_model_ready(name, str(v))
            e = _load_error(lambda: c.get_model_metadata(name))  # (Triton: "is not found" for the last two)
            assert (e.status(), e.message()) == ("404", f"Request for unknown model: '{name}' has no available versions")


def test_a_failed_override_keeps_the_versions_unloaded_before_in_the_index(server_factory, tmp_path):
    """As Triton 2.51: after v1 served, then an override serving v2 only (v1 UNAVAILABLE
    "unloaded"), an override that fails (a policy naming no folder, a config that does not parse)
    leaves v2 serving and v1 listed as before."""
    import json
    import shutil

    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLES / "add_sub" / "1", repo / "add_sub" / "2")
    shutil.copytree(EXAMPLES / "add_sub", repo / "add_sub", dirs_exist_ok=True)
    s = server_factory.start([repo], ["--model-control-mode", "explicit"])
    c = s.client()
    c.load_model("add_sub")
    config = c.get_model_config("add_sub")

    def policy(versions: list[int]) -> str:
        return json.dumps({**config, "version_policy": {"specific": {"versions": versions}}})

    c.load_model("add_sub", config=policy([1]))
    unloaded = {"name": "add_sub", "version": "2", "state": "UNAVAILABLE", "reason": "unloaded"}
    s.wait_until(lambda: unloaded in c.get_model_repository_index(), "v2 unloaded")
    for bad in (policy([9]), "{"):
        _load_error(lambda: c.load_model("add_sub", config=bad))
        index = c.get_model_repository_index()
        assert [(e["version"], e["state"]) for e in index] == [("1", "READY"), ("2", "UNAVAILABLE")], index
        assert index[1] == unloaded
        r = raw_request(s.port, "GET", "/v2/models/add_sub/versions/2")
        assert (r.status, r.json()) == (503, {"error": "Request for unknown model: 'add_sub' version 2 is not at ready state"})
    # An unload then lists both: the version it unloaded and the one the override dropped before.
    c.unload_model("add_sub")
    s.wait_until(lambda: [(e["version"], e["state"], e.get("reason")) for e in c.get_model_repository_index()]
                 == [("1", "UNAVAILABLE", "unloaded"), ("2", "UNAVAILABLE", "unloaded")], "both versions unloaded")
