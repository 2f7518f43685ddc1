"""Model configuration errors: with --exit-on-error=false the good models serve and the repository
index names each bad model, UNAVAILABLE, with a reason naming the model and the field; with the
default (exit on error) the server exits with a non-zero code.
"""
from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import raw_request, shm_entries

IDENTITY_PY = textwrap.dedent("""\
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X")
                                                                .as_numpy())]) for r in requests]
    """)

INIT_FAILS_PY = textwrap.dedent("""\
    class TritonPythonModel:
        def initialize(self, args):
            raise RuntimeError("cannot open weights file /nonexistent/weights.bin")

        def execute(self, requests):
            return []
    """)


def _config(name: str, backend: str = "python", input_block: str | None = None) -> str:
    inputs = input_block or '{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }'
    return textwrap.dedent(f"""\
        name: "{name}"
        backend: "{backend}"
        max_batch_size: 0
        input [ {inputs} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        """)


def _model(repo: Path, folder: str, config: str, model_py: str | None = IDENTITY_PY) -> None:
    (repo / folder / "1").mkdir(parents=True)
    (repo / folder / "config.pbtxt").write_text(config)
    if model_py is not None:
        (repo / folder / "1" / "model.py").write_text(model_py)


# field each bad model gets wrong -> words its reason must contain (besides the model's name)
CONFIG_ERRORS = {
    "bad_backend": ["nosuchbackend", "backend"],
    "dup_input": ["'X'", "input"],
    "zero_dims": ["dims", "'X'"],
    "no_model_py": ["model.py"],
    "name_mismatch": ["other_name", "name"],
    # Triton's checks of batch inputs and outputs, with its texts (ragged batching itself loads)
    "batch_in": ["unknown source input name 'Z' for batch_in"],
    "batch_out": ["unknown target output name 'Q' for batch_out"],
    # what Triton 2.51 refuses at load, in its words (a side-by-side run with it)
    "scalar_reshape": ["model input 'X' cannot have empty reshape for non-batching model as scalar tensors are "
                       "not supported"],
    "reshape_size": ["model input 'X' has different size for dims and reshape"],
    "reshape_trunks": ["model input 'X' has different number of variable-size dimensions for dims and reshape"],
    "cpu_gpus": ["instance group cpu_gpus_0 of model cpu_gpus has kind KIND_CPU but specifies one or more GPUs"],
    "no_versions": ["at least one version must be available under the version policy of model 'no_versions'"],
    "nhwc": ["model input 'X' NHWC/NCHW require 3 dims"],
    "seq_unnamed": ["sequence batching control tensor must have a name for seq_unnamed"],
    "seq_pair": ["sequence batching control 'int32_false_true' must have exactly 2 entries for CONTROL_SEQUENCE_START "
                 "for seq_pair"],
    "seq_no_values": ["sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
                      "'bool_false_true' for CONTROL_SEQUENCE_END for seq_no_values"],
    # a CORRID of a type Triton does not take, or of none (TYPE_INVALID), refused in its words
    "seq_corrid_fp32": ["unexpected data type for control CONTROL_SEQUENCE_CORRID for seq_corrid_fp32. Allowed data "
                        "types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"],
    "seq_corrid_untyped": ["unexpected data type for control CONTROL_SEQUENCE_CORRID for seq_corrid_untyped. Allowed "
                           "data types are TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING"],
}


