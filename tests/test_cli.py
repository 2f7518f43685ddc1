"""The command line: --help, one-line errors with exit code 2, process titles, --http-workers."""
from __future__ import annotations

import gc
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import PRODUCT_MODELS, PYTHON, ROOT, cmdline, descendants, free_port, raw_request, shm_entries
from shmserve.server.cli import NO_EFFECT_SECTION

FLAGS = [
    "--model-repository", "--model-store", "--http-port", "--http-address", "--http-workers",
    "--http-idle-timeout-secs", "--http-header-timeout-secs", "--http-body-timeout-secs", "--http-max-header-bytes",
    "--http-max-connections",
    "--http-max-input-size", "--metrics-port", "--allow-metrics", "--model-control-mode", "--load-model",
    "--strict-model-config", "--strict-readiness", "--exit-on-error", "--exit-timeout-secs", "--log-verbose",
    "--id", "--allow-remote-shm", "--allow-model-file-uploads", "--worker-arena-mb", "--frontend-arena-mb", "--log-info", "--log-warning",
    "--log-error", "--log-format", "--log-file", "--http-restricted-api", "--metrics-config",
    "--metrics-interval-ms", "--allow-cpu-metrics", "--allow-gpu-metrics", "--poll-us",
    "--repository-poll-secs", "--disable-auto-complete-config", "--metrics-address", "--allow-http",
    "--model-load-thread-count", "--backend-config", "--allow-grpc", "--grpc-port", "--grpc-address",
    "--grpc-use-ssl", "--grpc-use-ssl-mutual", "--grpc-server-cert", "--grpc-server-key", "--grpc-root-cert",
    "--grpc-infer-response-compression-level", "--grpc-keepalive-time", "--grpc-keepalive-timeout",
    "--grpc-keepalive-permit-without-calls", "--grpc-http2-max-pings-without-data",
    "--grpc-http2-min-recv-ping-interval-without-data", "--grpc-http2-max-ping-strikes", "--grpc-max-connection-age",
    "--grpc-max-connection-age-grace", "--grpc-restricted-protocol", "--grpc-header-forward-pattern",
    "--http-header-forward-pattern",
    "--grpc-infer-allocation-pool-size", "--grpc-max-response-pool-size", "--grpc-infer-thread-count",
]
SHMSERVE = Path(PYTHON).parent / "shmserve"


def run_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "shmserve", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("entry", ["python -m shmserve", "shmserve"])
def test_help_mentions_every_flag(entry):
    cmd = [PYTHON, "-m", "shmserve", "--help"] if entry == "python -m shmserve" else [str(SHMSERVE), "--help"]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    for flag in FLAGS:
        assert flag in r.stdout, f"--help does not mention {flag}"
    assert r.stderr == ""


