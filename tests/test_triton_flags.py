"""``tritonserver`` flags a Triton command line brings: each one starts the server and either
works or is named in the log at start (server/triton_flags.py)."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, wait_until

AUTO_COMPLETING_PY = textwrap.dedent("""\
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(config):
            config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})
            config.add_output({"name": "Y", "data_type": "TYPE_FP32", "dims": [4]})
            return config

        def execute(self, requests):
            return [pb_utils.InferenceResponse([]) for _ in requests]
    """)


def _empty_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    return repo


def _metrics_status(address: str, port: int) -> int | None:
    """The status of GET /metrics at ``address``, or None when nothing answers there."""
    try:
        with urllib.request.urlopen(f"http://{address}:{port}/metrics", timeout=5) as r:
            return r.status
    except urllib.error.URLError:
        return None


def test_triton_flags_start_the_server_and_are_named(server_factory, tmp_path):
    s = server_factory.start([_empty_repo(tmp_path)], [
        "--model-load-thread-count", "4", "--allow-http=true",
        "--backend-config", "python,shm-default-byte-size=1048576", "--backend-config", "default-max-batch-size=8",
        "--backend-config", "pytorch,no-such-setting=1", "--backend-config", "onnxruntime,default-max-batch-size=16",
        "--grpc-use-ssl=false", "--grpc-infer-allocation-pool-size", "8", "--grpc-max-response-pool-size", "4",
        "--grpc-infer-thread-count", "4"])
    log = s.log()
    for line in [
        "--backend-config pytorch,no-such-setting=1 is not supported and has no effect",
        "--grpc-infer-allocation-pool-size 8 has no effect: grpcio allocates each call's state itself",
        "--grpc-max-response-pool-size 4 has no effect: each response is sent as soon as it is built",
        "--grpc-infer-thread-count 4 has no effect: one gRPC process serves every call on one asyncio loop",
        "--model-load-thread-count 4: every model instance loads in a process of its own",
    ]:
        assert line in log, line
    assert "--grpc-use-ssl" not in log  # a flag that works is not named
    assert "shm-default-byte-size" not in log  # honoured: it sizes each worker's first output extent
    assert "default-max-batch-size" not in log  # honoured: ONNX auto-completion's max_batch_size (test_onnx.py)
    assert s.client().is_server_ready()


def test_allow_grpc_false_serves_no_grpc(server_factory, tmp_path):
    s = server_factory.start([_empty_repo(tmp_path)], ["--allow-grpc=false"])
    assert s.client().is_server_ready()
    assert "gRPC" not in s.log()
    assert not any(t.startswith("shmserve grpc ") for t in s.titles().values())


def test_grpc_port_and_address_are_served(server_factory, tmp_path):
    s = server_factory.start([_empty_repo(tmp_path)])  # conftest passes --grpc-address and a free --grpc-port
    assert f"serving gRPC on 127.0.0.1:{s.grpc_port}" in s.log()
    s.wait_grpc_ready()
    assert [t for t in s.titles().values() if t.startswith("shmserve grpc ")] == [f"shmserve grpc {s.id}"]


def test_metrics_address_binds_the_metrics_server_there(server_factory, tmp_path):
    s = server_factory.start([_empty_repo(tmp_path)], ["--metrics-address", "127.0.0.2"])
    wait_until(lambda: _metrics_status("127.0.0.2", s.metrics_port) == 200, "metrics served on 127.0.0.2")
    assert _metrics_status("127.0.0.1", s.metrics_port) is None


def test_metrics_address_defaults_to_http_address(server_factory, tmp_path):
    s = server_factory.start([_empty_repo(tmp_path)])  # --http-address 127.0.0.1 (conftest)
    wait_until(lambda: _metrics_status("127.0.0.1", s.metrics_port) == 200, "metrics served on 127.0.0.1")
    assert _metrics_status("127.0.0.2", s.metrics_port) is None


def test_disable_auto_complete_config_keeps_the_config_as_written(server_factory, tmp_path):
    """As Triton: the model's auto_complete_config does not run, and the model loads with the
    config as written (here, without inputs or outputs); without the flag it runs."""
    repo = _empty_repo(tmp_path)
    (repo / "auto" / "1").mkdir(parents=True)
    (repo / "auto" / "config.pbtxt").write_text('name: "auto"\nbackend: "python"\nmax_batch_size: 0\n')
    (repo / "auto" / "1" / "model.py").write_text(AUTO_COMPLETING_PY)
    strict = server_factory.start([repo], ["--disable-auto-complete-config"])
    assert strict.client().is_model_ready("auto")
    config = strict.client().get_model_config("auto")
    assert config.get("input", []) == [] and config.get("output", []) == [], config
    metadata = strict.client().get_model_metadata("auto")
    assert metadata.get("inputs", []) == [] and metadata.get("outputs", []) == [], metadata
    completing = server_factory.start([repo])
    config = completing.client().get_model_config("auto")
    assert [t["name"] for t in config["input"]] == ["X"] and [t["name"] for t in config["output"]] == ["Y"]


DIMS_COMPLETING_PY = textwrap.dedent("""
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        @staticmethod
        def auto_complete_config(config):
            config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})
            return config

        def execute(self, requests):
            return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X")
                                                                .as_numpy())]) for r in requests]
