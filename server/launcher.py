"""The launcher: starts the broker and the frontends, supervises them, and cleans up on exit.

Like uvicorn's supervisor it restarts what dies (with back-off), forwards SIGTERM/SIGINT for a
graceful drain, and unlinks every shared-memory object of its server id when it leaves. It also
restarts the broker when something else removed the server's objects from /dev/shm (a cleanup
script, or systemd-logind's RemoveIPC when the server's user logs out): the processes would go on
with their mappings, but no client could connect and no worker could start. It binds
the HTTP socket itself (under ``--allow-http``), so a busy port is a one-line error before anything
starts, and every HTTP frontend process accepts on that one socket.
"""
from __future__ import annotations

import argparse
import errno
import functools
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Callable


from shmserve import __version__
from shmserve.parent_death import ORPHANED, die_with_parent
from shmserve.server.edge.stop_signal import STOP
from shmserve.shm import logs, space, truncation_guard
from shmserve.shm.access import readers_environment
from shmserve.shm.child_spec import spec_file
from shmserve.shm.channel import BrokerSegment
from shmserve.shm.liveness import BROKER_TICKET, Tickets, broker_path
from shmserve.shm.names import (SHM_DIR, list_objects, object_name, ours, title_of, unlink_all,
                                unlink_semaphore, unlink_shm)

from .adopted import Adopted, become_subreaper
from .broker.journal import journal_path
from .broker.options import STARTUP_FAILED, BrokerOptions
from .cli import http_limits, log_settings
from .port_holder import describe as describe_port_holders
from .shm_needs import check_startup

log = logging.getLogger("shmserve")
BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
GRPC_START_S = 30.0  # the longest the HTTP frontends wait for the gRPC port to open
OBJECTS_CHECK_S = 1.0  # how often the broker's segment is looked for in /dev/shm
REMOVED = ("the server's shared-memory objects were removed from /dev/shm by another program (systemd-logind "
           "removes a user's objects when its last session ends unless RemoveIPC=no: run the server as a system "
           "user, docs/deploy.md); restarting the broker, which makes them anew: models loaded through the "
           "repository API since the start are not restored")
STABLE_S = 60.0  # a process that ran this long before dying is restarted without back-off


def _live_broker(server_id: str) -> str | None:
    """The pid (as text) of a live broker under ``server_id``, None if there is none. Live: it
    holds its ticket on its segment's file (shm/liveness.py), whatever state its other objects
    are in; removing those of a live server would cut off everyone it serves."""
    try:
        tickets = Tickets(broker_path(server_id))
    except OSError:  # absent or unreadable: nothing live to protect
        return None
    try:
        if not tickets.held(BROKER_TICKET):
            return None
    finally:
        tickets.close()
    try:
        seg = BrokerSegment.attach(server_id)
    except Exception:  # noqa: BLE001 - it lives, but its objects are not all there yet
        return "unknown"
    pid = seg.pid
    seg.close()
    return str(_launcher_of(pid, server_id))


def _launcher_of(broker: int, server_id: str) -> int:
    """The launcher running ``broker`` (its parent): the process an operator stops to stop the
    server (the launcher restarts a broker killed alone). The broker's pid as its segment gives
    it where that is not the broker of ``server_id`` with its launcher for a parent here (a
    server in another PID namespace sharing /dev/shm, or a launcher gone)."""
    if title_of(broker) != f"shmserve broker {server_id}":
        return broker
    try:
        with open(f"/proc/{broker}/stat") as f:
            parent = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return broker
    return parent if title_of(parent) == f"shmserve launcher {server_id}" else broker


def _check_previous(server_id: str) -> None:
    """Refuse to start twice under one id; remove objects a dead server left behind."""
    pid = _live_broker(server_id)
    if pid is not None:
        sys.stderr.write(f"shmserve: error: a server with id '{server_id}' is already running (pid {pid}); "
                         f"stop it (SIGTERM) or use --id to run another\n")
        sys.exit(1)
    removed = unlink_all(server_id)
    if removed:
        log.warning("removed %d shared-memory object(s) left by a previous server '%s'", removed, server_id)


