"""The container image (Dockerfile), built and run with podman on this machine.

No container registry is reachable here, so the base image is made locally: a minimal Debian
(debootstrap, from the mirror apt uses) imported under a local name and passed as the Dockerfile's
BASE. The image's install step reaches PyPI through the host's network; where this machine keeps
torch's CPU wheel (PIP_FIND_LINKS, /opt/wheels) the build mounts it, and it mounts the host's CA
bundle for pip. The base image is kept between runs (named by what it holds), and podman's layer
cache makes a second build of unchanged sources quick.

Podman runs as root with runc and cgroupfs and a containers.conf without default ulimits, the
setup these machines support; `make test` installs podman and debootstrap when they are missing.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from conftest import PRODUCT_MODELS, ROOT, TEST_MODELS, free_ports
from gates import Gate
import tmpfs

from shmserve.server.cli import parse_args
from shmserve.server.shm_needs import startup_bytes
from shmserve.shm import space

PODMAN = ["podman", "--runtime", "runc", "--cgroup-manager", "cgroupfs"]
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "tini")
BASE_IMAGE = f"localhost/shmserve-base:{SUITE}-" + hashlib.sha256(",".join(BASE_PACKAGES).encode()).hexdigest()[:8]
IMAGE = "localhost/shmserve:test"
CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
TORCH_WHEEL = "torch-2.13.0+cpu-*.whl"
READY_S = 180.0

pytestmark = pytest.mark.timeout(1500)


def run(cmd: list[str], env: dict, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, **kw)


def debian_mirror() -> str:
    """The Debian mirror apt uses on this machine (deb822 or one-line sources)."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in path.read_text().split("\n\n"):
            if re.search(rf"^Suites:.*\b{SUITE}\b", stanza, re.M) and "debian-security" not in stanza:
                found = re.search(r"^URIs:\s*(\S+)", stanza, re.M)
                if found:
                    return found.group(1)
    listing = Path("/etc/apt/sources.list")
    if listing.exists():
        found = re.search(rf"^deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+{SUITE}\s", listing.read_text(), re.M)
        if found:
            return found.group(1)
    return "http://deb.debian.org/debian"


@pytest.fixture(scope="module")
def podman_env(tmp_path_factory) -> dict:
    missing = [tool for tool in ("podman", "debootstrap") if shutil.which(tool) is None]
    assert not missing, f"{' and '.join(missing)} not installed: `make test` installs them with apt-get (as root)"
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


@pytest.fixture(scope="module")
def base_image(podman_env, tmp_path_factory) -> str:
    """A minimal Debian with python3, its venv module and tini, made once per machine."""
    if run(PODMAN + ["image", "exists", BASE_IMAGE], podman_env).returncode == 0:
        return BASE_IMAGE
    root = tmp_path_factory.mktemp("debootstrap") / "root"
    try:
        done = run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(root),
                    debian_mirror()], podman_env, timeout=900)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        tar = subprocess.Popen(["tar", "-C", str(root), "--exclude=./var/cache/apt/archives/*.deb",
                                "--exclude=./var/lib/apt/lists/*", "-c", "."], stdout=subprocess.PIPE)
        done = run(PODMAN + ["import", "-", BASE_IMAGE], podman_env, timeout=300, stdin=tar.stdout)
        tar.wait()
        assert done.returncode == 0 and tar.returncode == 0, done.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return BASE_IMAGE


def torch_wheels() -> str | None:
    """The folder that holds torch's CPU wheel on this machine, if any."""
    for folder in (os.environ.get("PIP_FIND_LINKS", ""), "/opt/wheels"):
        if folder and list(Path(folder).glob(TORCH_WHEEL)):
            return folder
    return None