""")


def test_a_tensor_whose_dims_auto_complete_fills_loads_and_without_it_is_refused(server_factory, tmp_path):
    """Triton validates the completed config: an input the config names without dims, which the
    model's auto_complete_config gives dims, loads; with --disable-auto-complete-config it is
    refused for having none ("must specify 'dims'")."""
    repo = _empty_repo(tmp_path)
    (repo / "dims" / "1").mkdir(parents=True)
    (repo / "dims" / "config.pbtxt").write_text(
        'name: "dims"\nbackend: "python"\nmax_batch_size: 8\ninput [ { name: "X" data_type: TYPE_FP32 } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n')
    (repo / "dims" / "1" / "model.py").write_text(DIMS_COMPLETING_PY)
    s = server_factory.start([repo])
    assert [t["dims"] for t in s.client().get_model_config("dims")["input"]] == [[4]]
    strict = server_factory.start([repo], ["--disable-auto-complete-config", "--exit-on-error=false",
                                           "--strict-readiness=false"])
    index = {e["name"]: e for e in strict.client().get_model_repository_index()}
    assert "input 'X' must specify 'dims'" in index["dims"]["reason"], index


# `tritonserver --help` of Triton 2.51, as test data: every flag it lists must be known here.
TRITON_HELP = Path(__file__).parent / "data" / "tritonserver-2.51-help.txt"
DOCS = Path(__file__).resolve().parents[1] / "docs"


def _triton_flags() -> list[str]:
    flags = [f for f in re.findall(r"^  (--[a-z0-9-]+)", TRITON_HELP.read_text(), re.M) if f != "--help"]
    assert len(flags) > 80, "the help text lists Triton's flags"
    return flags


def test_every_tritonserver_flag_is_known_and_in_the_docs():
    """A Triton command line never meets 'unrecognized arguments': each flag of Triton's help
    text is parsed here and either works (docs/flags.md) or is in docs/compatibility.md's table
    of flags that do less, which says what it does here."""
    from shmserve.server.cli import build_parser

    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    documented = (DOCS / "flags.md").read_text() + (DOCS / "compatibility.md").read_text()
    missing = [f for f in _triton_flags() if f not in known]
    assert missing == [], f"tritonserver flags shmserve does not parse: {missing}"
    undocumented = [f for f in _triton_flags() if not re.search(rf"`{re.escape(f)}[` =\[]", documented)]
    assert undocumented == [], f"tritonserver flags no doc names: {undocumented}"


def test_every_flag_that_does_nothing_here_is_named_at_start(server_factory, tmp_path):
    """Each of Triton's flags with nothing to act on is accepted and named in a WARNING, with
    why; the deprecated trace flags are read as their --trace-config settings."""
    from shmserve.server.triton_flags import NO_EFFECT_FLAGS

    values = {"BOOL": "true", "N": "2", "PATH": str(tmp_path), "GPU:BYTES": "0:1024", "GPU:FRACTION": "0:0.5",
              "X.Y": "6.0", "REGEX": "x-.*", "NAME,SETTING=VALUE": "numa0,cpu-cores=0-1", "PORT": "8080",
              "LOW-HIGH": "8080-8090", "MODEL": "m", "BYTES": "1024"}
    args = [f"{flag}={values[metavar]}" for flag, (metavar, _) in NO_EFFECT_FLAGS.items()]
    trace = tmp_path / "trace.json"
    s = server_factory.start([_empty_repo(tmp_path)], [*args, f"--trace-file={trace}", "--trace-level=TIMESTAMPS",
                                                        "--trace-rate=1", "--trace-count=5",
                                                        "--model-namespacing=false", "--allow-sagemaker=false",
                                                        "--allow-vertex-ai=false"])
    log = s.log()
    for flag, (metavar, why) in NO_EFFECT_FLAGS.items():
        assert f"{flag} {values[metavar]} has no effect: {why}" in log, flag
    assert "--trace-rate is deprecated: use --trace-config rate=1" in log
    setting = s.client().get_trace_settings()
    assert setting["trace_level"] == ["TIMESTAMPS"] and setting["trace_rate"] == "1", setting
    assert setting["trace_count"] == "5" and setting["trace_file"] == str(trace), setting


@pytest.mark.parametrize("flag", ["--model-namespacing", "--allow-sagemaker", "--allow-vertex-ai"])
def test_a_switch_for_what_is_not_served_is_refused_by_name(flag, tmp_path):
    r = subprocess.run([sys.executable, "-m", "shmserve", "--model-repository", str(_empty_repo(tmp_path)),
                        f"{flag}=true"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert f"{flag}=true is not supported" in r.stderr


def test_model_config_name_picks_the_custom_config(server_factory, tmp_path):
    """As Triton's --model-config-name: configs/<name>.pbtxt where a model has it, else its
    config.pbtxt."""
    repo = _empty_repo(tmp_path)
    for model in ("custom", "plain"):
        (repo / model / "1").mkdir(parents=True)
        (repo / model / "1" / "model.py").write_text(AUTO_COMPLETING_PY)
        (repo / model / "config.pbtxt").write_text(f'name: "{model}"\nbackend: "python"\nmax_batch_size: 2\n')
    (repo / "custom" / "configs").mkdir()
    (repo / "custom" / "configs" / "small.pbtxt").write_text('name: "custom"\nbackend: "python"\nmax_batch_size: 7\n')
    s = server_factory.start([repo], ["--model-config-name=small"])
    assert s.client().get_model_config("custom")["max_batch_size"] == 7
    assert s.client().get_model_config("plain")["max_batch_size"] == 2


FAILS_ONCE_PY = textwrap.dedent("""\
    import os
    import triton_python_backend_utils as pb_utils


    class TritonPythonModel:
        def initialize(self, args):
            marker = os.path.join(os.path.dirname(__file__), "tried")
            if not os.path.exists(marker):
                open(marker, "w").close()
                raise RuntimeError("the first load fails")

        def execute(self, requests):
            return [pb_utils.InferenceResponse([]) for _ in requests]
    """)


def test_model_load_retry_count_tries_a_failed_load_again(server_factory, tmp_path):
    repo = _empty_repo(tmp_path)
    (repo / "flaky" / "1").mkdir(parents=True)
    (repo / "flaky" / "config.pbtxt").write_text('name: "flaky"\nbackend: "python"\nmax_batch_size: 0\n'
                                                 'input [{ name: "X" data_type: TYPE_FP32 dims: [1] }]\n'
                                                 'output [{ name: "Y" data_type: TYPE_FP32 dims: [1] }]\n')
    (repo / "flaky" / "1" / "model.py").write_text(FAILS_ONCE_PY)
    s = server_factory.start([repo], ["--model-load-retry-count=1"])
    assert s.client().is_model_ready("flaky")
    assert "the first load fails; trying again (retry 1 of 1)" in s.log()
    (repo / "flaky" / "1" / "tried").unlink()
    no_retry = server_factory.start([repo], ["--exit-on-error=false", "--strict-readiness=false"])
    assert not no_retry.client().is_model_ready("flaky")


SLOW_TO_LOAD_PY = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        time.sleep(4)

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
                for r in requests]
"""


