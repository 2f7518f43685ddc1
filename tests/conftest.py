"""Shared fixtures: real shmserve servers on free loopback ports, each with a unique ``--id``.

Every server is started as its own process group (``start_new_session``), with stdout and stderr
captured to a log file whose tail is attached to the report of any failing test that used it. On
teardown the server is stopped with SIGTERM (SIGKILL of the whole group after a timeout) and the
fixture asserts that no /dev/shm entry of its id is left behind.
"""
from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest
import tritonclient.http as httpclient

from gates import pause
from shmserve.tools.harness import cmdline, descendants, stat_fields  # noqa: F401 - the tests import them from here

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
PRODUCT_MODELS = ROOT / "model_repository"
TEST_MODELS = TESTS / "models" / "main"
PYTHON = sys.executable
SHM_DIR = "/dev/shm"

# Generous: a server starting ten workers that import torch, or draining them, on a loaded 2-core host.
READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0

_ids = itertools.count()


def new_server_id() -> str:
    return f"t{os.getpid()}_{next(_ids)}"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: each socket stays bound until all are chosen, so the kernel cannot
    hand the same port out twice (a server's HTTP and gRPC ports once collided that way)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def shm_entries(server_id: str) -> list[str]:
    """Every /dev/shm entry (segments and semaphores) that belongs to ``server_id``."""
    stem = f"shmserve.{server_id}."
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(stem) or n.startswith("sem." + stem))


def remove_shm_entries(server_id: str) -> None:
    for name in shm_entries(server_id):
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


# -- /proc helpers ------------------------------------------------------------------------------


def _read_stat(pid: int) -> tuple[int, str, int, int] | None:
    """(ppid, state, utime, stime) of ``pid``, or None when it is gone."""
    rest = stat_fields(pid)
    if rest is None:
        return None
    return int(rest[1]), rest[0].decode(), int(rest[11]), int(rest[12])


def cpu_ticks(pids: Iterable[int]) -> dict[int, int]:
    out = {}
    for pid in pids:
        st = _read_stat(pid)
        if st is not None and st[1] != "Z":
            out[pid] = st[2] + st[3]
    return out


def pid_alive(pid: int) -> bool:
    st = _read_stat(pid)
    return st is not None and st[1] != "Z"


class CpuHogs:
    """``n`` processes that never block (on ``core`` only, if given): tasks that want a core all the
    time, as busy clients do. Each ends by itself after ``limit_s``, or once this process is gone, should a test die
    without cleaning up."""

    def __init__(self, n: int, limit_s: float = 120.0, core: int | None = None) -> None:
        pin = f"os.sched_setaffinity(0, {{{core}}})\n" if core is not None else ""
        spin = (f"import os, time\n{pin}parent, end = os.getppid(), time.time() + {limit_s}\n"
                f"print(flush=True)\nwhile time.time() < end and os.getppid() == parent: pass")
        self.procs: list[subprocess.Popen] = []
        try:
            for _ in range(n):
                self.procs.append(subprocess.Popen([PYTHON, "-c", spin], stdout=subprocess.PIPE))
            for p in self.procs:
                p.stdout.readline()  # it is about to spin
        except BaseException:
            self.__exit__()
            raise

    def __enter__(self) -> "CpuHogs":
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()
            p.stdout.close()


# -- HTTP helpers -------------------------------------------------------------------------------


class RawResponse:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self):
        return json.loads(self.body)

    def __repr__(self) -> str:
        return f"RawResponse({self.status}, {self.body[:300]!r})"