def _bind(address: str, port: int, protocol: str = "HTTP", reuse_port: bool = False,
          listen: bool = True) -> socket.socket:
    """The socket, bound (a busy port is an error here) and listening unless ``listen`` is
    false; ``reuse_port`` (Triton's --reuse-http-port, --reuse-grpc-port) lets other servers bind
    the same port, the kernel spreading connections between those that listen
    (server/edge/shared_port.py: the frontends listen on a shared one once the loads are over)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((address, port))
    except OSError as e:
        held = describe_port_holders(port) if e.errno == errno.EADDRINUSE else ""
        sys.stderr.write(f"shmserve: error: cannot bind {protocol} to {address}:{port}: {e.strerror}{held}\n")
        sys.exit(1)
    if listen:
        sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Launcher:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.sid: str = args.id
        self.broker_opts = BrokerOptions(
            server_id=self.sid, repositories=[os.path.abspath(r) for r in args.model_repository],
            control_mode=args.model_control_mode, repository_poll_s=args.repository_poll_secs,
            load_models=args.load_model,
            strict_config=args.strict_model_config, strict_readiness=args.strict_readiness,
            exit_on_error=args.exit_on_error, exit_timeout_s=args.exit_timeout_secs,
            log=log_settings(args), trace=args.trace_config, log_file_shown=args.log_file_shown,
            trace_file_shown=args.trace_file_shown, worker_arena_bytes=args.worker_arena_mb << 20,
            broker_arena_cap_bytes=args.broker_arena_mb << 20,
            worker_arena_start_bytes=args.worker_arena_start_bytes,
            worker_arena_growth_bytes=args.worker_arena_growth_bytes,
            default_max_batch_size=getattr(args, "default_max_batch_size", 4),
            allow_remote_shm=args.allow_remote_shm, allow_client_shm=args.allow_client_shm,
            allow_file_uploads=args.allow_model_file_uploads,
            metrics_port=args.metrics_port if args.allow_metrics else 0, metrics_address=args.metrics_address,
            metrics_interval_ms=args.metrics_interval_ms, metrics_config=args.metrics_config,
            cpu_metrics=args.allow_cpu_metrics, gpu_metrics=args.allow_gpu_metrics, poll_us=args.poll_us,
            response_cache_bytes=args.response_cache_bytes, cloud_repositories=args.cloud_repositories,
            rate_limit=args.rate_limit, rate_limit_resources=args.rate_limit_resource,
            config_name=args.model_config_name, load_retries=args.model_load_retry_count,
        )
        self.stopping = False
        self.stop_signal = 0  # the signal that asked us to stop (logged outside the handler)
        self.broker: subprocess.Popen | None = None
        self.broker_inode = 0  # of the running broker's segment file (``_objects_removed``)
        self.frontends: list[subprocess.Popen | None] = []
        self.sock: socket.socket | None = None
        self.adopted = Adopted(self.sid)  # workers that outlive their broker come to us (adopted.py)

    def _own(self) -> set[int]:
        """The pids of the children we started (``subprocess.Popen`` reaps them)."""
        return {p.pid for p in (self.broker, *self.frontends) if p is not None}

    def _start_broker(self) -> subprocess.Popen:
        with spec_file(self.broker_opts.to_json()) as stdin:
            # The users whose local clients may open the broker's and workers' objects (shm/access.py).
            env = {**os.environ, **readers_environment(self.args.local_client_users)}
            proc = subprocess.Popen([sys.executable, "-m", "shmserve.server.broker"], stdin=stdin,
                                    preexec_fn=_dies_with_us(ORPHANED), env=env)
        deadline = time.monotonic() + 30
        self.broker_inode = 0
        while time.monotonic() < deadline and proc.poll() is None:
            self.broker_inode = self._broker_inode()
            if self.broker_inode > 0:
                break
            time.sleep(0.01)
        return proc

    def _broker_inode(self) -> int:
        """The inode of the broker's segment in /dev/shm (0: there is none; -1: it could not be
        looked at now)."""
        try:
            return os.stat(SHM_DIR + object_name(self.sid, "broker", 0)).st_ino
        except FileNotFoundError:
            return 0
        except OSError:
            return -1

    def _objects_removed(self) -> bool:
        """Whether the segment of the running broker is no longer in /dev/shm (only the broker
        and the launcher remove it, and neither has)."""
        if self.broker_inode <= 0:
            return False
        now = self._broker_inode()
        return now >= 0 and now != self.broker_inode

    def _start_frontend(self, index: int) -> subprocess.Popen:
        assert self.sock is not None
        spec = {"server_id": self.sid, "fd": self.sock.fileno(), "index": index,
                "arena_bytes": self.args.frontend_arena_mb << 20, "allow_remote_shm": self.args.allow_remote_shm,
                "allow_client_shm": self.args.allow_client_shm, "max_input_bytes": self.args.http_max_input_size, "exit_timeout_s": self.args.exit_timeout_secs,
                "restricted": self.args.http_restricted_api, "max_inflight": self.args.http_max_inflight,
                "header_forward_pattern": self.args.http_header_forward_pattern,
                "max_tensor_elements": self.args.http_max_tensor_elements, "poll_us": self.args.poll_us,
                "http_limits": http_limits(self.args).to_spec(), "log": log_settings(self.args),
                "shared_port": self.args.reuse_http_port}
        with spec_file(spec) as stdin:
            return subprocess.Popen([sys.executable, "-m", "shmserve.server.frontend"],
                                    pass_fds=(self.sock.fileno(),), stdin=stdin, preexec_fn=_dies_with_us(signal.SIGKILL))

    def _start_grpc(self) -> subprocess.Popen:
        """The gRPC frontend: one process, binding its own port (grpcio takes no inherited socket)."""
        spec = {"server_id": self.sid, "address": self.args.grpc_address, "port": self.args.grpc_port,
                "arena_bytes": self.args.frontend_arena_mb << 20, "allow_remote_shm": self.args.allow_remote_shm,
                "exit_timeout_s": self.args.exit_timeout_secs, "max_inflight": self.args.http_max_inflight,
                "max_tensor_elements": self.args.http_max_tensor_elements, "poll_us": self.args.poll_us,
                "log": log_settings(self.args), "shared_port": self.args.reuse_grpc_port,
                **self.args.grpc}  # grpc: server/grpc/options.py
        with spec_file(spec) as stdin:
            return subprocess.Popen([sys.executable, "-m", "shmserve.server.grpc"], stdin=stdin,
                                    preexec_fn=_dies_with_us(signal.SIGKILL))

    def _http_frontends(self) -> int:
        return self.args.http_workers if self.args.allow_http else 0

    def _start_child(self, index: int) -> subprocess.Popen:
        """Frontend ``index``: the HTTP ones first, then the gRPC one."""
        if index < self._http_frontends():
            return self._start_frontend(index)
        return self._start_grpc()

    def _child_title(self, index: int) -> str:
        """Frontend ``index`` as its log lines and process title name it."""
        return f"HTTP frontend #{index}" if index < self._http_frontends() else "the gRPC frontend"

    def _on_signal(self, signum: int, frame: object) -> None:
        self.stopping = True
        self.stop_signal = signum

    def run(self) -> int:
        _check_previous(self.sid)
        try:  # a container's /dev/shm is small unless raised: say so now, not with a SIGBUS later
            check_startup(self.args)
        except space.NoRoom as e:
            sys.stderr.write(f"shmserve: error: {e}\n")
            return 1
        if self.args.allow_http:
            self.sock = _bind(self.args.http_address, self.args.http_port, reuse_port=self.args.reuse_http_port,
                              listen=not self.args.reuse_http_port)
        if self.args.allow_grpc:  # a busy port is a one-line error here too, not a restart loop
            _bind(self.args.grpc_address, self.args.grpc_port, "gRPC", self.args.reuse_grpc_port, listen=False).close()
        if self.args.allow_metrics and self.args.metrics_port > 0:
            # As Triton, which does not start without its metrics service: one serving without it
            # would leave scrapes of that port to whatever holds it (another server's figures).
            _bind(self.args.metrics_address, self.args.metrics_port, "metrics", listen=False).close()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if self.args.local_client_users and not truncation_guard.available():
            log.warning("--local-client-users: shmserve was installed without its truncation guard (no C compiler "
                        "then), so a client of those users that truncates an object it may write ends the server "
                        "process that touches it (SIGBUS); install shmserve again where a C compiler is found")
        code = 0
        # The launcher's own first word once its checks passed: a start slowed down (a busy host,
        # a large repository to scan) is then told from one that hangs before the broker's first line.
        log.info("starting shmserve %s as '%s' (pid %d), repositories: %s", __version__, self.sid, os.getpid(),
                 ", ".join(map(str, self.args.model_repository)))
        become_subreaper()
        try:
            self.broker = self._start_broker()
            # gRPC first, HTTP once gRPC accepts connections (Triton's order): a readiness probe
            # answered over HTTP then also means the gRPC port is open.
            grpc = [self._start_grpc()] if self.args.allow_grpc else []
            if grpc and not self.args.reuse_grpc_port:  # (a shared port answers for the others meanwhile)
                _wait_listening(self.args.grpc_address, self.args.grpc_port, grpc[0], GRPC_START_S)
            self.frontends = [self._start_frontend(i) for i in range(self._http_frontends())] + grpc
            self.log_follower = logs.BrokerSettings(self.sid)  # run-time changes (POST /v2/logging) here too
            self._log_serving()
            code = self._supervise()
            if self.stop_signal:
                log.info("%s received: draining in-flight requests (up to %g s, --exit-timeout-secs), then "
                         "stopping", signal.Signals(self.stop_signal).name, self.args.exit_timeout_secs)
        finally:
            self._stop_all()
            unlink_all(self.sid)
            self.adopted.kill_workers(self._own())
        log.info("shmserve '%s' stopped; its shared-memory objects are removed", self.sid)
        return code

    def _log_serving(self) -> None:
        a = self.args  # (each frontend, and the broker for metrics, says where it serves)
        if not (a.allow_http or a.allow_grpc):
            log.info("shmserve '%s' serving local clients only (--allow-http=false --allow-grpc=false)", self.sid)
        shared = [flag for flag, on in (("--reuse-http-port", a.allow_http and a.reuse_http_port),
                                        ("--reuse-grpc-port", a.allow_grpc and a.reuse_grpc_port)) if on]
        if shared:
            log.info("%s: this server takes connections on the shared port once its initial loads are over",
                     " and ".join(shared))

    def _supervise(self) -> int:
        broker_restarts = 0
        frontend_restarts = [0] * len(self.frontends)
        broker_since = time.monotonic()
        frontend_since = [time.monotonic()] * len(self.frontends)
        objects_checked = time.monotonic()
        while not self.stopping:
            time.sleep(0.25)  # four cheap checks a second keep an idle server well under 1% CPU
            self.log_follower.check()
            self.adopted.check(self._own())
            assert self.broker is not None
            if time.monotonic() - objects_checked >= OBJECTS_CHECK_S:
                objects_checked = time.monotonic()
                if self.broker.poll() is None and self._objects_removed() and not _exits_soon(self.broker):
                    log.error("%s", REMOVED)
                    self.broker_inode = 0
                    self.broker.kill()  # (nothing it still holds can be reached by a new client)
                    self.broker.wait()
            code = self.broker.poll()
            if code is not None and not self.stopping:
                if code in (2, STARTUP_FAILED):  # bad options, or a model failed at start: do not loop
                    log.error("%s; shutting down", "the start failed: a model did not load and --exit-on-error is "
                              "on (its error is above)" if code == STARTUP_FAILED else
                              f"the broker exited with code {code}")
                    return 1
                if time.monotonic() - broker_since > STABLE_S:
                    broker_restarts = 0  # it had been running fine: not a crash loop
                delay = BACKOFF_S[min(broker_restarts, len(BACKOFF_S) - 1)]
                log.error("the broker died (exit code %d); restarting it in %.1f s", code, delay)
                broker_restarts += 1
                time.sleep(delay)
                unlink_after_broker_crash(self.sid)
                self.broker = self._start_broker()
                broker_since = time.monotonic()
            for i, fe in enumerate(self.frontends):
                if fe is not None and fe.poll() is not None and not self.stopping:
                    if time.monotonic() - frontend_since[i] > STABLE_S:
                        frontend_restarts[i] = 0
                    delay = BACKOFF_S[min(frontend_restarts[i], len(BACKOFF_S) - 1)]
                    log.error("%s died (exit code %s); restarting it in %.1f s", self._child_title(i), fe.returncode,
                              delay)
                    frontend_restarts[i] += 1
                    time.sleep(delay)
                    self.frontends[i] = self._start_child(i)
                    frontend_since[i] = time.monotonic()
        return 0

    def _stop_all(self) -> None:
        """The broker first, then the frontends. While the broker drains (up to
        ``--exit-timeout-secs``) the frontends stay up: readiness says no at once, requests in
        flight finish, and new ones get a 503 with Retry-After rather than a reset connection or a
        hang in the accept queue. Once the broker is gone the frontends stop, finishing the
        responses they are sending."""
        began = time.monotonic()
        if self.broker is not None and self.broker.poll() is None:
            self.broker.send_signal(signal.SIGTERM)
        _wait(self.broker, self.args.exit_timeout_secs + BROKER_STOP_S)
        for fe in self.frontends:
            if fe is not None and fe.poll() is None:
                fe.send_signal(STOP)  # (they pass over SIGTERM while we live: edge/stop_signal.py)
        # The frontends get what is left of the exit timeout (at least FRONTEND_STOP_S) to send what
        # they hold, all together: one that cannot stop (stopped, stuck in a send) is killed then,
        # so the server is gone about --exit-timeout-secs after the signal, as Triton is.
        deadline = max(began + self.args.exit_timeout_secs, time.monotonic() + FRONTEND_STOP_S)
        for i, fe in enumerate(self.frontends):
            if fe is not None and not _exits_soon(fe, max(0.0, deadline - time.monotonic())):
                log.warning("%s did not stop within --exit-timeout-secs; killing it", self._child_title(i))
                _wait(fe, 0)
        if self.sock is not None:
            self.sock.close()


# After its drain, how long the broker may take to stop: it gives its workers what is left of the
# exit timeout, at least 1 s, before it kills them (server/broker/instances.py STOP_GRACE_S), then
# removes its objects. Killed sooner,
# it would leave a worker stuck in a model's execute() to its own devices.
BROKER_STOP_S = 15
# After the broker, how long the frontends may take at least to send the answers they hold.
FRONTEND_STOP_S = 2.0


def _dies_with_us(signum: int) -> Callable[[], None]:
    """A child's ``preexec_fn``: if the launcher dies (even by SIGKILL, as the OOM killer or a
    supervisor's grace period ends it), the child gets ``signum``. Frontends are killed (they hold
    nothing of their own to clean); the broker gets ``ORPHANED`` and removes the server's objects."""
    launcher = os.getpid()
    return functools.partial(die_with_parent, signum, launcher)


