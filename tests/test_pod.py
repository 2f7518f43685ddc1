"""The local client from another container of the pod (deploy/kubernetes/pod-local-client/), with
podman: a server container (uid 1000, the image's) and an application container (uid 2000) that
share only a tmpfs as /dev/shm (the pod's `emptyDir: {medium: Memory}`: mode 0777, no sticky bit),
each in its own PID namespace. The server names the application's user with
--local-client-users; the application's objects name the server's user (shm/access.py) and no
one else. The client is killed mid-request; the server reclaims what it held and serves on. A
process of a third uid is refused, and cannot open the application's objects.

The image is the one tests/test_container.py builds (built here if it is missing); the package's
sources of this checkout are mounted over the installed ones, so that what runs is this code
even when the shared image tag was built from another checkout. PID namespaces alone, without
podman: tests/test_pid_namespaces.py.
"""
from __future__ import annotations

import os
import select
import subprocess
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import PRODUCT_MODELS, ROOT, SHM_MODELS, free_ports
from shmserve.shm.access import readers_of
from gates import Gate
import tmpfs
from test_container import IMAGE, PODMAN, READY_S, _ready, base_image, image, logs, podman_env, run  # noqa: F401

pytestmark = pytest.mark.timeout(900)

SOURCES = ("shm", "server", "workers")  # the package's folders (pyproject's package-dir)

# The application container's program: pid and PID namespace, two requests (one from a region of
# its own), then one held in slow_reader at the gate; it then waits to be killed.
APP = r"""
import os, sys
import numpy as np
from shmserve import Client
c = Client()
a = np.arange(16, dtype=np.int32)
assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
region = c.create_region("app_inputs", 4096)
x = region.array(np.int32, (16,))
x[:] = 5
assert c.infer("add_sub", {"INPUT0": x, "INPUT1": a})["OUTPUT0"].tolist() == (5 + a).tolist()
held = c.infer_async("slow_reader", {"X": x[:8]}, parameters={"sleep_s": 0, "gate": "/gate"})
print(os.getpid(), os.stat("/proc/self/ns/pid").st_ino, region.key, c._conn.name, flush=True)
sys.stdin.read()
"""

SERVER_UID, APP_UID, THIRD_UID = 1000, 2000, 3000

OTHER_USER = r"""
from shmserve import Client, ServerUnavailable
try:
    Client()
    print("connected")
except ServerUnavailable as e:
    print(e)
"""

# Another user's process opening the application's segment (argv[1]).
OPEN_SEGMENT = r"""
import sys, posix_ipc
try:
    posix_ipc.SharedMemory(sys.argv[1])
    print("opened")
except posix_ipc.PermissionsError as e:
    print("refused", e)
"""


@pytest.fixture(scope="module")
def pod_image(request, podman_env) -> str:
    """test_container's image: the one already built, else built now."""
    if run(PODMAN + ["image", "exists", IMAGE], podman_env).returncode == 0:
        return IMAGE
    return request.getfixturevalue("image")


def source_mounts(image_name: str, env: dict) -> list[str]:
    """-v options that put this checkout's package folders over the image's installed ones."""
    done = run(PODMAN + ["run", "--rm", "--network", "none", "--no-healthcheck", "--entrypoint", "python3", image_name,
                         "-c", "import os, shmserve; print(os.path.dirname(shmserve.__file__))"], env)
    assert done.returncode == 0, done.stderr
    site = done.stdout.strip()
    folders = [opt for folder in SOURCES for opt in ("-v", f"{ROOT / folder}:{site}/{folder}:ro")]
    # and the modules of the package's own folder (shmserve/: signature.py, batching.py ...)
    return folders + [opt for module in sorted((ROOT / "shmserve").glob("*.py"))
                      for opt in ("-v", f"{module}:{site}/{module.name}:ro")]