@pytest.fixture(scope="module")
def config_error_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("config_errors")
    _model(repo, "good", _config("good"))
    _model(repo, "bad_backend", _config("bad_backend", backend="nosuchbackend"))
    _model(repo, "dup_input", _config("dup_input", input_block=(
        '{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "X" data_type: TYPE_FP32 dims: [ 4 ] }')))
    _model(repo, "zero_dims", _config("zero_dims", input_block='{ name: "X" data_type: TYPE_FP32 dims: [ 0 ] }'))
    _model(repo, "no_model_py", _config("no_model_py"), model_py=None)
    (repo / "no_model_py" / "1" / "README.txt").write_text("the model file is missing on purpose\n")
    _model(repo, "name_mismatch", _config("other_name"))
    _model(repo, "batch_in", _config("batch_in") + textwrap.dedent("""\
        batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "N" data_type: TYPE_FP32 source_input: "Z" } ]
        """))
    _model(repo, "batch_out", _config("batch_out", input_block=(
        '{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] allow_ragged_batch: true }')) + textwrap.dedent("""\
        batch_output [ { target_name: "Q" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "X" } ]
        """))
    _model(repo, "scalar_reshape", _config("scalar_reshape", input_block=(
        '{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] reshape { shape: [ ] } }')))
    _model(repo, "reshape_size", _config("reshape_size", input_block=(
        '{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] reshape { shape: [ 3 ] } }')))
    _model(repo, "reshape_trunks", _config("reshape_trunks", input_block=(
        '{ name: "X" data_type: TYPE_FP32 dims: [ -1, 4 ] reshape { shape: [ -1, 2, -1 ] } }')))
    _model(repo, "cpu_gpus", _config("cpu_gpus") + "instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]\n")
    _model(repo, "no_versions", _config("no_versions") + "version_policy { latest { num_versions: 0 } }\n")
    _model(repo, "nhwc", _config("nhwc", input_block='{ name: "X" data_type: TYPE_FP32 format: FORMAT_NHWC dims: [ 4 ] }'))
    sequence = 'sequence_batching { control_input [ %s ] }\n'
    _model(repo, "seq_unnamed", _config("seq_unnamed") + sequence % (
        '{ control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] }'))
    _model(repo, "seq_pair", _config("seq_pair") + sequence % (
        '{ name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0 ] } ] }'))
    _model(repo, "seq_no_values", _config("seq_no_values") + sequence % (
        '{ name: "E" control [ { kind: CONTROL_SEQUENCE_END } ] }'))
    _model(repo, "seq_corrid_fp32", _config("seq_corrid_fp32") + sequence % (
        '{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] }'))
    _model(repo, "seq_corrid_untyped", _config("seq_corrid_untyped") + sequence % (
        '{ name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID } ] }'))
    # a field shmserve does not implement that only loses a feature: the model loads, with a warning;
    # and the response cache asked for on a server without one: the model loads, caching nothing
    _model(repo, "cached", _config("cached") + 'model_operations { op_library_filename: "libnone.so" }\n'
           "response_cache { enable: true }\n"
           'model_metrics { metric_control [ { metric_identifier { family: "nv_inference_first_response_histogram_ms" }'
           " histogram_options { buckets: [ 1, 10 ] } } ] }\n")
    return repo


@pytest.fixture(scope="module")
def init_error_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("init_errors")
    _model(repo, "good", _config("good"))
    _model(repo, "init_fails", _config("init_fails"), model_py=INIT_FAILS_PY)
    return repo


def _index(server) -> list[dict]:
    raw = raw_request(server.port, "POST", "/v2/repository/index", b"{}")
    assert raw.status == 200, raw
    return raw.json()


def _start_settled(factory, repo: Path, names: set[str]):
    """Start with --exit-on-error=false and wait until every model has reached a final state."""
    s = factory.create([repo], ["--exit-on-error=false"]).start()

    def settled() -> bool:
        if s.http_status("/v2/models/good/ready") != 200:
            return False
        try:
            entries = _index(s)
        except (OSError, AssertionError):
            return False
        states = {e["name"]: e.get("state") for e in entries}
        return set(states) >= names and all(states[n] in ("READY", "UNAVAILABLE") for n in names)

    s.wait_until(settled, "settled")
    return s


@pytest.fixture(scope="module")
def config_error_server(module_factory, config_error_repo):
    return _start_settled(module_factory, config_error_repo, {"good", "cached", *CONFIG_ERRORS})


@pytest.fixture(scope="module")
def init_error_server(module_factory, init_error_repo):
    return _start_settled(module_factory, init_error_repo, {"good", "init_fails"})


