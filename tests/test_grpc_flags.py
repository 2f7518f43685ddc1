"""Triton's gRPC server flags against real servers and tritonclient.grpc: TLS and mutual TLS,
restricted protocols, response compression, keepalive (ping strikes), and --allow-http=false.

The certificates are made per run with the openssl command (a CA, a server certificate for
localhost and 127.0.0.1, a client certificate).
"""
from __future__ import annotations

import queue
import socket
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from conftest import PRODUCT_MODELS, TEST_MODELS, TESTS, wait_until
from gates import Gate
from shmserve import Client

CANCEL_MODELS = TESTS / "models" / "cancel"
ADMIN = {"triton-grpc-protocol-admin-key": "s3cret"}
INFER = {"triton-grpc-protocol-infer-key": "k"}
# A client that pings as often as grpc lets it (once a second) while a call is open.
PINGING = grpcclient.KeepAliveOptions(keepalive_time_ms=10, keepalive_permit_without_calls=False,
                                      http2_max_pings_without_data=0)


# -- certificates -------------------------------------------------------------------------------

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _signed(folder: Path, name: str, subject: str, extensions: str) -> None:
    """``name``.key and ``name``.crt, signed by the CA in ``folder``."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", subject, cwd=folder)
    (folder / f"{name}.ext").write_text(extensions)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-out", f"{name}.crt", "-extfile", f"{name}.ext", cwd=folder)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=shmserve test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign", cwd=folder)
    _signed(folder, "server", "/CN=localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n"
                                               "extendedKeyUsage=serverAuth\n")
    _signed(folder, "client", "/CN=shmserve test client", "extendedKeyUsage=clientAuth\n")
    return folder


def _server_tls_args(certs: Path) -> list[str]:
    return ["--grpc-server-cert", str(certs / "server.crt"), "--grpc-server-key", str(certs / "server.key")]


def _refused(url: str, **tls) -> InferenceServerException:
    with grpcclient.InferenceServerClient(url, **tls) as c, pytest.raises(InferenceServerException) as e:
        c.is_server_live(client_timeout=30)
    return e.value


def test_tls(server_factory, certs, tmp_path):
    s = server_factory.start([tmp_path], ["--grpc-use-ssl", *_server_tls_args(certs)])
    assert f"serving gRPC on 127.0.0.1:{s.grpc_port} over TLS" in s.log()
    with grpcclient.InferenceServerClient(s.grpc_url, ssl=True, root_certificates=str(certs / "ca.crt")) as c:
        assert c.is_server_live() and c.get_server_metadata().name == s.id
    assert _refused(s.grpc_url).status() == "StatusCode.UNAVAILABLE"  # plaintext
    # a client that does not trust the server's CA
    assert _refused(s.grpc_url, ssl=True, root_certificates=str(certs / "client.crt")).status() == \
        "StatusCode.UNAVAILABLE"


def test_mutual_tls(server_factory, certs, tmp_path):
    s = server_factory.start([tmp_path], ["--grpc-use-ssl-mutual", *_server_tls_args(certs),
                                          "--grpc-root-cert", str(certs / "ca.crt")])
    trusted = {"ssl": True, "root_certificates": str(certs / "ca.crt")}
    with grpcclient.InferenceServerClient(s.grpc_url, **trusted, private_key=str(certs / "client.key"),
                                          certificate_chain=str(certs / "client.crt")) as c:
        assert c.is_server_live() and c.get_server_metadata().name == s.id
    assert _refused(s.grpc_url, **trusted).status() == "StatusCode.UNAVAILABLE"  # no client certificate
    assert _refused(s.grpc_url).status() == "StatusCode.UNAVAILABLE"  # plaintext
    # a client certificate the root certificate did not sign: the server's own, as a client's
    assert _refused(s.grpc_url, **trusted, private_key=str(certs / "ca.key"),
                    certificate_chain=str(certs / "ca.crt")).status() == "StatusCode.UNAVAILABLE"


# -- restricted protocols, compression, keepalive -------------------------------------------------

@pytest.fixture(scope="module")
def flagged(module_factory):
    """A server with restricted protocols, high response compression, and pings allowed every
    100 ms while no data flows (Triton's default: every 5 minutes)."""
    return module_factory.start([TEST_MODELS, CANCEL_MODELS], [
        "--model-control-mode=explicit", "--load-model", "identity_all", "--load-model", "held",
        "--grpc-restricted-protocol=health,model-repository:admin-key=s3cret",
        "--grpc-restricted-protocol=inference:Infer-Key=k",
        "--grpc-infer-response-compression-level=HIGH",
        "--grpc-http2-min-recv-ping-interval-without-data=100"])


@pytest.fixture(scope="module")
def grpc_only(module_factory):
    """A server with --allow-http=false and Triton's keepalive defaults; ready once gRPC says so."""
    return module_factory.start([CANCEL_MODELS], ["--allow-http=false", "--model-control-mode=explicit",
                                                  "--load-model", "held"], wait=False).wait_grpc_ready()


def _restricted(call, header: str) -> None:
    with pytest.raises(InferenceServerException) as e:
        call()
    assert e.value.status() == "StatusCode.UNAVAILABLE"
    assert e.value.message() == f"This protocol is restricted, expecting header '{header}'"


def _identity_input(values: np.ndarray) -> list:
    inp = grpcclient.InferInput("IN_FP32", list(values.shape), "FP32")
    inp.set_data_from_numpy(values)
    return [inp]


def test_restricted_protocols_need_their_metadata(flagged):
    admin, infer = "triton-grpc-protocol-admin-key", "triton-grpc-protocol-infer-key"
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    with grpcclient.InferenceServerClient(flagged.grpc_url) as c:
        _restricted(c.is_server_live, admin)
        _restricted(lambda: c.is_model_ready("identity_all", headers={**INFER, admin: "wrong"}), admin)
        _restricted(c.get_model_repository_index, admin)
        _restricted(lambda: c.infer("identity_all", _identity_input(x), headers=ADMIN), infer)
        assert c.is_server_live(headers=ADMIN) and c.is_model_ready("identity_all", headers=ADMIN)
        assert "held" in [m.name for m in c.get_model_repository_index(headers=ADMIN).models]
        result = c.infer("identity_all", _identity_input(x), headers=INFER)
        np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), x)
        # groups not restricted answer without any metadata
        assert c.get_server_metadata().name == flagged.id
        assert c.get_model_config("identity_all").config.name == "identity_all"
        assert c.get_inference_statistics("identity_all").model_stats[0].name == "identity_all"
    with grpc.insecure_channel(flagged.grpc_url) as channel:  # grpc.health.v1 is in the health group
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert e.value.details() == f"This protocol is restricted, expecting header '{admin}'"
        answer = health.Check(health_pb2.HealthCheckRequest(service=""), metadata=tuple(ADMIN.items()), timeout=30)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING


def test_a_restricted_stream_ends_at_once_without_the_metadata(flagged):
    x = np.ones((1, 4), dtype=np.float32)
    for headers, expect_error in ((None, True), (INFER, False)):
        got: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(flagged.grpc_url) as c:
            c.start_stream(callback=lambda result, error: got.put(error if error is not None else result),
                           headers=headers)
            try:
                c.async_stream_infer("identity_all", _identity_input(x))
            except InferenceServerException:
                # The server may end a refused stream before the request is even sent: the
                # client then refuses to send, and the callback holds the stream's status.
                assert expect_error
            answer = got.get(timeout=60)
            c.stop_stream()
        if expect_error:
            assert isinstance(answer, InferenceServerException) and answer.status() == "StatusCode.UNAVAILABLE"
            assert answer.message() == "This protocol is restricted, expecting header 'triton-grpc-protocol-infer-key'"
        else:
            np.testing.assert_array_equal(answer.as_numpy("OUT_FP32"), x)


class ByteCounter:
    """A TCP relay to ``port`` that counts the bytes the server sends back (what crossed the wire)."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target = port
        self.received = 0
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server = socket.create_connection(("127.0.0.1", self.target))
        self.sockets += [client, server]
        threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
        self._pump(server, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if count:
                    self.received += len(data)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        for s in (self.listener, *self.sockets):
            s.close()


def test_responses_are_compressed_on_the_wire(flagged):
    x = np.zeros((1, 1 << 18), dtype=np.float32)  # 1 MiB that compresses to almost nothing
    relay = ByteCounter(flagged.grpc_port)
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{relay.port}") as c:
            result = c.infer("identity_all", _identity_input(x), headers=INFER)
            np.testing.assert_array_equal(result.as_numpy("OUT_FP32"), x)
        assert relay.received < x.nbytes // 16, relay.received
    finally:
        relay.close()


def _held(url: str, gate: Gate, answers: queue.Queue) -> None:
    """One ``held`` call from a client that pings once a second; its answer or error goes to ``answers``."""
    inp = grpcclient.InferInput("X", [1], "INT32")
    inp.set_data_from_numpy(np.array([5], np.int32))
    try:
        with grpcclient.InferenceServerClient(url, keepalive_options=PINGING) as c:
            answers.put(c.infer("held", [inp], headers=INFER, parameters={"gate": gate.param}, client_timeout=120))
    except InferenceServerException as e:
        answers.put(e)


def test_ping_interval_flag_reaches_the_server(flagged, grpc_only, tmp_path):
    """A client pinging once a second during a long call: a server with Triton's defaults counts
    each ping a strike and closes the connection after the third (GOAWAY too_many_pings); the
    server with a 100 ms interval keeps the call, held open longer than that, and answers it."""
    default_gate, flagged_gate = Gate(tmp_path / "default"), Gate(tmp_path / "flagged")
    default_answers: queue.Queue = queue.Queue()
    flagged_answers: queue.Queue = queue.Queue()
    threads = [threading.Thread(target=_held, args=(grpc_only.grpc_url, default_gate, default_answers)),
               threading.Thread(target=_held, args=(flagged.grpc_url, flagged_gate, flagged_answers))]
    for t in threads:
        t.start()
    try:
        cut = default_answers.get(timeout=60)
        assert isinstance(cut, InferenceServerException) and cut.status() == "StatusCode.UNAVAILABLE", cut
        assert "too many pings" in cut.message().lower()
        time.sleep(1.5)  # at least one more ping on the call that goes on
        assert flagged_answers.empty()
    finally:
        default_gate.open()
        flagged_gate.open()
        for t in threads:
            t.join(120)
    assert flagged_answers.get_nowait().as_numpy("Y").tolist() == [5]


# -- --allow-http=false ---------------------------------------------------------------------------

def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return True
    except OSError:
        return False


def test_allow_http_false_serves_grpc_only(grpc_only, tmp_path):
    gate = Gate(tmp_path / "gate")
    gate.open()
    with grpcclient.InferenceServerClient(grpc_only.grpc_url) as c:
        inp = grpcclient.InferInput("X", [2], "INT32")
        inp.set_data_from_numpy(np.array([3, 4], np.int32))
        assert c.infer("held", [inp], parameters={"gate": gate.param}).as_numpy("Y").tolist() == [3, 4]
    assert not _listening(grpc_only.port)
    titles = list(grpc_only.titles().values())
    assert not any(t.startswith("shmserve frontend ") for t in titles)
    assert f"shmserve grpc {grpc_only.id}" in titles
    assert "serving HTTP" not in grpc_only.log()


def test_no_network_frontend_serves_local_clients(server_factory):
    """Both protocols off, as Triton allows: the broker serves local programs (and metrics)."""
    s = server_factory.start([PRODUCT_MODELS], ["--allow-http=false", "--allow-grpc=false",
                                                "--model-control-mode=explicit", "--load-model", "add_sub"], wait=False)
    s.wait_until(lambda: "serving local clients only" in s.log(), "started")
    a = np.arange(16, dtype=np.int32)
    with Client(s.id) as client:
        wait_until(lambda: client.is_model_ready("add_sub"), "add_sub ready")
        result = client.infer("add_sub", {"INPUT0": a, "INPUT1": a})
        np.testing.assert_array_equal(result["OUTPUT0"], a + a)
    assert not _listening(s.port) and not _listening(s.grpc_port)
    assert not any(t.startswith(("shmserve frontend ", "shmserve grpc ")) for t in s.titles().values())