def test_help_lists_each_flag_in_its_section():
    """--help in docs/flags.md's sections, the tritonserver flags that do nothing here last and
    apart, so that a reader finds what acts among what is only accepted."""
    r = subprocess.run([PYTHON, "-m", "shmserve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    sections: dict[str, list[str]] = {}
    current = ""
    for line in r.stdout.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            current = line[:-1]
            sections[current] = []
        elif line.startswith("  --"):
            sections.setdefault(current, []).append(line.split()[0].rstrip(","))
    titles = list(sections)
    assert titles[titles.index("options"):] == ["options", "models and repositories", "HTTP", "gRPC", "metrics",
                                               "logging", "tracing", "response cache",
                                               "shared memory and local clients", NO_EFFECT_SECTION], titles
    assert sections["options"] == ["--version"]
    assert {"--model-repository", "--load-model", "--rate-limit-resource"} <= set(sections["models and repositories"])
    assert {"--http-port", "--http-max-inflight", "--reuse-http-port"} <= set(sections["HTTP"])
    assert {"--grpc-port", "--allow-grpc"} <= set(sections["gRPC"]) and "--http-thread-count" not in sections["HTTP"]
    assert {"--http-thread-count", "--backend-directory", "--allow-sagemaker"} <= set(sections[NO_EFFECT_SECTION])


def test_a_repository_named_twice_is_one():
    """A path and its alias (or a prefix of the flag, --model-repo) name one repository: its models
    are not said to be in two."""
    from shmserve.server.cli import parse_args

    args = parse_args(["--model-repository", str(ROOT / "model_repository"),
                       "--model-repo=" + str(ROOT / "model_repository") + "/"])
    assert args.model_repository == [str(ROOT / "model_repository")]


def test_version_needs_no_repository():
    from shmserve.server import __version__

    r = run_cli("--version")
    assert (r.returncode, r.stdout, r.stderr) == (0, f"shmserve {__version__}\n", "")


def _assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, f"expected a one-line error, got:\n{r.stderr}"
    assert lines[0].startswith("shmserve: error:"), lines[0]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert r.stdout == ""


def test_unknown_flag(tmp_path):
    _assert_one_line_error(run_cli("--model-repository", str(tmp_path), "--no-such-flag"), "--no-such-flag")


def test_missing_repository(tmp_path):
    missing = tmp_path / "does-not-exist"
    _assert_one_line_error(run_cli("--model-repository", str(missing)), str(missing))


def test_repository_is_a_file(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("not a directory")
    _assert_one_line_error(run_cli("--model-repository", str(f)), str(f))


def test_repository_flag_required():
    _assert_one_line_error(run_cli(), "--model-repository")


@pytest.mark.parametrize("args,needle", [
    (["--http-port", "eighty"], "--http-port"),
    (["--http-port", "70000"], "--http-port"),
    (["--http-workers", "0"], "--http-workers"),
    (["--exit-on-error", "maybe"], "maybe"),
    (["--model-control-mode", "sometimes"], "sometimes"),
    (["--id", "bad/id"], "bad/id"),
    (["--load-model", "add_sub"], "--model-control-mode"),
    (["--poll-us", "-1"], "--poll-us"),
    (["--poll-us", "soon"], "--poll-us"),
    (["--repository-poll-secs", "-1"], "--repository-poll-secs"),
    (["--repository-poll-secs", "often"], "--repository-poll-secs"),
    (["--grpc-infer-response-compression-level", "max"], "must be none, low, medium or high, got 'max'"),
    (["--grpc-keepalive-time", "0"], "--grpc-keepalive-time must lie in [1, 2147483647], got 0"),
    (["--grpc-http2-max-ping-strikes", "-1"], "--grpc-http2-max-ping-strikes must lie in [0, 2147483647]"),
    (["--grpc-keepalive-timeout", "soon"], "--grpc-keepalive-timeout"),
    (["--grpc-restricted-protocol", "bogus:k=v"], "unknown restricted protocol 'bogus'"),
    (["--grpc-restricted-protocol", "inference"],
     "--grpc-restricted-protocol option format is '<config name>:<setting>=<value>'. Got inference"),
    (["--grpc-restricted-protocol", "health:a=1", "--grpc-restricted-protocol", "health:b=2"],
     "restricted protocol 'health' can not be specified in multiple config groups"),
    (["--grpc-use-ssl"], "--grpc-use-ssl needs --grpc-server-cert, --grpc-server-key"),
    (["--grpc-use-ssl-mutual", "--grpc-server-cert", "c", "--grpc-server-key", "k"],
     "--grpc-use-ssl-mutual needs --grpc-server-cert, --grpc-server-key, --grpc-root-cert"),
    (["--grpc-use-ssl", "--grpc-server-cert", "/no/such.crt", "--grpc-server-key", "/no/such.key"],
     "cannot read --grpc-server-cert '/no/such.crt'"),
    (["--grpc-use-ssl", "--grpc-server-cert", "/dev/null", "--grpc-server-key", "/dev/null"],
     "--grpc-server-cert '/dev/null' holds no PEM data"),
    (["--grpc-port", "70000"], "--grpc-port"),
    (["--grpc-max-input-size", "0"], "--grpc-max-input-size must lie in [1, 2147483647], got 0"),
    (["--grpc-receive-memory-mb", "0"], "--grpc-receive-memory-mb must lie in [1, 1073741824], got 0"),
    (["--grpc-receive-timeout-secs", "0"], "--grpc-receive-timeout-secs must lie in (0, 86400], got 0"),
    (["--model-load-thread-count", "-1"], "--model-load-thread-count must be 0 or more"),
    (["--backend-config", "python"], "--backend-config option format is '<backend name>,<setting>=<value>'. Got python"),
    (["--http-header-timeout-secs", "0"], "--http-header-timeout-secs must lie in (0, 86400]"),
    (["--http-send-timeout-secs", "0"], "--http-send-timeout-secs must lie in (0, 86400]"),
    (["--http-idle-timeout-secs", "-1"], "--http-idle-timeout-secs must lie in [0, 86400] (0: never)"),
    (["--http-max-header-bytes", "10"], "--http-max-header-bytes must be at least 1024"),
    (["--http-max-connections", "-1"], "--http-max-connections must be 0 (derived) or more"),
], ids=["port-text", "port-range", "workers-0", "bool", "choice", "id", "load-model-without-explicit", "poll-us-range",
        "poll-us-text", "repository-poll-secs-range", "repository-poll-secs-text", "compression-level",
        "keepalive-time-0", "ping-strikes-negative", "keepalive-timeout-text", "restricted-protocol-unknown",
        "restricted-protocol-form", "restricted-protocol-twice", "ssl-without-files", "ssl-mutual-without-root",
        "ssl-missing-file", "ssl-not-pem", "grpc-port-range", "grpc-max-input-size-0", "grpc-receive-memory-0",
        "grpc-receive-timeout-0", "load-thread-count-negative",
        "backend-config-no-setting", "http-header-timeout-0", "http-send-timeout-0",
        "http-idle-timeout-negative", "http-max-header-bytes-small",
        "http-max-connections-negative"])
def test_bad_flag_values(tmp_path, args, needle):
    _assert_one_line_error(run_cli("--model-repository", str(tmp_path), *args), needle)


def test_busy_port_is_a_one_line_error(server, tmp_path):
    busy_id = f"{server.id}busy"
    r = run_cli("--model-repository", str(tmp_path), "--http-address", "127.0.0.1", "--http-port",
                str(server.port), "--metrics-port", str(free_port()), "--id", busy_id)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("shmserve: error:") and str(server.port) in lines[0], lines
    assert shm_entries(busy_id) == []
    assert server.client().is_server_ready()


def test_busy_grpc_port_is_a_one_line_error(server, tmp_path):
    busy_id = f"{server.id}busyg"
    r = run_cli("--model-repository", str(tmp_path), "--http-address", "127.0.0.1", "--http-port", str(free_port()),
                "--grpc-address", "127.0.0.1", "--grpc-port", str(server.grpc_port),
                "--metrics-port", str(free_port()), "--id", busy_id)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("shmserve: error: cannot bind gRPC") and str(server.grpc_port) in lines[0], lines
    assert shm_entries(busy_id) == []


def test_busy_metrics_port_is_a_one_line_error(server, tmp_path):
    """As Triton, which does not start without its metrics service: serving on would leave the
    port's scrapes to whatever holds it, another server's figures."""
    busy_id = f"{server.id}busym"
    r = run_cli("--model-repository", str(tmp_path), "--http-address", "127.0.0.1", "--http-port", str(free_port()),
                "--grpc-port", str(free_port()), "--metrics-address", "127.0.0.1",
                "--metrics-port", str(server.metrics_port), "--id", busy_id)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"shmserve: error: cannot bind metrics to 127.0.0.1:{server.metrics_port}: "
                               f"Address already in use"), lines
    assert shm_entries(busy_id) == []
    assert server.client().is_server_ready()


# -- process titles --------------------------------------------------------------------------------


def test_process_titles(server):
    import re

    titles = sorted(cmdline(pid) for pid in descendants(server.pid))
    workers = [t for t in titles if t.startswith("shmserve worker ")]
    pattern = re.compile(rf"^shmserve worker (\S+) v(\d+) #(\d+) cpu \(server {server.id}\)$")
    assert all(pattern.match(t) for t in workers), workers
    served = {pattern.match(t).group(1) for t in workers}
    on_disk = {p.name for repo in server.repos for p in Path(repo).iterdir() if (p / "config.pbtxt").exists()
               and 'platform: "ensemble"' not in (p / "config.pbtxt").read_text()}  # ensembles have no workers
    assert served == on_disk, (served, on_disk)
    # Instances are numbered per model: the two-instance model shows #0 and #1.
    assert {f"shmserve worker sleeper v1 #{i} cpu (server {server.id})" for i in (0, 1)} <= set(workers)
    assert f"shmserve broker {server.id}" in titles
    assert f"shmserve frontend {server.id} #0" in titles
    assert f"shmserve grpc {server.id}" in titles
    assert cmdline(server.pid) == f"shmserve launcher {server.id}"


# -- several frontends ---------------------------------------------------------------------------------


def test_two_http_workers_serve_requests(server_factory):
    s = server_factory.start([PRODUCT_MODELS], ["--http-workers", "2"])
    titles = {cmdline(pid) for pid in descendants(s.pid)}
    assert {f"shmserve frontend {s.id} #0", f"shmserve frontend {s.id} #1"} <= titles, titles
    a = np.arange(16, dtype=np.int32)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            for i in range(10):
                c = httpclient.InferenceServerClient(s.url)  # a fresh connection each time
                i0 = httpclient.InferInput("INPUT0", [16], "INT32")
                i0.set_data_from_numpy(a * k)
                i1 = httpclient.InferInput("INPUT1", [16], "INT32")
                i1.set_data_from_numpy(a + i)
                r = c.infer("add_sub", [i0, i1])
                np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), a * k + a + i)
                np.testing.assert_array_equal(r.as_numpy("OUTPUT1"), a * k - a - i)
                c.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
        finally:
            # A tritonclient client closes again when it is collected, on the gevent hub of the
            # collecting thread: collect this thread's clients here, not in the main thread
            # (there it warned "'_Threadlocal' object has no attribute 'loop'", once in CI).
            c = None
            gc.collect()

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    for _ in range(10):
        assert raw_request(s.port, "GET", "/v2/health/ready").status == 200
