"""An ensemble whose steps cannot serve does not load, as in Triton 2.51: its load is a 400
naming the step (one no repository holds, or one whose own load failed), and it serves nothing.
A model whose load failed keeps its failure in the index after an unload, as Triton keeps it."""
from __future__ import annotations

from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

REPO = Path(__file__).parent / "models" / "ensemble_loads"
INIT_FAILED = "failed to load 'init_fail' version 1: RuntimeError: boom at init"


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start([REPO], ["--model-control-mode", "explicit"]).wait_grpc_ready()


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