def _becomes_ready(server, seconds: float = 2.5) -> bool:
    """Whether /v2/health/ready answers 200 at any point within ``seconds`` (the broker decides
    readiness on its housekeeping tick, a moment after the last model settles)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.http_status("/v2/health/ready") == 200:
            return True
        time.sleep(0.05)
    return False


def _good_model_serves(server) -> None:
    client = server.client()
    x = np.array([1.5, -2.0, 0.0, 7.25], dtype=np.float32)
    inp = httpclient.InferInput("X", [4], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("good", [inp]).as_numpy("Y"), x)
    assert client.is_model_ready("good")


# -- --exit-on-error=false -----------------------------------------------------------------------


def test_good_model_serves_beside_bad_configs(config_error_server):
    _good_model_serves(config_error_server)


@pytest.mark.parametrize("model", sorted(CONFIG_ERRORS))
def test_index_shows_bad_config_unavailable_with_reason(config_error_server, model):
    entries = {e["name"]: e for e in _index(config_error_server)}
    assert entries["good"]["state"] == "READY"
    entry = entries[model]
    assert entry["state"] == "UNAVAILABLE", entry
    reason = entry.get("reason", "")
    assert model in reason, entry
    for word in CONFIG_ERRORS[model]:
        assert word in reason, (word, entry)


@pytest.mark.parametrize("model", sorted(CONFIG_ERRORS))
def test_bad_config_model_is_not_ready_and_refuses_inference(config_error_server, model):
    client = config_error_server.client()
    assert not client.is_model_ready(model)
    inp = httpclient.InferInput("X", [4], "FP32")
    inp.set_data_from_numpy(np.zeros(4, dtype=np.float32))
    with pytest.raises(InferenceServerException) as e:
        client.infer(model, [inp])
    # Triton 2.51's answers for a model whose load failed, word for word
    assert e.value.status() == "404"
    assert e.value.message() == f"Request for unknown model: '{model}' has no available versions"
    with pytest.raises(InferenceServerException) as e:
        client.get_model_metadata(model)
    assert e.value.status() == "404" and "has no available versions" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer(model, [inp], model_version="1")
    # A version of a model Triton's poll refused, or that has none its policy selects, is not found (final)
    status, text = {"name_mismatch": ("404", "is not found"), "no_versions": ("404", "version 1 is not found")}.get(
        model, ("503", "version 1 is not at ready state"))
    assert (e.value.status(), e.value.message()) == (status, f"Request for unknown model: '{model}' {text}")


def test_bad_configs_are_logged(config_error_server):
    log = config_error_server.log()
    for model in CONFIG_ERRORS:
        assert model in log


def test_ready_index_lists_only_loaded_models(config_error_server):
    raw = raw_request(config_error_server.port, "POST", "/v2/repository/index", json.dumps({"ready": True}).encode())
    assert raw.status == 200
    assert [e["name"] for e in raw.json()] == ["cached", "good"]


def test_unimplemented_field_loads_with_a_warning_naming_it(config_error_server):
    client = config_error_server.client()
    assert client.is_model_ready("cached")
    x = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
    inp = httpclient.InferInput("X", [4], "FP32")
    inp.set_data_from_numpy(x)
    np.testing.assert_array_equal(client.infer("cached", [inp]).as_numpy("Y"), x)
    warnings = [line for line in config_error_server.log().splitlines()
                if "model 'cached': config field 'model_operations' is not supported yet and has no effect" in line]
    assert warnings and all(line.startswith("W") for line in warnings), warnings
    assert "config field 'model_metrics'" not in config_error_server.log()  # honoured (test_latency_histograms.py)


def test_response_cache_without_a_server_cache_runs_every_request(config_error_server):
    """As Triton: the model loads and nothing is cached (the server has no --cache-config);
    here the load also says so."""
    client = config_error_server.client()
    before = client.get_inference_statistics("cached")["model_stats"][0]["execution_count"]
    inp = httpclient.InferInput("X", [4], "FP32")
    inp.set_data_from_numpy(np.array([5.0, 6.0, 7.0, 8.0], dtype=np.float32))
    for _ in range(2):
        client.infer("cached", [inp])
    stats = client.get_inference_statistics("cached")["model_stats"][0]
    assert stats["execution_count"] == before + 2
    assert stats["inference_stats"]["cache_hit"]["count"] == 0
    notes = [line for line in config_error_server.log().splitlines()
             if "model 'cached': response_cache is enabled but the server has no response cache" in line]
    assert notes and all(line.startswith("W") for line in notes), notes


def test_strict_readiness_counts_bad_configs(config_error_server):
    assert config_error_server.http_status("/v2/health/live") == 200
    assert not _becomes_ready(config_error_server)


def test_model_failing_in_initialize(init_error_server):
    _good_model_serves(init_error_server)
    entries = {e["name"]: e for e in _index(init_error_server)}
    entry = entries["init_fails"]
    assert entry["state"] == "UNAVAILABLE"
    assert "init_fails" in entry["reason"]
    assert "cannot open weights file /nonexistent/weights.bin" in entry["reason"]
    assert not init_error_server.client().is_model_ready("init_fails")
    # The failed instance's worker is gone; the good one's remains.
    assert init_error_server.worker_pids("init_fails") == []
    assert len(init_error_server.worker_pids("good")) == 1


def test_strict_readiness_with_failed_initialize(init_error_server):
    assert init_error_server.http_status("/v2/health/live") == 200
    assert not _becomes_ready(init_error_server)


def test_non_strict_readiness_is_ready_despite_bad_models(server_factory, init_error_repo):
    s = server_factory.create([init_error_repo], ["--exit-on-error=false", "--strict-readiness=false"]).start()
    s.wait_ready()
    _good_model_serves(s)


# -- default: exit on error ---------------------------------------------------------------------


@pytest.mark.parametrize("repo_fixture,needle", [
    ("config_error_repo", "nosuchbackend"),
    ("init_error_repo", "cannot open weights file"),
])
def test_default_exit_on_error_exits_non_zero(server_factory, request, repo_fixture, needle):
    repo = request.getfixturevalue(repo_fixture)
    s = server_factory.create([repo]).start()
    code = s.wait_exit(60)
    assert code != 0, s.log_tail()
    log = s.log()
    assert needle in log
    assert shm_entries(s.id) == [], "exit on error left shared-memory objects behind"
    assert s.http_status("/v2/health/live", timeout=1) is None  # nothing listens any more
