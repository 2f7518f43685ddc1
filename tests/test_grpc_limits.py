"""The gRPC frontend's edge against real servers and tritonclient.grpc: a message over
--grpc-max-input-size (by default the frontend arena) is refused by grpc before it is read; one
read and then refused gives its memory back at once; a message that is not a protobuf of the
RPC's type is INVALID_ARGUMENT, on a stream too, and the server serves on.

Memory is the gRPC process's private resident memory (RssAnon: the arena's pages are shared
memory, which a served request touches and keeps mapped by design)."""
from __future__ import annotations

import queue
import re
import threading
import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from conftest import TEST_MODELS, DEADLINE_S, edge_refusals, wait_until

MIB = 1 << 20
ARENA_MB = 32  # the default message limit follows it: --grpc-max-input-size is 32 MiB
LARGE = 96 * MIB  # three times the arena: refused, and big enough that keeping it shows
MEMORY_BOUND = 100 * MIB  # what the gRPC process may keep above where it started
METHOD = "/inference.GRPCInferenceService/"


def _server(factory, *extra: str):
    return factory.start([TEST_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity_all",
                                         "--frontend-arena-mb", str(ARENA_MB), *extra])


def _grpc_pid(server) -> int:
    return next(pid for pid, title in server.titles().items() if title.startswith("shmserve grpc "))


def _private_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def _identity_inputs(nbytes: int) -> list:
    inp = grpcclient.InferInput("IN_UINT8", [1, nbytes], "UINT8")
    inp.set_data_from_numpy(np.full((1, nbytes), 7, np.uint8))
    return [inp]


def _small_round_trip(client: grpcclient.InferenceServerClient, k: int) -> None:
    data = np.arange(k, k + 1000, dtype=np.int64).astype(np.uint8).reshape(1, 1000)
    inp = grpcclient.InferInput("IN_UINT8", [1, 1000], "UINT8")
    inp.set_data_from_numpy(data)
    out = client.infer("identity_all", [inp], outputs=[grpcclient.InferRequestedOutput("OUT_UINT8")])
    np.testing.assert_array_equal(out.as_numpy("OUT_UINT8"), data)


