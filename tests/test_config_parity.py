"""Config handling seen side by side with Triton 2.51: what a Python model is told of its
instance's kind, which version folders count, and how ``model_warmup`` batches and skips samples.
Each expectation is Triton's own answer or log line for the same repository.
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import raw_request

# Answers with its instance's kind and the input shapes of each earlier execute() (the warm-up's).
REPORT_PY = textwrap.dedent("""\
    import json
    import numpy as np
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            self.kind = args["model_instance_kind"]
            self.seen = []

        def execute(self, requests):
            self.seen.append([list(pb_utils.get_input_tensor_by_name(r, "X").as_numpy().shape) for r in requests])
            report = json.dumps({"kind": self.kind, "seen": self.seen[:-1]})
            out = np.array([report.encode()], dtype=np.object_)
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", out.reshape(
                pb_utils.get_input_tensor_by_name(r, "X").as_numpy().shape[:-1] + (1,)))]) for r in requests]
    """)

SAMPLE = ('{ name: "%s" %s inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true } } }')


def _model(repo: Path, name: str, config: str, versions: tuple[str, ...] = ("1",)) -> None:
    (repo / name).mkdir()
    (repo / name / "config.pbtxt").write_text(textwrap.dedent(f"""\
        name: "{name}"
        backend: "python"
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "Y" data_type: TYPE_STRING dims: [ 1 ] }} ]
        """) + config)
    for v in versions:
        (repo / name / v).mkdir()
        (repo / name / v / "model.py").write_text(REPORT_PY)


MODELS = {"kind_model", "leading_zeros", "spec_missing", "warm_unbatched", "warm_batches", "warm_huge"}


@pytest.fixture(scope="module")
def parity_server(module_factory, tmp_path_factory):
    repo = tmp_path_factory.mktemp("config_parity")
    _model(repo, "kind_model", "max_batch_size: 0\ninstance_group [ { kind: KIND_MODEL } ]\n")
    _model(repo, "leading_zeros", "max_batch_size: 0\n", versions=("1", "007"))
    _model(repo, "spec_missing", "max_batch_size: 0\nversion_policy { specific { versions: [ 1, 7 ] } }\n")
    _model(repo, "warm_unbatched", f"max_batch_size: 0\nmodel_warmup [ {SAMPLE % ('w', 'batch_size: 2')} ]\n")
    _model(repo, "warm_huge", f"max_batch_size: 0\nmodel_warmup [ {SAMPLE % ('w', 'batch_size: 4000000000')} ]\n")
    _model(repo, "warm_batches", f"max_batch_size: 4\nmodel_warmup [ {SAMPLE % ('w', 'batch_size: 3 count: 2')}, "
                                 f"{SAMPLE % ('unset', '')} ]\n")
    s = module_factory.create([repo], ["--exit-on-error=false"]).start()

    def settled() -> bool:
        raw = raw_request(s.port, "POST", "/v2/repository/index", b"{}") if s.http_status("/v2/health/live") == 200 \
            else None
        if raw is None or raw.status != 200:
            return False
        states = {e["name"]: e.get("state") for e in raw.json()}
        return set(states) >= MODELS and all(states[n] in ("READY", "UNAVAILABLE") for n in MODELS)

    s.wait_until(settled, "settled")
    return s


def _index(server) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for entry in raw_request(server.port, "POST", "/v2/repository/index", b"{}").json():
        out.setdefault(entry["name"], []).append(entry)
    return out


def _report(server, model: str, shape: list[int]) -> dict:
    x = httpclient.InferInput("X", shape, "FP32")
    x.set_data_from_numpy(np.zeros(shape, dtype=np.float32))
    return json.loads(server.client().infer(model, [x]).as_numpy("Y").reshape(-1)[0])


def test_a_kind_model_instance_is_told_model(parity_server):
    """Triton's Python backend gives args['model_instance_kind'] as the group's kind: MODEL."""
    assert _report(parity_server, "kind_model", [4])["kind"] == "MODEL"


def test_a_version_folder_with_leading_zeros_is_passed_over(parity_server):
    """Triton ignores '007' (it is not version 7) with a warning, and serves version 1."""
    assert [(e["version"], e["state"]) for e in _index(parity_server)["leading_zeros"]] == [("1", "READY")]
    assert ("ignore version directory '007' which contains leading zeros in its directory name"
            in parity_server.log())


def test_a_specific_version_without_its_folder_is_logged(parity_server):
    assert [(e["version"], e["state"]) for e in _index(parity_server)["spec_missing"]] == [("1", "READY")]
    assert ("version 7 is specified for model 'spec_missing', but the version directory is not present"
            in parity_server.log())


def test_warmup_of_several_items_on_a_model_that_does_not_batch_fails(parity_server):
    """Triton makes batch_size requests, which a backend refuses as a batch of that many."""
    [entry] = _index(parity_server)["warm_unbatched"]
    assert entry["state"] == "UNAVAILABLE"
    assert entry["reason"].endswith("failed to run warmup sample 'w': "
                                     + "batch size 2 for 'warm_unbatched_0', max allowed is 0; " * 2)


def test_a_huge_warmup_batch_is_refused_in_a_few_words(parity_server):
    """Triton says its refusal once per request of the batch: a config's batch_size of 4e9 made a
    string of hundreds of GB in the worker. Said eight times, then how many more."""
    [entry] = _index(parity_server)["warm_huge"]
    assert entry["state"] == "UNAVAILABLE"
    assert entry["reason"].endswith("failed to run warmup sample 'w': "
                                    + "batch size 4000000000 for 'warm_huge_0', max allowed is 0; " * 8
                                    + "(and 3999999992 more)"), entry["reason"][-200:]


def test_warmup_runs_batch_size_requests_of_one_item_and_skips_batch_zero(parity_server):
    """Each of the sample's 2 executions takes 3 requests of shape [1, 4] (Triton's), and the
    sample that sets no batch_size (0) is skipped."""
    assert _report(parity_server, "warm_batches", [1, 4])["seen"] == [[[1, 4]] * 3] * 2


def test_the_backend_is_inferred_with_auto_complete_disabled(server_factory, tmp_path):
    """Triton 2.51 with --disable-auto-complete-config serves a config.pbtxt that names no
    backend beside a model.py: its server-side completion of backend fields always runs."""
    _model(tmp_path, "no_backend", "max_batch_size: 0\n")
    text = (tmp_path / "no_backend" / "config.pbtxt").read_text()
    (tmp_path / "no_backend" / "config.pbtxt").write_text(text.replace('backend: "python"\n', ""))
    s = server_factory.create([tmp_path], ["--disable-auto-complete-config"]).start().wait_ready()
    assert s.client().get_model_config("no_backend")["backend"] == "python"
    assert _report(s, "no_backend", [4])["kind"] == "CPU"
