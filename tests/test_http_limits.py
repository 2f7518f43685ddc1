"""The limits an HTTP frontend keeps on its connections (server/frontend/protocol.py): idle, head and
body timeouts, the head size limit, a refused body left unread, the connection bound under the
descriptor limit, and a frontend that runs out of descriptors while its broker restarts.

Each fault is caused against a real server with its limit lowered by flag, so each test takes
seconds; the limits' defaults are in docs/flags.md.
"""
from __future__ import annotations

import json
import os
import resource
import signal
import socket
import threading
import time

import numpy as np
import pytest

from conftest import TEST_MODELS, Server, edge_refusals, http_connections, raw_request, read_raw_response, wait_until

IDLE_S = HEAD_S = BODY_S = 1.5
MAX_HEAD = 16 << 10
MAX_INPUT = 4 << 20
SLACK_S = 3.0  # what a loaded host may add to a timeout
LINGER_BOUND_S = BODY_S + SLACK_S + 10  # a lingering close ends within the body timeout


@pytest.fixture(scope="module")
def edge(module_factory):
    return module_factory.start([TEST_MODELS], [
        "--model-control-mode", "explicit", "--load-model", "identity_all",
        "--http-idle-timeout-secs", str(IDLE_S), "--http-header-timeout-secs", str(HEAD_S),
        "--http-body-timeout-secs", str(BODY_S), "--http-max-header-bytes", str(MAX_HEAD),
        "--http-max-input-size", str(MAX_INPUT)])


def _identity_request(values: np.ndarray) -> tuple[bytes, bytes]:
    """(HTTP head, body) of an identity_all request with ``values`` as binary data."""
    head = json.dumps({"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": list(values.shape),
                                   "parameters": {"binary_data_size": values.nbytes}}],
                       "outputs": [{"name": "OUT_FP32", "parameters": {"binary_data": True}}]}).encode()
    body = head + values.tobytes()
    return (f"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n"
            f"Inference-Header-Content-Length: {len(head)}\r\n\r\n").encode(), body


def _identity(port: int, values: np.ndarray) -> None:
    http, body = _identity_request(values)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(http + body)
        status, headers, out = read_raw_response(sock.makefile("rb"))
    assert status == 200, out[:300]
    n = int(headers["inference-header-content-length"])
    np.testing.assert_array_equal(np.frombuffer(out[n:], dtype=np.float32), values.ravel())