def _answering_servers(http_url: str, grpc_url: str, tries: int = 24) -> set[str]:
    """The ids of the servers that answer ``tries`` new connections on each port (the kernel
    spreads new connections over a shared port's listeners by their addresses)."""
    import tritonclient.grpc as grpcclient

    names = set()
    for _ in range(tries):
        with urllib.request.urlopen(f"http://{http_url}/v2", timeout=10) as r:  # a connection each
            names.add(json.loads(r.read())["name"])
        # a channel of its own subchannels: a connection each, not one grpcio shares between channels
        with grpcclient.InferenceServerClient(grpc_url, channel_args=[("grpc.use_local_subchannel_pool", 1)]) as c:
            names.add(c.get_server_metadata().name)
    return names


def test_a_server_on_shared_ports_takes_connections_once_its_models_loaded(server_factory, tmp_path):
    """--reuse-http-port and --reuse-grpc-port, as for a rolling restart: the second server listens
    on the shared ports only once its initial loads are over (Triton starts its endpoints then),
    so while it loads every connection still meets the first, which serves them; then both
    serve, and once the first stops, the second serves them all."""
    first_repo = tmp_path / "first"
    first_repo.mkdir()
    shutil.copytree(ROOT / "model_repository" / "add_sub", first_repo / "add_sub")
    second_repo = tmp_path / "second"
    shutil.copytree(first_repo, second_repo)
    (second_repo / "slow" / "1").mkdir(parents=True)
    (second_repo / "slow" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\ninput [{ name: "X" data_type: TYPE_FP32 dims: [1] }]\n'
        'output [{ name: "Y" data_type: TYPE_FP32 dims: [1] }]\n')
    (second_repo / "slow" / "1" / "model.py").write_text(SLOW_TO_LOAD_PY)
    shared = ["--reuse-http-port=true", "--reuse-grpc-port=true"]
    first = server_factory.start([first_repo], shared)
    second = server_factory.create([second_repo], shared, http_port=first.port)
    second.grpc_port = first.grpc_port
    second.start()
    second.wait_until(lambda: "loading 'slow'" in second.log(), "loading")
    assert "server is ready" not in second.log()
    assert _answering_servers(first.url, first.grpc_url) == {first.id}, second.log_tail()
    assert "server is ready" not in second.log(), "the model loaded before the check was over"
    assert "takes connections on the shared port once its initial loads are over" in second.log()
    second.wait_until(lambda: "serving gRPC on" in second.log() and "serving HTTP on" in second.log(), "serving")
    assert _answering_servers(first.url, first.grpc_url) == {first.id, second.id}
    first.stop()
    assert _answering_servers(first.url, first.grpc_url, tries=8) == {second.id}
    assert second.client().is_model_ready("slow")