@pytest.fixture(scope="module")
def image(podman_env, base_image, tmp_path_factory) -> str:
    old = run(PODMAN + ["image", "inspect", "--format", "{{.Id}}", IMAGE], podman_env).stdout.strip()
    cmd = PODMAN + ["build", "--format", "docker", "--network", "host", "--build-arg", f"BASE={base_image}",
                    "--volume", f"{CA_BUNDLE}:/run/host-ca.crt:ro", "--build-arg", "CA_BUNDLE=/run/host-ca.crt",
                    "-t", IMAGE]
    wheels = torch_wheels()
    if wheels:  # torch's CPU build from this disk; everything else from PyPI
        cmd += ["--volume", f"{wheels}:/run/wheels:ro", "--build-arg", "WHEELS=/run/wheels",
                "--build-arg", "TORCH_INDEX_URL=https://pypi.org/simple"]
    log = tmp_path_factory.mktemp("build") / "build.log"
    with open(log, "w") as out:
        done = subprocess.run(cmd + [str(ROOT)], env=podman_env, stdout=out, stderr=subprocess.STDOUT, timeout=1200)
    assert done.returncode == 0, log.read_text()[-5000:]
    new = run(PODMAN + ["image", "inspect", "--format", "{{.Id}}", IMAGE], podman_env).stdout.strip()
    if old and old != new:  # the previous build's image, now untagged: its own layers go
        run(PODMAN + ["rmi", old], podman_env)
    return IMAGE


@pytest.fixture
def shm_dir(tmp_path) -> Path:
    """A tmpfs mounted as the container's /dev/shm, so the test sees what the server leaves there:
    room for the README's repository and the test's model, 581 MiB + 10 x 257 MiB (docs/deploy.md)."""
    with tmpfs.mounted(tmp_path / "shm", "4g") as folder:
        yield folder


def shm_objects(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith(("shmserve.", "sem.shmserve.")))