def namespace_of(container: str, env: dict) -> str:
    done = run(PODMAN + ["exec", container, "stat", "-L", "-c", "%i", "/proc/1/ns/pid"], env)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_an_application_container_uses_the_local_client_and_is_killed_mid_request(pod_image, podman_env, tmp_path):
    gate = Gate(tmp_path / "gate")
    gate.folder.chmod(0o777)  # the containers run as uids 1000 and 2000
    http, grpc, metrics = free_ports(3)
    server, app = f"shmserve-pod-{os.getpid()}", f"shmserve-app-{os.getpid()}"
    mounts = source_mounts(pod_image, podman_env)
    with tmpfs.mounted(tmp_path / "shm", "4g", mode="0777") as shm_dir:
        started = run(PODMAN + ["run", "-d", "--name", server, "--network", "host", "--read-only",
                                "-v", f"{shm_dir}:/dev/shm", "-v", f"{gate.folder}:/gate", *mounts,
                                "-v", f"{PRODUCT_MODELS / 'add_sub'}:/models/add_sub:ro",
                                "-v", f"{SHM_MODELS / 'slow_reader'}:/models/slow_reader:ro",
                                "-e", f"SHMSERVE_HEALTH_URL=http://127.0.0.1:{http}/v2/health/ready", pod_image,
                                "--model-repository=/models", f"--http-port={http}", f"--grpc-port={grpc}",
                                f"--metrics-port={metrics}", f"--local-client-users={APP_UID}"], podman_env)
        assert started.returncode == 0, started.stderr
        client = None
        try:
            with httpclient.InferenceServerClient(f"127.0.0.1:{http}") as http_client:
                deadline = time.monotonic() + READY_S
                while not _ready(http_client):
                    assert time.monotonic() < deadline, logs(server, podman_env)
                    time.sleep(0.2)
                # The application container: no network, its own PID namespace, /dev/shm shared.
                client = subprocess.Popen(PODMAN + ["run", "-i", "--name", app, "--user", f"{APP_UID}:{APP_UID}",
                                                    "--network", "none", "--read-only",
                                                    "--no-healthcheck", "-v", f"{shm_dir}:/dev/shm",
                                                    "-v", f"{gate.folder}:/gate", *mounts, "--entrypoint", "python3",
                                                    pod_image, "-c", APP],
                                          env=podman_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True)
                ready, _, _ = select.select([client.stdout], [], [], 120)
                said = client.stdout.readline().split() if ready else []
                assert len(said) == 4, f"the application did not start: {said} {logs(app, podman_env)}"
                pid, namespace, key, segment = int(said[0]), said[1], said[2], said[3]
                assert pid == 1 and namespace != namespace_of(server, podman_env)
                assert (shm_dir / key.lstrip("/")).exists() and (shm_dir / segment.lstrip("/")).exists()
                # The application's objects: its own, with the server's user named and no one else.
                for name in (key, segment):
                    st = os.stat(shm_dir / name.lstrip("/"))
                    assert st.st_uid == APP_UID and st.st_mode & 0o007 == 0, (name, st)
                    assert readers_of(str(shm_dir / name.lstrip("/"))) == (SERVER_UID,), name
                third = run(PODMAN + ["exec", "--user", f"{THIRD_UID}:{THIRD_UID}", server, "python3", "-c",
                                      OPEN_SEGMENT, segment], podman_env)
                assert third.stdout.startswith("refused"), third.stdout + third.stderr
                gate.wait_started(1)  # its slow_reader request is in the model now
                killed = run(PODMAN + ["kill", "-s", "KILL", app], podman_env)
                assert killed.returncode == 0, killed.stderr
                client.wait(60)
                wait_for(lambda: not (shm_dir / segment.lstrip("/")).exists(), "the killed client's segment goes")
                wait_for(lambda: not (shm_dir / key.lstrip("/")).exists(),
                         "the server unlinks the region the killed client created")
                assert not [n for n in os.listdir(shm_dir) if segment.lstrip("/") in n], os.listdir(shm_dir)
                gate.open()  # the model finishes the dead client's request; nobody reads its answer
                inputs = [httpclient.InferInput(n, [16], "INT32") for n in ("INPUT0", "INPUT1")]
                for i in inputs:
                    i.set_data_from_numpy(np.arange(16, dtype=np.int32))
                out = http_client.infer("add_sub", inputs)
                np.testing.assert_array_equal(out.as_numpy("OUTPUT0"), 2 * np.arange(16, dtype=np.int32))
                x = httpclient.InferInput("X", [4], "INT32")
                x.set_data_from_numpy(np.arange(4, dtype=np.int32))
                assert http_client.infer("slow_reader", [x], parameters={"sleep_s": 0}).as_numpy("SUM").tolist() == [6]
            # A user not named, even in the server's own container, may not attach: a clear refusal.
            other = run(PODMAN + ["exec", "--user", f"{THIRD_UID}:{THIRD_UID}", server, "python3", "-c", OTHER_USER],
                        podman_env)
            assert "runs as another user" in other.stdout and f"uid {THIRD_UID}" in other.stdout, \
                other.stdout + other.stderr
            stopped = run(PODMAN + ["stop", "-t", "60", server], podman_env, timeout=90)
            assert stopped.returncode == 0, stopped.stderr
            text = logs(server, podman_env)
            assert "died; reclaiming its channel" in text, text
            assert "exited unexpectedly" not in text and "Traceback" not in text, text
        finally:
            if client is not None and client.poll() is None:
                client.kill()
            if client is not None:
                client.communicate(timeout=30)
            run(PODMAN + ["rm", "-f", "-t", "0", app], podman_env)
            run(PODMAN + ["rm", "-f", "-t", "0", server], podman_env)
        assert not [n for n in os.listdir(shm_dir) if n.startswith(("shmserve.", "sem.shmserve.", "shmclient."))]