def test_a_load_model_typo_is_logged_with_the_names_it_is_closest_to(server_factory, tmp_path):
    """The log names where the model was looked for and the folders a typo is closest to; the
    refusal itself keeps Triton's words (tests/test_grpc.py)."""
    repo = tmp_path / "repo"
    shutil.copytree(ROOT / "model_repository" / "add_sub", repo / "add_sub")
    s = server_factory.create([repo], ["--model-control-mode=explicit", "--load-model=add_sbu"]).start()
    assert s.wait_exit(60) != 0
    assert (f"failed to load 'add_sbu', failed to poll from model repository: no model folder 'add_sbu' in {repo}; "
            f"did you mean 'add_sub'?") in s.log(), s.log_tail()
    assert "the start failed: a model did not load and --exit-on-error is on (its error is above); shutting down" \
        in s.log()


def test_a_load_model_no_repository_holds_stops_the_start_as_triton_does(server_factory, tmp_path):
    """--load-model with a name no repository holds: a model that did not load, so the default
    --exit-on-error stops the start (it served nothing and said ready); with --exit-on-error=false
    the server serves the rest. --model-load-thread-count 0 is taken, as Triton takes it."""
    repo = _empty_repo(tmp_path)
    s = server_factory.create([repo], ["--model-control-mode=explicit", "--load-model=nonexist",
                                       "--model-load-thread-count", "0"]).start()
    assert s.wait_exit(60) != 0
    assert "failed to load 'nonexist', failed to poll from model repository" in s.log()
    assert "failed to load all models; exiting" in s.log()
    kept = server_factory.start([repo], ["--model-control-mode=explicit", "--load-model=nonexist",
                                         "--exit-on-error=false"])
    assert kept.client().is_server_live()


def test_a_wildcard_load_model_beside_another_loads_nothing_as_triton_does(server_factory):
    """``--load-model=*`` must be the only start-up model: Triton's words; with the default
    --exit-on-error the start stops, with --exit-on-error=false nothing is loaded."""
    flags = ["--model-control-mode=explicit", "--load-model=*", "--load-model=add_sub"]
    s = server_factory.create([ROOT / "model_repository"], flags).start()
    assert s.wait_exit(60) != 0
    assert "Wildcard model name '*' must be the ONLY startup model if specified at all." in s.log()
    kept = server_factory.start([ROOT / "model_repository"], [*flags, "--exit-on-error=false"])
    assert kept.client().is_server_live()
    assert [e for e in kept.client().get_model_repository_index() if e.get("state")] == []


def test_a_model_in_two_repositories_does_not_load_as_in_triton(server_factory, tmp_path):
    """Which folder is meant cannot be told: Triton refuses the name ("model appears in two or
    more repositories"), where the first folder found used to be served in silence."""
    first, second = tmp_path / "a", tmp_path / "b"
    shutil.copytree(ROOT / "model_repository" / "add_sub", first / "add_sub")
    shutil.copytree(ROOT / "model_repository" / "add_sub", second / "add_sub")
    shutil.copytree(ROOT / "model_repository" / "running_sum", second / "running_sum")
    s = server_factory.start([first, second], ["--exit-on-error=false", "--strict-readiness=false"])
    index = {e["name"]: e for e in s.client().get_model_repository_index()}
    assert index["add_sub"] == {"name": "add_sub", "state": "UNAVAILABLE",  # Triton's index entry, no version
                                "reason": "model appears in two or more repositories"}
    assert index["running_sum"]["state"] == "READY"
    stopped = server_factory.create([first, second]).start()
    assert stopped.wait_exit(60) != 0  # --exit-on-error, as Triton's start fails