class SmallTraffic:
    """Small requests on their own connection, one after another, while the large ones are sent:
    each must be answered with its own data."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.stop = threading.Event()
        self.done = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                _small_round_trip(self.client, self.done)
                self.done += 1
            except BaseException as e:  # noqa: BLE001 - reported by finish()
                self.errors.append(e)
                return
            time.sleep(0.02)

    def __enter__(self) -> "SmallTraffic":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(DEADLINE_S)
        self.client.close()
        assert not self.errors, self.errors
        assert self.done > 0, "no small request was answered meanwhile"


def _large_calls(url: str, sequential: int, concurrent: int, nbytes: int = LARGE) -> list[InferenceServerException]:
    """The errors of ``sequential`` large calls one after another, then ``concurrent`` at once,
    each on its own connection (every one must fail)."""
    errors: list[InferenceServerException] = []

    def call() -> None:
        with grpcclient.InferenceServerClient(url) as client:
            with pytest.raises(InferenceServerException) as info:
                client.infer("identity_all", _identity_inputs(nbytes))
            errors.append(info.value)

    for _ in range(sequential):
        call()
    threads = [threading.Thread(target=call) for _ in range(concurrent)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert len(errors) == sequential + concurrent, errors
    return errors


def _assert_memory_returns(pid: int, start: int) -> None:
    """The private memory comes back within the bound of ``start`` (the frontend trims its heap
    on its half-second tick)."""
    deadline = time.monotonic() + 10
    while (now := _private_bytes(pid)) > start + MEMORY_BOUND and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now <= start + MEMORY_BOUND, f"the gRPC frontend keeps {(now - start) / MIB:.0f} MiB more than at start"


def test_a_message_over_the_limit_is_refused_before_it_is_read(server_factory):
    """Three large messages one after another and three at once: RESOURCE_EXHAUSTED with grpc's
    (and so Triton's) text, from the length alone; the frontend's memory stays where it was and
    a client sending small requests meanwhile is served."""
    server = _server(server_factory)
    pid = _grpc_pid(server)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _small_round_trip(client, 0)
    start = _private_bytes(pid)
    with SmallTraffic(server.grpc_url):
        errors = _large_calls(server.grpc_url, sequential=3, concurrent=3)
    for e in errors:
        assert e.status() == "StatusCode.RESOURCE_EXHAUSTED", e
        assert re.search(rf"Received message larger than max \(\d+ vs\. {ARENA_MB * MIB}\)", e.message()), e
    _assert_memory_returns(pid, start)


def test_a_request_just_under_the_limit_is_served(server_factory):
    """The default limit lets through what the arena can take."""
    server = _server(server_factory)
    n = ARENA_MB * MIB - (128 << 10)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        out = client.infer("identity_all", _identity_inputs(n), outputs=[grpcclient.InferRequestedOutput("OUT_UINT8")])
    assert out.as_numpy("OUT_UINT8").shape == (1, n)


def test_messages_read_and_then_refused_give_their_memory_back(server_factory):
    """With the limit raised over the arena, large requests are read whole and refused by the
    frontend (their tensor data cannot fit the arena): each one's memory goes back at once,
    unary or on a stream, while small requests go on; the stream then serves a request."""
    server = _server(server_factory, "--grpc-max-input-size", str(4 * LARGE))
    pid = _grpc_pid(server)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _small_round_trip(client, 0)
    start = _private_bytes(pid)
    with SmallTraffic(server.grpc_url):
        errors = _large_calls(server.grpc_url, sequential=2, concurrent=3)
        got: queue.Queue = queue.Queue()
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            client.start_stream(callback=lambda result, error: got.put((result, error)))
            client.async_stream_infer("identity_all", _identity_inputs(LARGE))
            result, error = got.get(timeout=DEADLINE_S)
            assert result is None and "exceed the frontend's shared-memory arena" in error.message(), error
            _assert_memory_returns(pid, start)  # the stream is still open: it keeps nothing of it
            small = _identity_inputs(1000)
            client.async_stream_infer("identity_all", small, outputs=[grpcclient.InferRequestedOutput("OUT_UINT8")])
            result, error = got.get(timeout=DEADLINE_S)
            assert error is None and result.as_numpy("OUT_UINT8").shape == (1, 1000), error
            client.stop_stream()
    for e in errors:
        assert e.status() == "StatusCode.INVALID_ARGUMENT", e
        assert f"the request's {LARGE} bytes of tensor data exceed the frontend's shared-memory arena" in e.message()
    _assert_memory_returns(pid, start)


GARBAGE = b"\xff\xff\xff\x07not a protobuf"


def test_a_malformed_message_is_invalid_argument(server_factory):
    """Unary calls, and a stream: the bad message gets INVALID_ARGUMENT's text as its error and
    the stream goes on; with triton_grpc_error the stream ends with INVALID_ARGUMENT. No
    traceback is logged for it."""
    server = _server(server_factory)
    with grpc.insecure_channel(server.grpc_url) as channel:
        for name in ("ModelInfer", "ServerMetadata", "RepositoryModelLoad"):
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(METHOD + name)(GARBAGE, timeout=DEADLINE_S)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
            assert "is not a valid inference." in info.value.details()

        stream = channel.stream_stream(METHOD + "ModelStreamInfer", request_serializer=None,
                                       response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        good = service_pb2.ModelInferRequest(model_name="identity_all", raw_input_contents=[b"\x01\x02"])
        good.inputs.add(name="IN_UINT8", datatype="UINT8", shape=[1, 2])
        answers = list(stream(iter([GARBAGE, good.SerializeToString()]), timeout=DEADLINE_S))
        assert answers[0].error_message == "the request is not a valid inference.ModelInferRequest message"
        assert answers[1].error_message == "" and answers[1].infer_response.raw_output_contents == [b"\x01\x02"]

        with pytest.raises(grpc.RpcError) as info:
            list(stream(iter([GARBAGE, good.SerializeToString()]), timeout=DEADLINE_S,
                        metadata=[("triton_grpc_error", "true")]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _small_round_trip(client, 1)
    assert "DecodeError" not in server.log()


def test_a_compressed_message_is_limited_by_its_inflated_size(server_factory):
    """A gzip message a thousandth of the limit that inflates past it is refused as it inflates."""
    server = _server(server_factory)
    pid = _grpc_pid(server)
    start = _private_bytes(pid)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        with pytest.raises(InferenceServerException) as info:
            client.infer("identity_all", _identity_inputs(LARGE), compression_algorithm="gzip")
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED", info.value
        _small_round_trip(client, 2)
    _assert_memory_returns(pid, start)


def _h2_connection(server) -> "socket.socket":
    """A raw connection to the gRPC port that sends HTTP/2's preface and an empty SETTINGS frame,
    then nothing: what a client that opens connections and holds them idle sends."""
    import socket

    host, port = server.grpc_url.rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=DEADLINE_S)
    s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000"))
    return s


def _read_until_closed(s, seconds: float) -> bytes:
    """What the server sends on ``s`` until it closes it (or ``seconds`` pass: then b"OPEN" is appended)."""
    import socket

    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            data = s.recv(65536)
        except socket.timeout:
            break
        except ConnectionResetError:
            return got
        if not data:
            return got
        got += data
    return got + b"OPEN"


def test_connections_are_bounded_and_idle_ones_closed(server_factory):
    """The gRPC frontend held every connection it was given, idle or not, until it ran out of
    descriptors (and then could neither accept nor reach its broker). --grpc-max-connections
    bounds them (by default below the descriptor limit, as HTTP's): one past it is closed as it
    comes, the others served; --grpc-max-connection-idle closes a connection with no call for that
    long (GOAWAY 'connection idle'), after which clients connect and are served again."""
    server = _server(server_factory, "--grpc-max-connections", "3", "--grpc-max-connection-idle", "1500")
    assert "(at most 3 connections)" in server.log()
    held = [_h2_connection(server) for _ in range(3)]
    try:
        time.sleep(0.3)  # (accepted in order: these are the three it holds)
        extra = _h2_connection(server)
        assert not _read_until_closed(extra, DEADLINE_S).endswith(b"OPEN"), "a fourth connection was held"
        extra.close()
        for s in held:  # each idle one is told why it goes, and closed
            said = _read_until_closed(s, DEADLINE_S)
            assert b"connection idle" in said and not said.endswith(b"OPEN"), said
    finally:
        for s in held:
            s.close()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _small_round_trip(client, 1)


def test_by_default_connections_and_receive_slots_follow_the_host(server_factory):
    """Connections are bounded below the descriptor limit; receive slots by the host's memory."""
    from shmserve.descriptor_limit import connection_bound, raise_descriptor_limit

    from shmserve.host_limits import usable_memory

    server = _server(server_factory)
    assert f"(at most {connection_bound(raise_descriptor_limit())} connections)" in server.log()
    # and as many receive slots as a quarter of the memory holds of the largest message (32 MiB)
    slots = max(1 << 30, usable_memory() // 4) // (ARENA_MB * MIB)
    assert f"receiving at most {slots} ModelInfer messages at once" in server.log()


def _identity_message(nbytes: int) -> bytes:
    """A serialized ModelInferRequest of identity_all with ``nbytes`` of input (sent as it is, so
    that many threads send at once: tritonclient serializes each under the GIL)."""
    request = service_pb2.ModelInferRequest(model_name="identity_all", raw_input_contents=[b"\x07" * nbytes])
    request.inputs.add(name="IN_UINT8", datatype="UINT8", shape=[1, nbytes])
    return request.SerializeToString()


class PeakMemory:
    """The most private memory ``pid`` held while the block ran, sampled every 5 ms."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.stop = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, _private_bytes(self.pid))
            time.sleep(0.005)

    def __enter__(self) -> "PeakMemory":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(DEADLINE_S)


CALLS = 24


def test_large_messages_sent_at_once_are_received_a_few_at_a_time(server_factory):
    """grpc read a unary call's message whole before its handler ran: 24 messages of 30 MiB sent at
    once were all in the frontend's memory together (over 1 GiB with grpc's copies) before the
    arena refused most of them. With --grpc-receive-memory-mb 64 (two 32 MiB messages) two are
    received at a time, the others left in their clients: each call is answered (served, or
    UNAVAILABLE for want of room in the arena), the frontend's peak stays far below the sum
    (what it holds is the messages in receipt and in flight, and the freed ones' memory until the
    frontend's half-second trim), and small requests go on."""
    server = _server(server_factory, "--grpc-receive-memory-mb", "64")
    assert "receiving at most 2 ModelInfer messages at once" in server.log()
    pid = _grpc_pid(server)
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _small_round_trip(client, 0)
    start = _private_bytes(pid)
    message = _identity_message(30 * MIB)
    barrier = threading.Barrier(CALLS)
    codes: list[grpc.StatusCode] = []

    def call() -> None:
        with grpc.insecure_channel(server.grpc_url, options=[("grpc.max_receive_message_length", -1)]) as channel:
            infer = channel.unary_unary(METHOD + "ModelInfer")
            barrier.wait()
            try:
                infer(message, timeout=DEADLINE_S)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
                assert e.code() == grpc.StatusCode.UNAVAILABLE and "overloaded" in e.details(), e

    with SmallTraffic(server.grpc_url), PeakMemory(pid) as memory:
        threads = [threading.Thread(target=call) for _ in range(CALLS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
    assert len(codes) == CALLS and grpc.StatusCode.OK in codes, codes
    grown = (memory.peak - start) / MIB
    assert grown < 400, f"the gRPC frontend held {grown:.0f} MiB at once for {CALLS} messages of 30 MiB"
    _assert_memory_returns(pid, start)


def test_a_message_that_does_not_arrive_in_time_ends_its_call(server_factory):
    """A client that opens a ModelInfer call and sends no message held its call open for good; with
    one receive slot it would keep every other ModelInfer waiting. Past --grpc-receive-timeout-secs
    its call ends with DEADLINE_EXCEEDED saying so, and a call that waited behind it is served."""
    server = _server(server_factory, "--grpc-receive-memory-mb", "32", "--grpc-receive-timeout-secs", "1")
    assert "receiving at most 1 ModelInfer messages at once" in server.log()
    stalled: list[grpc.RpcError] = []
    opened = threading.Event()

    def never_sends() -> None:
        def nothing():
            opened.set()
            time.sleep(DEADLINE_S)
            yield b""
        with grpc.insecure_channel(server.grpc_url) as channel:
            try:
                channel.stream_unary(METHOD + "ModelInfer")(nothing(), timeout=DEADLINE_S)
            except grpc.RpcError as e:
                stalled.append(e)

    slow = threading.Thread(target=never_sends, daemon=True)
    slow.start()
    opened.wait(DEADLINE_S)
    time.sleep(0.2)  # (its call holds the one slot now)
    began = time.monotonic()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _small_round_trip(client, 3)
    assert time.monotonic() - began < DEADLINE_S
    slow.join(DEADLINE_S)
    assert stalled and stalled[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED, stalled
    assert stalled[0].details() == "the request message did not arrive within 1 s (--grpc-receive-timeout-secs)"
    assert "Traceback" not in server.log() and "Unexpected" not in server.log()
    # counted for the operator, as the frontend reports it on its tick
    wait_until(lambda: edge_refusals(server).get(("grpc", "receive-timeout")) == 1, "the late call counted")


def test_calls_cut_while_their_message_arrives_give_their_slot_back(server_factory):
    """With one receive slot, calls whose clients give up while their large message is on its way
    (deadlines of 20 to 120 ms) each end without a trace in the log, and the slot is free again:
    a small call is served at once after them."""
    server = _server(server_factory, "--grpc-receive-memory-mb", "32")
    message = _identity_message(30 * MIB)
    codes: list[grpc.StatusCode] = []

    def cut(seconds: float) -> None:
        with grpc.insecure_channel(server.grpc_url) as channel:
            try:
                channel.unary_unary(METHOD + "ModelInfer")(message, timeout=seconds)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())

    threads = [threading.Thread(target=cut, args=(0.02 * (k + 1),)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(DEADLINE_S)
    assert len(codes) == 6 and grpc.StatusCode.DEADLINE_EXCEEDED in codes, codes
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        _small_round_trip(client, 4)
    assert "Traceback" not in server.log()