def add_sub_inputs(module) -> list:
    inputs = [module.InferInput("INPUT0", [16], "INT32"), module.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(np.arange(16, dtype=np.int32))
    return inputs


def logs(name: str, env: dict) -> str:
    done = run(PODMAN + ["logs", name], env)
    return done.stdout + done.stderr


def test_the_image_serves_http_and_grpc_and_drains_on_sigterm(image, podman_env, shm_dir, tmp_path):
    gate = Gate(tmp_path / "gate")
    gate.folder.chmod(0o777)  # the server runs as uid 1000
    http, grpc, metrics = free_ports(3)
    name = f"shmserve-test-{os.getpid()}"
    # --read-only, as the Deployment's readOnlyRootFilesystem (podman puts a tmpfs on /tmp as its emptyDir).
    started = run(PODMAN + ["run", "-d", "--name", name, "--network", "host", "--read-only",
                            "-v", f"{shm_dir}:/dev/shm", "-v", f"{gate.folder}:/gate",
                            "-v", f"{PRODUCT_MODELS}:/models:ro", "-v", f"{TEST_MODELS / 'sleeper'}:/extra/sleeper:ro",
                            "-e", f"SHMSERVE_HEALTH_URL=http://127.0.0.1:{http}/v2/health/ready", image,
                            "--model-repository=/models", "--model-repository=/extra", f"--http-port={http}",
                            f"--grpc-port={grpc}", f"--metrics-port={metrics}", "--exit-timeout-secs=20"],
                  podman_env)
    assert started.returncode == 0, started.stderr
    try:
        with httpclient.InferenceServerClient(f"127.0.0.1:{http}") as client:
            deadline = time.monotonic() + READY_S
            while not _ready(client):
                state = run(PODMAN + ["inspect", "--format", "{{.State.Status}}", name], podman_env).stdout.strip()
                assert state == "running" and time.monotonic() < deadline, f"{state}: {logs(name, podman_env)}"
                time.sleep(0.2)
            health = run(PODMAN + ["healthcheck", "run", name], podman_env)
            assert health.returncode == 0, health.stdout + health.stderr
            assert run(PODMAN + ["exec", name, "id", "-u"], podman_env).stdout.strip() == "1000"
            assert run(PODMAN + ["exec", name, "cat", "/proc/1/comm"], podman_env).stdout.strip() == "tini"
            # The truncation guard was built (with a compiler the build removed again).
            guard = run(PODMAN + ["exec", name, "python3", "-c", "from shmserve.shm import truncation_guard as t; "
                                  "import shutil; print(t.available(), shutil.which('cc'))"], podman_env)
            assert guard.stdout.strip() == "True None", guard

            out = client.infer("add_sub", add_sub_inputs(httpclient))
            np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), 2 * np.arange(16, dtype=np.int32))
            with grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}") as g:
                out = g.infer("add_sub", add_sub_inputs(grpcclient))
                np.testing.assert_array_equal(out.as_numpy("OUTPUT1"), np.zeros(16, np.int32))
            # The README's repository: its PyTorch and ONNX Runtime models give the same answer.
            pixels = httpclient.InferInput("INPUT__0", [1, 1, 8, 8], "FP32")
            pixels.set_data_from_numpy(np.random.default_rng(0).random((1, 1, 8, 8), dtype=np.float32) * 16)
            torch_out, onnx_out = (client.infer(m, [pixels]).as_numpy("OUTPUT__0") for m in ("digits", "digits_onnx"))
            np.testing.assert_allclose(torch_out, onnx_out, rtol=1e-4, atol=1e-4)
            assert shm_objects(shm_dir), "the server's segments should lie in the mounted /dev/shm"

            # SIGTERM while a request runs: it must finish before the server goes.
            answer: dict = {}
            request = threading.Thread(target=lambda: answer.update(result=_sleeper(http, "/gate")))
            request.start()
            gate.wait_started()
            stop = threading.Thread(target=lambda: answer.update(
                stop=run(PODMAN + ["stop", "-t", "60", name], podman_env, timeout=90)))
            stop.start()
            deadline = time.monotonic() + 30
            while "SIGTERM received: draining" not in logs(name, podman_env):
                assert time.monotonic() < deadline, logs(name, podman_env)
                time.sleep(0.1)
            gate.open()
            request.join(60)
            stop.join(90)
        assert answer["result"].as_numpy("INSTANCE")[0].decode().startswith("sleeper_")
        assert answer["stop"].returncode == 0, answer["stop"].stderr
        code = run(PODMAN + ["inspect", "--format", "{{.State.ExitCode}}", name], podman_env).stdout.strip()
        text = logs(name, podman_env)
        assert code == "0", text
        assert "stopped; its shared-memory objects are removed" in text and "Traceback" not in text, text
        assert shm_objects(shm_dir) == []
    finally:
        run(PODMAN + ["rm", "-f", "-t", "0", name], podman_env)
    assert run(PODMAN + ["container", "exists", name], podman_env).returncode == 1


def _sleeper(http_port: int, gate: str) -> httpclient.InferResult:
    """One sleeper request held at ``gate``, on a client of its own (tritonclient's HTTP client
    stays on the thread that made it)."""
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.ones(1, np.float32))
    with httpclient.InferenceServerClient(f"127.0.0.1:{http_port}", network_timeout=120) as client:
        return client.infer("sleeper", [x], parameters={"gate": gate})


def _ready(client: httpclient.InferenceServerClient) -> bool:
    try:
        return client.is_server_ready()
    except Exception:  # noqa: BLE001 - not listening yet
        return False


def test_the_image_refuses_a_small_dev_shm_in_one_line(image, podman_env):
    http, grpc, metrics = free_ports(3)
    flags = ["--model-repository=/models", f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
    done = run(PODMAN + ["run", "--rm", "--network", "host", "--no-healthcheck", "--shm-size", "8m", image, *flags],
               podman_env)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 1, lines
    need = startup_bytes(parse_args([f"--model-repository={ROOT}", *flags[1:]]))
    assert lines[0].startswith("shmserve: error: shmserve at start"), lines[0]
    assert f"needs {space.mib(need)} of shared memory" in lines[0] and "/dev/shm has 8 MiB left" in lines[0]
    assert "--shm-size" in lines[0] and "emptyDir" in lines[0]