def _until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that was (seconds
    from now); fails if it stays open ``timeout`` seconds."""
    started = time.monotonic()
    sock.settimeout(timeout)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except socket.timeout:
        pytest.fail(f"the connection was still open after {timeout} s; it sent {out[:200]!r}")
    except ConnectionResetError:
        pass
    return out, time.monotonic() - started


def _sent_until_closed(sock: socket.socket, piece: bytes) -> tuple[bytes, float]:
    """``_until_closed`` while another thread sends ``piece`` again and again until the server
    closes the connection (a body or trailers that never end)."""
    stopped = threading.Event()

    def endless() -> None:
        try:
            while not stopped.is_set():
                sock.sendall(piece)
        except OSError:
            pass  # the server closed the connection

    sender = threading.Thread(target=endless)
    sender.start()
    try:
        return _until_closed(sock, BODY_S + SLACK_S + 10)
    finally:
        stopped.set()
        sender.join(10)


def _error(answer: bytes, status: int) -> str:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer[:300]
    assert b"connection: close" in head.lower(), head
    return json.loads(body)["error"]


def _frontend(server: Server) -> int:
    return next(pid for pid, title in server.titles().items() if title.startswith("shmserve frontend"))


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS:"))


# -- timeouts --------------------------------------------------------------------------------------


def test_connections_that_never_send_a_byte_are_closed(edge):
    """Silent connections are idle from their accept on: closed after the idle timeout, not kept
    for good (uvicorn's keep-alive timeout once started only after a first answer)."""
    socks = [socket.create_connection(("127.0.0.1", edge.port)) for _ in range(50)]
    try:
        started = time.monotonic()
        for sock in socks:
            out, _ = _until_closed(sock, IDLE_S + SLACK_S + 5)
            assert out == b""
        assert time.monotonic() - started >= IDLE_S - 0.2
    finally:
        for sock in socks:
            sock.close()


def test_a_connection_whose_body_came_after_its_answer_is_idle_from_the_body_s_end(edge):
    """A GET answered before its body came keeps its connection (protocol.py): once the rest of
    the body is dropped the connection is idle, and the idle timeout closes it; while the body
    still comes, it is not idle."""
    with socket.create_connection(("127.0.0.1", edge.port)) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n")
        status, headers, _ = read_raw_response(sock.makefile("rb"))
        assert status == 200 and headers.get("connection") != "close"
        for _ in range(3):  # the body, a byte at a time, slower than the idle timeout in all
            time.sleep(IDLE_S / 2)
            sock.sendall(b" ")
        time.sleep(IDLE_S / 2)
        sock.sendall(b" ")
        out, took = _until_closed(sock, IDLE_S + SLACK_S + 5)
    assert out == b"" and took >= IDLE_S - 0.2


def test_a_body_whose_client_waits_for_100_continue_ends_the_connection(edge):
    """A GET with ``Expect: 100-continue`` answered without one: its client may never send the
    body, and its next request must not be read as that body, so the connection ends."""
    with socket.create_connection(("127.0.0.1", edge.port)) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
        status, _, _ = read_raw_response(sock.makefile("rb"))
        assert status == 200
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")  # (no body came: the client went on)
        out, _ = _until_closed(sock, LINGER_BOUND_S)
    assert out == b"", out[:200]  # not a 400 for a request read from its fifth byte on


def test_a_head_that_never_ends_gets_408(edge):
    """A head sent a field at a time, or as nothing but line ends, well within the idle timeout
    between writes: answered 408 once the head timeout passed since its first byte."""
    for opening, more in ((b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n", b"X-More: y\r\n"), (b"\r\n", b"\r\n")):
        with socket.create_connection(("127.0.0.1", edge.port)) as sock:
            sock.sendall(opening)
            started = time.monotonic()
            sock.settimeout(0.3)
            answer = b""
            while time.monotonic() - started < HEAD_S + SLACK_S + 5:
                try:
                    sock.sendall(more)
                    chunk = sock.recv(4096)
                except socket.timeout:
                    continue
                except (BrokenPipeError, ConnectionResetError):
                    break
                if not chunk:
                    break
                answer += chunk
            took = time.monotonic() - started
        assert "--http-header-timeout-secs" in _error(answer, 408)
        assert HEAD_S - 0.2 <= took < HEAD_S + SLACK_S


def test_the_limits_refusals_and_the_open_connections_are_on_the_metrics_page(server_factory):
    """The log says each kind of refusal at most once a minute; the metrics port counts every one,
    by reason, and shows the HTTP connections open now, so an operator sees a limit at work."""
    server = server_factory.start([TEST_MODELS], ["--model-control-mode", "explicit",
                                                  "--http-header-timeout-secs", str(HEAD_S),
                                                  "--http-max-header-bytes", str(MAX_HEAD)])
    # (the start's readiness probes were connections too: the frontend reports their close on a tick)
    wait_until(lambda: http_connections(server) == 0, "the readiness probes' connections gone")
    assert edge_refusals(server) == {}
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(3)]
    try:
        wait_until(lambda: http_connections(server) == 3, "the open connections shown")
        for _ in range(2):  # a head that never ends: 408, twice (the log says it once)
            with socket.create_connection(("127.0.0.1", server.port)) as sock:
                sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n")
                assert "--http-header-timeout-secs" in _error(_until_closed(sock, HEAD_S + SLACK_S + 5)[0], 408)
        with socket.create_connection(("127.0.0.1", server.port)) as sock:  # a head too large: 431
            sock.sendall(b"GET / HTTP/1.1\r\nX-Big: " + b"a" * MAX_HEAD + b"\r\n\r\n")
            assert "--http-max-header-bytes" in _error(_until_closed(sock, SLACK_S + 5)[0], 431)
        wait_until(lambda: edge_refusals(server) == {("http", "head-timeout"): 2, ("http", "head"): 1},
                   "the refusals counted")
    finally:
        for sock in idle:
            sock.close()
    wait_until(lambda: http_connections(server) == 0, "the closed connections gone from the gauge")
    assert edge_refusals(server) == {("http", "head-timeout"): 2, ("http", "head"): 1}
    assert server.log().count("request head took over") == 1


def test_a_frontend_that_reconnects_has_its_refusals_counted_once(server_factory):
    """A process keeps its liveness ticket when it connects again (the broker disconnected it, say):
    its report after that carries the same totals, which replace its own, not add to them."""
    from shmserve.shm.client import Client
    from shmserve.shm.control_messages import EdgeReport

    server = server_factory.start([TEST_MODELS], ["--model-control-mode", "explicit"])
    with Client(server.id) as client:
        client._control(EdgeReport("http", 5, {"head": 3}))
        wait_until(lambda: http_connections(server) >= 5, "the report taken")
    wait_until(lambda: http_connections(server) == 0, "the departed process's connections gone from the gauge")
    assert edge_refusals(server) == {("http", "head"): 3}  # (kept: the counter does not go down)
    with Client(server.id) as client:  # the same process again: the same ticket
        client._control(EdgeReport("http", 0, {"head": 3}))
        assert edge_refusals(server) == {("http", "head"): 3}


def test_a_body_that_stops_half_way_gets_408_and_gives_its_room_back(edge):
    """A Content-Length larger than what is sent, for a small body and for a large one (copied into
    the frontend's arena as it arrives): 408 after the body timeout, and the arena has room again."""
    values = np.arange(1 << 20, dtype=np.float32).reshape(1, -1)  # 4 MiB: taken into its block as it arrives
    for size in (100, 2 << 20):
        http, body = _identity_request(values[:, :size // 4])
        with socket.create_connection(("127.0.0.1", edge.port)) as sock:
            sock.sendall(http + body[:len(body) // 2])
            out, took = _until_closed(sock, BODY_S + SLACK_S + 5)
        assert "--http-body-timeout-secs" in _error(out, 408)
        assert BODY_S - 0.2 <= took < BODY_S + SLACK_S
    _identity(edge.port, values[:, :(3 << 20) // 4])


# -- heads and bodies too large ---------------------------------------------------------------------


def test_a_huge_head_is_refused_while_other_clients_go_on(edge):
    """A 100 MB header field is refused with 431 once it passes the limit (it is not gathered: the
    frontend's memory stays flat), and another client's requests meanwhile are answered promptly."""
    frontend = _frontend(edge)
    before = _rss(frontend)
    answer: list[bytes] = []
    huge_head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Huge: " + b"a" * (100 << 20) + b"\r\n\r\n"

    def send_huge() -> None:
        with socket.create_connection(("127.0.0.1", edge.port)) as sock:
            try:
                sock.sendall(huge_head)
            except (BrokenPipeError, ConnectionResetError):
                pass  # cut once the answer was out: the rest was not read
            answer.append(_until_closed(sock, BODY_S + SLACK_S + 5)[0])

    huge = threading.Thread(target=send_huge)
    huge.start()
    slowest = 0.0
    values = np.arange(256, dtype=np.float32).reshape(1, -1)
    while huge.is_alive():
        started = time.monotonic()
        _identity(edge.port, values)
        slowest = max(slowest, time.monotonic() - started)
    huge.join()
    assert "--http-max-header-bytes" in _error(answer[0], 431)
    assert slowest < 1.0, slowest
    assert _rss(frontend) - before < 32 << 20
    # A complete head over the limit, whether it arrives in one read or in several, is refused too;
    # one just under the limit is served.
    for pieces in (1, 3):
        with socket.create_connection(("127.0.0.1", edge.port)) as sock:
            head = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * (MAX_HEAD * 3) + b"\r\n\r\n"
            step = -(-len(head) // pieces)
            for i in range(0, len(head), step):
                sock.sendall(head[i:i + step])
                time.sleep(0.05)
            assert "--http-max-header-bytes" in _error(_until_closed(sock, BODY_S + SLACK_S + 5)[0], 431)
    assert raw_request(edge.port, "GET", "/v2/health/live", headers={"X-Big": "b" * (MAX_HEAD - 200)}).status == 200


def test_an_endless_chunked_body_is_cut(edge):
    """A chunked body that never ends is refused once it passes --http-max-input-size; the client
    reads that answer, and the connection is closed a moment later instead of read for good."""
    with socket.create_connection(("127.0.0.1", edge.port)) as sock:
        sock.sendall(b"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        out, took = _sent_until_closed(sock, b"10000\r\n" + b" " * 0x10000 + b"\r\n")
    assert "--http-max-input-size" in _error(out, 400)
    assert took < BODY_S + SLACK_S + 5


def test_a_refused_declared_length_ends_the_connection(edge):
    """A Content-Length past the limit is refused before the body is read, and what the client
    sends after is dropped, not read on the keep-alive connection for as long as it comes."""
    with socket.create_connection(("127.0.0.1", edge.port)) as sock:
        sock.sendall(b"POST /v2/logging HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % (1 << 40))
        stopped = threading.Event()

        def trickle() -> None:
            try:
                while not stopped.wait(0.1):  # slow enough that no body timeout ends it
                    sock.sendall(b" " * 1000)
            except OSError:
                pass

        sender = threading.Thread(target=trickle)
        sender.start()
        try:
            out, took = _until_closed(sock, BODY_S + SLACK_S + 10)
        finally:
            stopped.set()
            sender.join(10)
    assert "--http-max-input-size" in _error(out, 400)
    assert took < BODY_S + SLACK_S


# -- descriptors -------------------------------------------------------------------------------------


class _LimitedServer(Server):
    """A server whose processes start with a descriptor limit of ``nofile`` (prlimit)."""

    nofile = 300

    def command(self) -> list[str]:
        return ["prlimit", f"--nofile={self.nofile}:{self.nofile}", *super().command()]


def _bounded_server(server_factory) -> Server:
    """Under a 300-descriptor limit the frontend holds 300 - 128 - 300 // 16 = 154 connections."""
    server = _LimitedServer([TEST_MODELS], server_factory.log_dir, ["--model-control-mode", "explicit",
                                                                    "--load-model", "identity_all"])
    server_factory.servers.append(server)
    return server.start().wait_ready()


BOUND = 300 - 128 - 300 // 16


def test_at_the_bound_a_new_connection_takes_the_place_of_the_one_idle_longest(server_factory):
    """Idle connections are kept (no idle timeout by default, as Triton), and at the bound a new
    one is served in place of the connection idle longest, closed for it (nginx's way): a flood
    of idle connections never locks clients out. A connection with a request in progress (a
    head begun) is never the one closed."""
    server = _bounded_server(server_factory)
    busy = socket.create_connection(("127.0.0.1", server.port))
    busy.sendall(b"GET /v2/health/live HTTP/1.1\r\n")  # a head begun: busy from now on
    busy_reader = busy.makefile("rb")
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(BOUND + 20)]
    try:
        drained = len(socks) + 1 - BOUND  # one for each past the bound, the oldest idle ones
        for sock in socks[:drained]:
            sock.settimeout(5)
            assert sock.recv(4096) == b"", "an idle connection past the bound was kept"
        for sock in socks[drained:]:
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):  # open, nothing to read
                sock.recv(4096)
            sock.setblocking(True)
        newest = socks[-1]
        newest.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_raw_response(newest.makefile("rb"))[0] == 200
        busy.sendall(b"Host: x\r\n\r\n")
        assert read_raw_response(busy_reader)[0] == 200
        assert "closing the connection idle longest for a new one" in server.log()
    finally:
        for sock in socks:
            sock.close()
        busy.close()


def test_with_every_connection_busy_a_new_one_gets_503_and_the_frontend_keeps_serving(server_factory):
    """At the bound with no connection idle (each with a head begun), a new connection is
    answered 503 at once, while the connections it holds are served, liveness stays 200 and its
    broker checks go on (no descriptor runs out)."""
    server = _bounded_server(server_factory)
    kept = socket.create_connection(("127.0.0.1", server.port))
    kept.sendall(b"GET /v2/health/live HTTP/1.1\r\n")
    reader = kept.makefile("rb")
    socks = []
    try:
        for _ in range(BOUND - 1):
            sock = socket.create_connection(("127.0.0.1", server.port))
            sock.sendall(b"GET / HTTP/1.1\r\n")  # busy: its head began
            socks.append(sock)
        refused = 0
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", server.port))
            socks.append(sock)
            sock.settimeout(5)
            assert "--http-max-connections" in _error(sock.recv(4096), 503)
            refused += 1
        assert refused == 20
        kept.sendall(b"Host: x\r\n\r\n")
        assert read_raw_response(reader)[0] == 200
        kept.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_raw_response(reader)[0] == 200
        assert "cannot check the broker connection" not in server.log()
    finally:
        for sock in socks:
            sock.close()
        kept.close()


def test_every_process_of_the_server_raises_its_descriptor_limit(server_factory):
    """Started under a soft limit of 256 (as a shell's ``ulimit -n`` may leave it), the broker, the
    workers and both frontends raise theirs to the hard limit: a frontend holds a descriptor per
    connection, the broker and workers one per guarded mapping of a client's segment."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 1 << 20) if hard != resource.RLIM_INFINITY else 1 << 20
    assert want > 256, "the hard limit leaves nothing to raise"
    server = server_factory.create([TEST_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity_all"])
    command = server.command()
    server.command = lambda: ["sh", "-c", 'ulimit -Sn 256 && exec "$@"', "sh", *command]  # the launcher's limit
    server.start().wait_ready()
    roles = {}
    for pid, title in server.titles().items():
        role = title.split()[1]  # shmserve broker|worker|frontend|grpc ...
        with open(f"/proc/{pid}/limits") as f:
            line = next(line for line in f if line.startswith("Max open files"))
        roles.setdefault(role, set()).add(int(line.split()[3]))
    assert {"broker", "worker", "frontend", "grpc"} <= roles.keys(), roles
    with open(f"/proc/{server.pid}/limits") as f:  # the launcher, which only supervises, keeps what it was given
        assert next(line for line in f if line.startswith("Max open files")).split()[3] == "256"
    for role in ("broker", "worker", "frontend", "grpc"):
        assert roles[role] == {want}, (role, roles[role])


def test_a_frontend_out_of_descriptors_fails_liveness_and_recovers_from_a_broker_restart(server_factory):
    """The frontend's descriptor limit lowered under its connection bound (prlimit) and filled with
    idle connections: liveness answers 503 on a connection it already held, its broker is killed
    and restarted meanwhile, and once the connections go the frontend serves again at once. (Its
    broker check once died of 'too many open files' and every request after the broker's restart
    hung, readiness too, while liveness said 200.)"""
    server = server_factory.start([TEST_MODELS], ["--model-control-mode", "explicit", "--load-model",
                                                  "identity_all", "--http-idle-timeout-secs", "60"])
    values = np.arange(16, dtype=np.float32).reshape(1, -1)
    _identity(server.port, values)  # connected to the broker
    frontend = _frontend(server)
    broker = next(pid for pid, title in server.titles().items() if title.startswith("shmserve broker"))
    probe = socket.create_connection(("127.0.0.1", server.port))
    reader = probe.makefile("rb")
    open_fds = len(os.listdir(f"/proc/{frontend}/fd"))
    resource.prlimit(frontend, resource.RLIMIT_NOFILE, (open_fds + 10, open_fds + 10))
    socks = []
    try:
        for _ in range(30):  # more than the frontend can take: it runs out
            socks.append(socket.create_connection(("127.0.0.1", server.port)))
        wait_until(lambda: "cannot check the broker connection" in server.log(), "the broker check failing", 20)
        probe.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, body = read_raw_response(reader)
        assert status == 503 and "descriptor" in json.loads(body)["error"], body
        os.kill(broker, signal.SIGKILL)
        wait_until(lambda: any(t.startswith("shmserve broker") and p != broker for p, t in server.titles().items()),
                   "a new broker", 30)
        started = time.monotonic()
        probe.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: x\r\n\r\n")
        probe.settimeout(10)
        # Promptly: 503 (the broker it knew is gone, and no descriptor for a new connection) or, if
        # a descriptor came free, the new broker's "not ready yet" (400).
        assert read_raw_response(reader)[0] in (503, 400)
        assert time.monotonic() - started < 5
    finally:
        for sock in socks:
            sock.close()
    server.wait_ready(30)
    _identity(server.port, values)
    probe.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
    assert read_raw_response(reader)[0] == 200
    probe.close()


# -- chunked framing and pipelining ------------------------------------------------------------------


def _chunked_identity(trailers: bytes) -> bytes:
    """An identity_all request whose body is chunked and ends with ``trailers`` (header fields
    after the last chunk): the JSON header and binary data, Inference-Header-Content-Length only
    there, if at all."""
    _, body = _identity_request(np.arange(4, dtype=np.float32).reshape(1, 4))
    return (b"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n" % (len(body), body) + trailers + b"\r\n")


def test_trailers_are_not_header_fields_and_are_bounded(edge):
    """A chunked body's trailer fields are dropped (RFC 9110 6.5.1), never taken as header
    fields the head did not carry: Inference-Header-Content-Length there is not honoured, as in
    Triton (the body is read as JSON). Trailers that never end are refused like a head too
    large, and the frontend keeps none of them."""
    _, body = _identity_request(np.arange(4, dtype=np.float32).reshape(1, 4))
    head_length = len(body) - 16
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(_chunked_identity(b"Inference-Header-Content-Length: %d\r\n" % head_length))
        status, _, out = read_raw_response(sock.makefile("rb"))
    assert status == 400, out[:300]

    frontend = _frontend(edge)
    before = _rss(frontend)
    with socket.create_connection(("127.0.0.1", edge.port)) as sock:
        sock.sendall(_chunked_identity(b"")[:-2])  # the last chunk, and then trailers without end
        out, _ = _sent_until_closed(sock, (b"X-T: " + b"a" * 1000 + b"\r\n") * 64)
    assert "--http-max-header-bytes" in _error(out, 431)
    assert _rss(frontend) < before + (64 << 20)
    assert "Fatal error" not in edge.log()  # (refused where the read was parsed, not from the transport)
    _identity(edge.port, np.arange(8, dtype=np.float32).reshape(1, 8))


def test_chunked_requests_pipelined_in_one_read_are_all_answered(edge):
    """Two chunked requests, each larger than --http-max-header-bytes, sent in one write: the
    framing bound counts neither the body of one nor the head of the next."""
    values = np.arange(15000, dtype=np.float32).reshape(1, 15000)
    _, body = _identity_request(values)
    request = (b"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               b"Inference-Header-Content-Length: %d\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
               % (len(body) - values.nbytes, len(body), body))
    assert len(body) > MAX_HEAD * 3
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(request * 2)
        answers = sock.makefile("rb")
        for _ in range(2):
            status, headers, out = read_raw_response(answers)
            assert status == 200, out[:300]
            n = int(headers["inference-header-content-length"])
            np.testing.assert_array_equal(np.frombuffer(out[n:], dtype=np.float32), values.ravel())


def test_a_client_pipelining_without_reading_has_a_bounded_number_queued(edge):
    """HTTP/1.1 pipelining: requests behind one still being answered are queued and answered in
    order, up to 128; the rest of the input is dropped and the connection ends after the queued
    answers (a client retries what a closed connection did not answer). Before, each answer let
    another read's worth of requests in (a few thousand each), for as long as the client sent."""
    from shmserve.server.frontend.protocol import MAX_PIPELINED

    request = b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", edge.port)) as sock:
        sock.sendall(request * (MAX_PIPELINED + 100))
        out, _ = _until_closed(sock, SLACK_S + 20)
    assert out.count(b"HTTP/1.1 200 OK") == MAX_PIPELINED + 1, out.count(b"HTTP/1.1 200 OK")
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:  # a few pipelined: all answered
        sock.sendall(request * 8 + b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        out, _ = _until_closed(sock, SLACK_S + 20)
    assert out.count(b"HTTP/1.1 200 OK") == 9


def test_an_unknown_transfer_coding_is_501_and_a_malformed_request_a_json_400(edge):
    """``Transfer-Encoding: gzip, chunked`` would be read as plain chunked, a body other than the
    client's: refused with 501 naming it. A request the parser cannot read gets the JSON error
    every other refusal has, not uvicorn's plain text. The frontend serves on."""
    _, body = _identity_request(np.arange(4, dtype=np.float32).reshape(1, 4))
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
                     + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        out, _ = _until_closed(sock, SLACK_S + 10)
    assert "the transfer coding 'gzip, chunked' is not implemented" in _error(out, 501)
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/\x01live HTTP/1.1\r\nHost: x\r\n\r\n")
        out, _ = _until_closed(sock, SLACK_S + 10)
    assert _error(out, 400) == "Invalid HTTP request received."
    _identity(edge.port, np.arange(8, dtype=np.float32).reshape(1, 8))


def test_bytes_the_parser_refuses_after_a_request_leave_its_answer_and_end_the_connection(edge):
    """Bytes that are no request behind a good one in the same read (a bad pipelined request, a
    body longer than its ``Content-Length``): the good request's answer goes out, then the
    connection ends, as Triton answers and closes. No 400 can go between answers; with no answer
    due, the 400 is the answer."""
    values = np.arange(6, dtype=np.float32).reshape(1, 6)
    http, body = _identity_request(values)
    for junk in (b"BLAH\r\n\r\n", b"\x01\x02"):
        with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
            sock.sendall(http + body + junk)
            out, _ = _until_closed(sock, SLACK_S + 10)
        head, _, answer = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 "), out[:300]
        assert b"connection: close" in head.lower() and out.count(b"HTTP/1.1") == 1, out[:300]
        n = int(dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:])[b"inference-header-content-length"])
        np.testing.assert_array_equal(np.frombuffer(answer[n:], dtype=np.float32), values.ravel())
    # one byte past the declared length: the client sees why its (cut) JSON was refused
    doc = b'{"inputs": [{"name": "IN_FP32", "datatype": "FP32", "shape": [1, 1], "data": [1]}]}'
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(b"POST /v2/models/identity_all/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(doc) - 1, doc))
        out, _ = _until_closed(sock, SLACK_S + 10)
    assert _error(out, 400).startswith("failed to parse the request JSON buffer"), out[:300]
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\nxx\r\n\r\n")
        out, _ = _until_closed(sock, SLACK_S + 10)
    assert out.startswith(b"HTTP/1.1 200 ") and out.count(b"HTTP/1.1") == 1, out[:300]
    _identity(edge.port, np.arange(8, dtype=np.float32).reshape(1, 8))


def test_http10_keeps_its_connection_only_when_it_asks(edge):
    """An HTTP/1.0 client asking for ``Connection: keep-alive`` (``ab -k``) keeps the connection,
    told so by the answer, as Triton keeps it; one that does not ask is closed after its answer."""
    values = np.arange(4, dtype=np.float32).reshape(1, 4)
    http, body = _identity_request(values)
    http10 = http.replace(b"HTTP/1.1", b"HTTP/1.0")
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        reader = sock.makefile("rb")
        for _ in range(3):
            sock.sendall(http10.replace(b"Host: x\r\n", b"Host: x\r\nConnection: keep-alive\r\n") + body)
            status, headers, out = read_raw_response(reader)
            assert status == 200 and headers.get("connection") == "keep-alive", headers
            n = int(headers["inference-header-content-length"])
            np.testing.assert_array_equal(np.frombuffer(out[n:], dtype=np.float32), values.ravel())
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(http10 + body)
        out, _ = _until_closed(sock, SLACK_S + 10)
    assert out.startswith(b"HTTP/1.1 200 ") and b"connection: close" in out.lower(), out[:300]
    # Two pipelined, then bytes the parser refuses: both answered, the last ends the connection
    # (it said keep-alive when asked, but the input ended behind it).
    keep = http10.replace(b"Host: x\r\n", b"Host: x\r\nConnection: keep-alive\r\n") + body
    with socket.create_connection(("127.0.0.1", edge.port), timeout=30) as sock:
        sock.sendall(keep + keep + b"BLAH\r\n\r\n")
        out, _ = _until_closed(sock, SLACK_S + 10)
    assert out.count(b"HTTP/1.1 200 ") == 2, out[:600]
    second = out[out.rindex(b"HTTP/1.1 200 "):].split(b"\r\n\r\n")[0].lower()
    assert b"connection: close" in second and b"keep-alive" not in second, second


# -- answers left unread ---------------------------------------------------------------------------
SEND_S = 1.5
ANSWER = 4 << 20  # FP32 values: 16 MiB each way, four times what the kernel buffers for a connection


def _private_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("RssAnon:"))


def _unread_answers(server: Server, request: bytes, count: int, answer_bytes: int) -> None:
    """``count`` connections send ``request`` and read nothing: each is cut by the frontend (what
    they read afterwards is less than the answer, then the end)."""
    stalled = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(request)
        stalled.append(sock)
    try:
        time.sleep(2 * SEND_S + SLACK_S)  # read nothing until the frontend should have cut them all
        for sock in stalled:
            got, _ = _until_closed(sock, SLACK_S + 10)
            assert len(got) < answer_bytes, "a connection nobody read got its whole answer"
    finally:
        for sock in stalled:
            sock.close()


def test_an_answer_nobody_reads_is_cut_and_its_memory_freed_while_a_slow_reader_gets_its_own(server_factory):
    """An answer its client read none of stayed in the frontend's memory for as long as the
    connection lived (16 clients of 100 MiB answers held 630 MiB). Once its client has read none
    of it for --http-send-timeout-secs, the connection is cut and the memory goes back (to be
    used again: a second round of such clients takes no more); a client that reads slowly but
    steadily, for longer than that in all, gets its whole answer."""
    server = server_factory.start([TEST_MODELS], [
        "--model-control-mode", "explicit", "--load-model", "identity_all",
        "--http-send-timeout-secs", str(SEND_S), "--http-max-input-size", str(64 << 20)])
    pid = _frontend(server)
    values = np.arange(ANSWER, dtype=np.float32).reshape(1, ANSWER)
    _identity(server.port, values)
    http, body = _identity_request(values)
    _unread_answers(server, http + body, 4, values.nbytes)
    assert "cut a connection whose client read none of its answer for 1.5 s" in server.log()
    after_one_round = _private_bytes(pid)
    _unread_answers(server, http + body, 4, values.nbytes)
    grown = (_private_bytes(pid) - after_one_round) >> 20
    assert grown <= 16, f"the frontend took {grown} MiB more for a second round of answers nobody read"

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        # One connection: what each answer leaves unsent is not compared with an earlier answer's
        # (the third, twice as large, found more unsent than the second had left).
        larger = np.arange(2 * ANSWER, dtype=np.float32).reshape(1, 2 * ANSWER)
        for k, v in enumerate((values, values, larger)):
            began = time.monotonic()
            sock.sendall(b"".join(_identity_request(v)))
            if k == 2:
                time.sleep(0.6 * SEND_S)  # (reading none of an answer for less than the timeout is allowed)
            _read_answer_slowly(sock, v.ravel() if k != 1 else None)
            assert time.monotonic() - began > SEND_S


def _read_answer_slowly(sock: socket.socket, expected: np.ndarray | None) -> None:
    """One answer read 1 MiB at a time every 0.25 s (the last piece at full speed when
    ``expected`` is None, so that the next answer follows at once)."""
    got, whole = b"", None
    while whole is None or len(got) < whole:
        piece = sock.recv(min(1 << 20, whole - len(got)) if whole is not None else 1 << 20)
        assert piece, f"the connection ended after {len(got)} bytes of its answer"
        got += piece
        if whole is None and b"\r\n\r\n" in got:
            head = got[:got.index(b"\r\n\r\n")]
            length = next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length"))
            whole = len(head) + 4 + int(length)
        if expected is not None or whole is None or whole - len(got) > (4 << 20):
            time.sleep(0.25)
    head, _, rest = got.partition(b"\r\n\r\n")
    n = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                 if line.lower().startswith(b"inference-header-content-length")))
    if expected is not None:
        np.testing.assert_array_equal(np.frombuffer(rest[n:], dtype=np.float32), expected)