def _exits_soon(proc: subprocess.Popen, within_s: float = 2.0) -> bool:
    """Whether ``proc`` exits within ``within_s``: a broker that is stopping (a start failed under
    --exit-on-error, a segment it could not make) removes its own segment first."""
    try:
        proc.wait(within_s)
        return True
    except subprocess.TimeoutExpired:
        return False


def unlink_after_broker_crash(server_id: str) -> None:
    """After a broker crash: remove every object of the server but the journal, which the next
    broker reads to restore what clients changed (server/broker/journal.py). Clients' segments go
    too: each was known only to the broker that died, and a client that lives on connects to the
    next one with a new segment (it keeps its mapping of the old one until it closes it), while
    the segment of a client that died meanwhile would otherwise stay until the server stops."""
    shms, sems = ours(*list_objects(server_id))  # (a client of another user removes its own)
    journal = journal_path(server_id)[len(SHM_DIR):]
    for name in shms:
        if name != journal:
            unlink_shm(name)
    for name in sems:
        unlink_semaphore(name)


def _wait_listening(address: str, port: int, proc: subprocess.Popen, timeout: float) -> None:
    """Until ``address:port`` accepts a connection, ``proc`` exits, or ``timeout`` passes (then
    the supervisor's restarts and the frontend's own log say what went wrong)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(address, address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection((host, port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.02)


def _wait(proc: subprocess.Popen | None, timeout: float) -> None:
    if proc is None:
        return
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