def raw_request(port: int, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None, timeout: float = 30.0) -> RawResponse:
    """One HTTP request with exactly the bytes given (for malformed bodies and header checks)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        return RawResponse(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


def read_raw_response(reader: Any) -> tuple[int, dict, bytes]:
    """One HTTP response from ``reader`` (``sock.makefile("rb")``, one per connection, so that
    pipelined answers read in one go are not lost): status, headers, body."""
    status_line = reader.readline()
    assert status_line, "connection closed before the response head"
    headers = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = reader.read(int(headers["content-length"]))
    assert len(body) == int(headers["content-length"]), "connection closed in the response body"
    return int(status_line.split()[1]), headers, body


# -- the server under test ----------------------------------------------------------------------


class Server:
    """One ``python -m shmserve`` process tree."""

    def __init__(self, repos: list[Path | str], log_dir: Path, extra_args: Iterable[str] = (),
                 server_id: str | None = None, http_port: int | None = None) -> None:
        self.repos = [str(r) for r in repos]
        self.id = server_id or new_server_id()
        if http_port is None:
            self.port, self.metrics_port, self.grpc_port = free_ports(3)
        else:
            self.port = http_port
            self.metrics_port, self.grpc_port = [p for p in free_ports(3) if p != http_port][:2]
        self.extra_args = list(extra_args)
        # One HTTP frontend, whatever the host's cores (--http-workers' default): the tests' counts
        # and per-process limits assume it. A test of the default sets this False.
        self.one_frontend = True
        self.log_path = log_dir / f"server-{self.id}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        cmd = [PYTHON, "-m", "shmserve"]
        for r in self.repos:
            cmd += ["--model-repository", r]
        cmd += ["--http-address", "127.0.0.1", "--http-port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--grpc-address", "127.0.0.1",
                "--grpc-port", str(self.grpc_port), "--id", self.id]
        if self.one_frontend:  # (a test's own --http-workers, later on the line, wins)
            cmd += ["--http-workers", "1"]
        return cmd + self.extra_args

    def start(self) -> "Server":
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=self._log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 80) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def http_status(self, path: str, timeout: float = 2.0) -> int | None:
        try:
            with urllib.request.urlopen(f"http://{self.url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (OSError, http.client.HTTPException):
            return None

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                pytest.fail(f"server {self.id} exited with code {self.proc.returncode} while waiting for "
                            f"{what}; log:\n{self.log_tail()}")
            if predicate():
                return
            pause(0.05)
        pytest.fail(f"server {self.id} not {what} after {timeout:.0f} s; log:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        self.wait_until(lambda: self.http_status("/v2/health/ready") == 200, "ready", timeout)
        return self

    def wait_grpc_ready(self, timeout: float = READY_TIMEOUT_S) -> "Server":
        """Until ServerReady over gRPC answers true (a server without HTTP has no other probe)."""
        import tritonclient.grpc as grpcclient
        from tritonclient.utils import InferenceServerException

        def ready() -> bool:
            try:
                return client.is_server_ready(client_timeout=5)
            except InferenceServerException:
                return False

        with grpcclient.InferenceServerClient(self.grpc_url) as client:
            self.wait_until(ready, "ready over gRPC", timeout)
        return self

    def wait_exit(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server {self.id} did not exit within {timeout} s; log:\n{self.log_tail()}")

    def metrics_text(self, timeout: float = 60.0) -> str:
        """The Prometheus page of the metrics port."""
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        return urllib.request.urlopen(url, timeout=timeout).read().decode()

    def client(self, **kw) -> httpclient.InferenceServerClient:
        return httpclient.InferenceServerClient(self.url, **kw)

    def tree(self) -> list[int]:
        """The launcher and all its live descendants."""
        return [self.pid, *descendants(self.pid)]

    def titles(self) -> dict[int, str]:
        return {pid: cmdline(pid) for pid in descendants(self.pid)}

    def worker_pids(self, model: str) -> list[int]:
        return [pid for pid, t in self.titles().items() if t.startswith(f"shmserve worker {model} ")]

    def kill_group(self) -> None:
        """SIGKILL of the whole process group, as a crash or the OOM killer would."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL of the whole group after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_group()
        # Orphans (a worker whose broker was killed) still belong to the group: reap them too.
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            pass
        else:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                try:
                    os.killpg(self.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            else:
                try:
                    os.killpg(self.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        return self.proc.returncode


class ServerFactory:
    """Starts servers for one test (or module) and stops and checks them all at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.servers: list[Server] = []

    def create(self, repos: list[Path | str], extra_args: Iterable[str] = (), server_id: str | None = None,
               http_port: int | None = None) -> Server:
        s = Server(repos, self.log_dir, extra_args, server_id, http_port)
        self.servers.append(s)
        return s

    def start(self, repos: list[Path | str], extra_args: Iterable[str] = (), server_id: str | None = None,
              wait: bool = True) -> Server:
        s = self.create(repos, extra_args, server_id).start()
        return s.wait_ready() if wait else s

    def finish(self) -> None:
        for s in self.servers:
            s.stop()
        problems = []
        for sid in dict.fromkeys(s.id for s in self.servers):
            left = shm_entries(sid)
            if left:
                problems.append(f"server id {sid} left /dev/shm entries: {left}")
                remove_shm_entries(sid)
        if problems:
            logs = "\n\n".join(f"--- log of {s.id} (port {s.port}) ---\n{s.log_tail(40)}" for s in self.servers)
            pytest.fail("\n".join(problems) + "\n" + logs)


@pytest.fixture(scope="session")
def _session_factory(tmp_path_factory):
    factory = ServerFactory(tmp_path_factory.mktemp("logs"))
    yield factory
    factory.finish()


@pytest.fixture(scope="session")
def server(_session_factory) -> Server:
    """The shared server: the product's add_sub and digits models plus the test models."""
    return _session_factory.start([PRODUCT_MODELS, TEST_MODELS])


@pytest.fixture(scope="session")
def client(server) -> httpclient.InferenceServerClient:
    return server.client()


@pytest.fixture
def server_factory(tmp_path):
    factory = ServerFactory(tmp_path)
    yield factory
    factory.finish()


@pytest.fixture(scope="module")
def module_factory(tmp_path_factory):
    factory = ServerFactory(tmp_path_factory.mktemp("logs"))
    yield factory
    factory.finish()


# -- failure reports carry the logs of the servers the test used ----------------------------------


def _servers_of(item) -> list[Server]:
    out: dict[str, Server] = {}
    for value in getattr(item, "funcargs", {}).values():
        if isinstance(value, Server):
            out.setdefault(value.id, value)
        elif isinstance(value, ServerFactory):
            for s in value.servers:
                out.setdefault(s.id, s)
    return list(out.values())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for s in _servers_of(item):
            report.sections.append((f"shmserve log {s.id} (port {s.port})", s.log_tail(60)))


# -- waiting for a condition --------------------------------------------------------------------

# A deadline for what a loaded host may take long to do (a restart, a cleanup, a request): the
# tests wait on conditions, which end at once on an idle host, never on a fixed sleep.
DEADLINE_S = 60.0


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> float:
    """Poll ``predicate`` until it holds; the seconds that took (for logs, never for assertions)."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout:.0f} s")
        pause(0.02)  # (lets requests that tritonclient.http still has to send go: gates.pause)
    return time.monotonic() - started


def edge_refusals(server: Server) -> dict[tuple[str, str], float]:
    """``shmserve_edge_refusals`` from the metrics page, by (protocol, reason)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["protocol"], s.labels["reason"]): s.value
            for family in text_string_to_metric_families(server.metrics_text())
            if family.name == "shmserve_edge_refusals" for s in family.samples}


