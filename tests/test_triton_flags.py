"""``tritonserver`` flags a Triton command line brings: each one starts the server and either
works or is named in the log at start (server/triton_flags.py)."""
from __future__ import annotations

import textwrap
import urllib.error
import urllib.request
from pathlib import Path

from conftest import wait_until

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
        "--backend-config", "pytorch,no-such-setting=1",
        "--grpc-use-ssl=false", "--grpc-infer-allocation-pool-size", "8", "--grpc-max-response-pool-size", "4",
        "--grpc-header-forward-pattern", "x-.*", "--grpc-infer-thread-count", "4"])
    log = s.log()
    for line in [
        "--backend-config python,shm-default-byte-size=1048576 is not supported and has no effect",
        "--backend-config default-max-batch-size=8 is not supported and has no effect",
        "--backend-config pytorch,no-such-setting=1 is not supported and has no effect",
        "--grpc-infer-allocation-pool-size 8 has no effect: grpcio allocates each call's state itself",
        "--grpc-max-response-pool-size 4 has no effect: each response is sent as soon as it is built",
        "--grpc-header-forward-pattern x-.* has no effect: gRPC metadata is not forwarded as request parameters",
        "--grpc-infer-thread-count 4 has no effect: one gRPC process serves every call on one asyncio loop",
        "--model-load-thread-count 4: every model instance loads in a process of its own",
    ]:
        assert line in log, line
    assert "--grpc-use-ssl" not in log  # a flag that works is not named
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