def http_connections(server: Server) -> float:
    """``shmserve_http_connections`` from the metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    return next(s.value for family in text_string_to_metric_families(server.metrics_text())
                if family.name == "shmserve_http_connections" for s in family.samples)


def pending_requests(server: Server, model: str) -> int:
    """The broker's count of requests for ``model`` accepted and not answered yet (validated, their
    regions resolved; executing, or queued in the broker or on a worker's lanes)."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=DEADLINE_S).read().decode()
    head = f'shmserve_requests_in_flight{{model="{model}",'
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(head)]
    assert values, f"no pending count for {model}"
    return int(sum(values))


def wait_pending(server: Server, model: str, count: int, timeout: float = DEADLINE_S) -> None:
    """Wait until at least ``count`` requests for ``model`` are pending (sent ones have arrived)."""
    wait_until(lambda: pending_requests(server, model) >= count, f"{count} request(s) pending for {model}", timeout)


# -- shared-memory tests (test_shared_memory.py, test_local_client.py) -----------------------------

SHM_MODELS = TESTS / "models" / "shm"
# The product's add_sub plus the models of tests/models/shm, and nothing else (fast start).
SHM_SERVER_ARGS = ["--model-control-mode", "explicit", "--load-model", "add_sub", "--load-model", "bytes_identity",
                   "--load-model", "slow_reader", "--load-model", "zerocopy_probe", "--load-model", "meta_echo"]


def start_shm_server(factory: ServerFactory, extra_args: Iterable[str] = (), server_id: str | None = None) -> Server:
    return factory.start([PRODUCT_MODELS, SHM_MODELS], [*SHM_SERVER_ARGS, *extra_args], server_id=server_id)


def shm_names(prefix: str) -> list[str]:
    """/dev/shm entries whose name starts with ``prefix`` (no leading slash)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def processes_mapping(pids: Iterable[int], shm_name: str) -> list[int]:
    """Those of ``pids`` that still map /dev/shm/<shm_name> (deleted or not)."""
    needle = f"{SHM_DIR}/{shm_name.lstrip('/')}"
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                paths = [parts[5].strip().removesuffix(" (deleted)") for parts in
                         (line.split(maxsplit=5) for line in f) if len(parts) == 6]
        except OSError:
            continue
        if needle in paths:
            out.append(pid)
    return out


def non_loopback_ipv4() -> list[str]:
    """IPv4 addresses of this machine's own interfaces that are not loopback (from the kernel's
    local routing table; nothing is sent anywhere)."""
    found: list[str] = []
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=5).stdout
        for line in out.splitlines():
            parts = line.split()
            if "inet" in parts:
                addr = parts[parts.index("inet") + 1].split("/")[0]
                if not addr.startswith("127."):
                    found.append(addr)
    except (OSError, subprocess.SubprocessError):
        pass
    if not found:
        try:
            lines = Path("/proc/net/fib_trie").read_text().splitlines()
        except OSError:
            lines = []
        for prev, line in zip(lines, lines[1:]):
            if "/32 host LOCAL" in line:
                addr = prev.strip().lstrip("|-+ ").strip()
                if addr and not addr.startswith("127.") and addr not in found:
                    found.append(addr)
    return found


@pytest.fixture(scope="session")
def local_non_loopback_address():
    """A non-loopback IPv4 address of this machine. If it has none, a dummy interface with a
    TEST-NET-2 address is made for the session (root only) and removed afterwards."""
    found = non_loopback_ipv4()
    if found:
        yield found[0]
        return
    dev, addr = f"shmt{os.getpid() % 100000}", "198.51.100.77"
    cmds = [["ip", "link", "add", dev, "type", "dummy"], ["ip", "addr", "add", f"{addr}/32", "dev", dev],
            ["ip", "link", "set", dev, "up"]]
    try:
        for cmd in cmds:
            subprocess.run(cmd, check=True, capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=10)
        pytest.fail(f"this machine has no non-loopback IPv4 address and a dummy interface cannot be made: {e}")
    try:
        yield addr
    finally:
        subprocess.run(["ip", "link", "del", dev], capture_output=True, timeout=10)
