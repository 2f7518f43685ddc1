"""The local client library (``shm.client``) against real servers: calls in sync, futures and
asyncio form, request ids and parameters, errors, regions the client creates or registers,
outputs written into the caller's own memory, a model that writes into its input leaving the
caller's memory alone (as in Triton), the lifetime of result views, and faults (a client killed mid-request, a server restarted
or killed under a connected client).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import gc
import json
import os
import select
import signal
import subprocess
import threading
import time
import weakref
from multiprocessing import shared_memory

import numpy as np
import pytest

from conftest import (DEADLINE_S, PRODUCT_MODELS, PYTHON, ROOT, cpu_ticks, pending_requests, processes_mapping,
                      raw_request, shm_entries, shm_names, start_shm_server, wait_pending)
from gates import Gate
from shmserve.shm.answer import AnswerDescriptor
from shmserve.shm.client import Backpressure, Client, InferenceServerError, ServerUnavailable
from shmserve import RequestTooLarge
from shmserve.shm.connection import ConnectionClosed
from shmserve.shm.descriptor import InferRequest, InputTensor
from shmserve.shm.protocol import NO_ROOM
from shmserve.shm.liveness import process_ticket

N = 16
A = np.arange(N, dtype=np.int32)
B = np.full(N, 3, dtype=np.int32)


@pytest.fixture(scope="module")
def lc_server(module_factory):
    return start_shm_server(module_factory)


@pytest.fixture
def client(lc_server):
    c = Client(lc_server.id)
    yield c
    c.close()


def client_segments(server_id: str, ticket: int | None = None) -> list[str]:
    """/dev/shm entries (segments, FIFOs, semaphores) of the local clients of the process holding
    liveness ``ticket`` (default: us)."""
    stem = f"shmserve.{server_id}.client.{ticket or process_ticket(server_id)[1]}-"
    return shm_names(stem) + shm_names("sem." + stem)


def http_region_names(server) -> list[str]:
    raw = raw_request(server.port, "GET", "/v2/systemsharedmemory/status")
    assert raw.status == 200, raw
    return sorted(r["name"] for r in raw.json())


def wait_for(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.02)
    return time.monotonic() - started


def bounded(fn, timeout: float) -> dict:
    """Run ``fn`` in a thread and wait at most ``timeout`` s: {'value': ...} or {'error': ...}."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"the call hung for more than {timeout} s"
    return box


# -- E. connecting and calling ---------------------------------------------------------------------


def test_connect_by_server_id_infer_and_close(lc_server):
    before = client_segments(lc_server.id)
    c = Client(lc_server.id)
    try:
        mine = client_segments(lc_server.id)
        assert len(mine) > len(before), "connecting made no client segment"
        assert c.is_server_ready() and c.is_model_ready("add_sub")
        result = c.infer("add_sub", {"INPUT0": A, "INPUT1": B})
        assert set(result) == {"OUTPUT0", "OUTPUT1"} and result.model_version == "1"
        np.testing.assert_array_equal(result["OUTPUT0"], A + B)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)
        assert result["OUTPUT0"].dtype == np.int32 and result["OUTPUT0"].shape == (N,)
        out = c.infer("bytes_identity", {"IN": np.array([b"a", b"", b"\x00\xff", "é".encode()], dtype=np.object_)})
        assert out["OUT"].tolist() == [b"a", b"", b"\x00\xff", "é".encode()]
        assert c.model_config("add_sub")["name"] == "add_sub"
    finally:
        c.close()
    assert client_segments(lc_server.id) == before, "close() left the client's objects behind"


def test_unknown_server_id_is_server_unavailable():
    sid = f"no_such_server_{os.getpid()}"
    box = bounded(lambda: Client(sid), 10)
    assert isinstance(box.get("error"), ServerUnavailable), box
    assert sid in str(box["error"])
    assert shm_entries(sid) == []


def test_an_unknown_server_id_names_the_servers_running_here(lc_server):
    """A wrong id (the default 'shmserve' for a server started with --id) says which servers run on
    this host; a broker file a killed server left, whose lock nobody holds, is not one of them."""
    stale = f"no_such_stale_{os.getpid()}"
    path = f"/dev/shm/shmserve.{stale}.broker.0"
    with open(path, "wb") as f:
        f.truncate(4096)
    try:
        box = bounded(lambda: Client(f"no_such_server_{os.getpid()}"), 10)
    finally:
        os.unlink(path)
    error = box.get("error")
    assert isinstance(error, ServerUnavailable), box
    assert f"no shmserve server with id 'no_such_server_{os.getpid()}' is running on this host (running here: " \
        in str(error), error
    assert repr(lc_server.id) in str(error) and stale not in str(error), error
    assert str(error).endswith("; pass the server's --id)"), error


def test_a_server_of_another_version_is_named_as_such(server_factory):
    """A pod may update its client image apart from the server's: a client that finds the
    server's objects of another shared-memory layout says so (it never reads one layout as
    another), and connects as before once they match."""
    import struct

    from shmserve.shm.channel import LAYOUT

    s = server_factory.start([PRODUCT_MODELS])
    path = f"/dev/shm/shmserve.{s.id}.broker.0"
    with open(path, "r+b") as f:
        mine = f.read(4)
        f.seek(0)
        f.write(struct.pack("<I", 0x53484D53))  # what layout 1 wrote ("SHMS")
    try:
        with pytest.raises(ServerUnavailable, match=f"runs another version: .*layout 0x53, this one's is {LAYOUT}"):
            Client(s.id)
    finally:
        with open(path, "r+b") as f:
            f.write(mine)
    with Client(s.id) as c:
        assert c.model_config("add_sub")["name"] == "add_sub"


def test_infer_async_many_in_flight(client):
    futures = []
    for k in range(300):
        if k % 3:
            futures.append((k, client.infer_async("add_sub", {"INPUT0": A * k, "INPUT1": B + k})))
        else:
            futures.append((k, client.infer_async("meta_echo", {"X": A + k}, request_id=f"req-{k}")))
    assert all(isinstance(f, concurrent.futures.Future) for _, f in futures)
    done, pending = concurrent.futures.wait([f for _, f in futures], timeout=60)
    assert not pending
    for k, f in futures:
        result = f.result()
        if k % 3:
            np.testing.assert_array_equal(result["OUTPUT0"], A * k + B + k)
            np.testing.assert_array_equal(result["OUTPUT1"], A * k - B - k)
        else:
            np.testing.assert_array_equal(result["Y"], A + k + 1)
            assert result["REQUEST_ID"].tolist() == [f"req-{k}".encode()]


def test_client_timeout_bounds_a_synchronous_call(client, tmp_path):
    """``client_timeout`` (seconds, tritonclient's gRPC name) bounds the caller's wait: a 504
    "Deadline Exceeded" on time, the connection goes on, and the late answer is given back."""
    gate = Gate(tmp_path / "gate")  # the model answers only once the caller has given up
    try:
        with pytest.raises(InferenceServerError) as raised:
            client.infer("slow_reader", {"X": A}, parameters={"sleep_s": 0, "gate": gate.param}, client_timeout=0.2)
        assert raised.value.status == 504 and "Deadline Exceeded" in raised.value.message, raised.value
        gate.wait_started(1)  # (it may reach the model only after the caller gave up)
        assert client._conn.in_flight == 1  # noqa: SLF001 - its answer is still to come
        result = client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, client_timeout=DEADLINE_S)  # answered in time
        np.testing.assert_array_equal(result["OUTPUT0"], A + B)
    finally:
        gate.open()
    wait_for(lambda: client._conn.in_flight == 0, DEADLINE_S, "the late answer given back")  # noqa: SLF001
    assert client.infer("slow_reader", {"X": A}, parameters={"sleep_s": 0},
                        client_timeout=DEADLINE_S)["SUM"].tolist() == [int(A.sum())]
    with pytest.raises(ValueError):
        client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, client_timeout=-1)


def test_sync_callers_in_threads_and_futures_share_one_connection(client):
    """Synchronous callers lead the connection's waiting in turn (and hand it to the waiter
    thread when they leave with others' answers still coming); none may lose or swap answers,
    including a slow request whose caller waits while others come and go."""
    slow = client.infer_async("slow_reader", {"X": A}, parameters={"sleep_s": 0.5})

    def caller(t: int) -> int:
        for k in range(60):
            result = client.infer("add_sub", {"INPUT0": A * t, "INPUT1": B + k})
            np.testing.assert_array_equal(result["OUTPUT0"], A * t + B + k)
            if k % 10 == 0:  # futures submitted (and awaited) while other threads lead
                f = client.infer_async("meta_echo", {"X": A + k})
                np.testing.assert_array_equal(f.result(timeout=30)["Y"], A + k + 1)
        return t

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        assert sorted(pool.map(caller, range(6))) == list(range(6))
    assert slow.result(timeout=30)["SUM"].tolist() == [int(A.sum())]
    # A lone synchronous call after all that still gets its answer on its own thread.
    np.testing.assert_array_equal(client.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT1"], A - B)


def test_a_call_that_outlasts_its_polling_sleeps_for_its_answer(lc_server):
    """A synchronous call polls for its answer for at most its budget (``Client(poll_us=...)``),
    then waits asleep: a slow answer still arrives, and the wait costs this process next to no
    CPU. (A 20 ms budget: quick answers keep the polling on even on a loaded host.)"""
    client = Client(lc_server.id, poll_us=20_000)
    x = np.arange(N, dtype=np.int32)
    assert client.infer("slow_reader", {"X": x})["SUM"].tolist() == [int(x.sum())]
    deadline = time.monotonic() + 60
    while client._conn._spin.budget() == 0:  # noqa: SLF001 - quick answers bring the polling back on
        assert time.monotonic() < deadline, "quick answers never brought the polling back on"
        client.infer("add_sub", {"INPUT0": x, "INPUT1": B}).release()
    started, cpu = time.monotonic(), time.process_time()
    result = client.infer("slow_reader", {"X": x + 1})
    assert time.monotonic() - started >= 0.4
    assert time.process_time() - cpu < 0.1
    assert result["SUM"].tolist() == [int((x + 1).sum())]
    np.testing.assert_array_equal(result["COPY"], x + 1)
    np.testing.assert_array_equal(client.infer("add_sub", {"INPUT0": x, "INPUT1": B})["OUTPUT0"], x + B)
    client.close()


def test_a_repeated_call_follows_its_model_through_unload_and_load(server_factory):
    """A repeated call is routed anew each time: once its model is unloaded it gets Triton's 404,
    and once the model is loaded again it is served again."""
    server = start_shm_server(server_factory)
    x = np.arange(N, dtype=np.int32)

    def control(action: str) -> None:
        raw = raw_request(server.port, "POST", f"/v2/repository/models/add_sub/{action}", b"{}")
        assert raw.status == 200, raw

    with Client(server.id) as c:
        for _ in range(3):
            np.testing.assert_array_equal(c.infer("add_sub", {"INPUT0": x, "INPUT1": B})["OUTPUT0"], x + B)
        control("unload")
        for _ in range(2):
            with pytest.raises(InferenceServerError) as e:
                c.infer("add_sub", {"INPUT0": x, "INPUT1": B})
            assert e.value.status == 404 and "Request for unknown model: 'add_sub'" in e.value.message
        control("load")
        for _ in range(3):
            np.testing.assert_array_equal(c.infer("add_sub", {"INPUT0": x + 1, "INPUT1": B})["OUTPUT1"], x + 1 - B)


def test_polling_stops_when_the_calls_stop(client, lc_server):
    """A closed loop of quick calls makes the caller and the worker poll for each other
    (SpinPolicy, REQ_POLLING); once the calls stop, both sleep: the worker and this process use
    next to no CPU in the second after."""
    x = np.arange(N, dtype=np.int32)
    for _ in range(2000):
        client.infer("add_sub", {"INPUT0": x, "INPUT1": B}).release()
    time.sleep(0.2)
    worker = lc_server.worker_pids("add_sub")
    ticks, ours = cpu_ticks(worker), time.process_time()
    time.sleep(1.0)
    after = cpu_ticks(worker)
    assert sum(after.values()) - sum(ticks.values()) <= 3, (ticks, after)  # ticks of 10 ms
    assert time.process_time() - ours < 0.03
    np.testing.assert_array_equal(client.infer("add_sub", {"INPUT0": x, "INPUT1": B})["OUTPUT0"], x + B)


def test_a_client_that_does_not_poll_lets_the_worker_sleep(lc_server):
    """``Client(poll_us=0)``: the caller never polls, so its requests do not ask the worker to
    poll either; both sleep between calls, and every answer is right.

    The caller pauses 0.1 ms between calls: well within the worker's poll (--poll-us, 500 us), so a
    worker asked to poll finds nearly every next call without sleeping (measured: 0-7 sleeps in
    100 calls), but long enough for a worker that does not poll to reach its sleep first. On a loaded host the worker
    can still be preempted past the pause now and then, so a round of calls is tried again (up to
    five rounds); a worker that polls would find nearly every call without sleeping in every round.
    """
    with pytest.raises(ValueError):
        Client(lc_server.id, poll_us=-1)
    x = np.arange(N, dtype=np.int32)
    worker = lc_server.worker_pids("add_sub")[0]
    n = 100
    rounds: list[int] = []
    with Client(lc_server.id, poll_us=0) as c:
        for _ in range(20):
            c.infer("add_sub", {"INPUT0": x, "INPUT1": B}).release()
        while len(rounds) < 5 and (not rounds or rounds[-1] < n // 2):
            before = _voluntary_switches(worker)
            for i in range(n):
                time.sleep(0.0001)
                np.testing.assert_array_equal(c.infer("add_sub", {"INPUT0": x + i, "INPUT1": B})["OUTPUT0"], x + i + B)
            rounds.append(_voluntary_switches(worker) - before)
    assert rounds[-1] >= n // 2, f"the worker slept {rounds} times in rounds of {n} calls that did not ask it to poll"


def _voluntary_switches(pid: int) -> int:
    """How often the process's main thread blocked."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


@pytest.mark.parametrize("call", ["infer_aio", "stream_aio"])
def test_a_first_aio_call_fetches_the_models_config_off_the_loop(lc_server, call):
    """The first call of a model needs its config, which the broker answers: infer_aio and
    stream_aio fetched it on the caller's loop, so a busy broker (here: stopped for a second)
    held every other coroutine of the program meanwhile."""
    broker = next(pid for pid, title in lc_server.titles().items() if title.startswith("shmserve broker"))

    async def main() -> tuple[list, float]:
        with Client(lc_server.id) as c:  # (connected while the broker runs)
            ticks: list[float] = []

            async def ticker() -> None:
                while True:
                    ticks.append(time.monotonic())
                    await asyncio.sleep(0.01)

            task = asyncio.create_task(ticker())
            await asyncio.sleep(0.05)
            os.kill(broker, signal.SIGSTOP)
            resume = threading.Timer(1.0, os.kill, (broker, signal.SIGCONT))
            resume.start()
            try:
                if call == "infer_aio":
                    got = [(await c.infer_aio("add_sub", {"INPUT0": A, "INPUT1": B}))["OUTPUT0"].tolist()]
                else:
                    got = [r["OUTPUT0"].tolist() async for r in c.stream_aio("add_sub", {"INPUT0": A, "INPUT1": B})]
            finally:
                resume.join()
                os.kill(broker, signal.SIGCONT)
            task.cancel()
            return got, max(b - a for a, b in zip(ticks, ticks[1:]))

    got, longest_gap = asyncio.run(main())
    assert got, "the call was answered"
    assert longest_gap < 0.5, f"the loop stood still {longest_gap:.2f} s while the broker was stopped"


def test_infer_aio_gather_many_without_blocking_the_loop(client, tmp_path):
    """While two slow requests wait for their answers, the event loop runs on: the slow model
    answers only once a task of the loop has ticked ten times while a slow request was in the model,
    and opened its gate. A blocked loop never would: the model then fails the request when its
    gate's time limit passes."""
    gate = Gate(tmp_path / "gate")

    async def main():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                if gate.started():  # a slow request is in the model: the loop waits for its answer
                    ticks += 1
                    if ticks == 10:
                        gate.open()
                await asyncio.sleep(0.01)

        fast = [client.infer_aio("add_sub", {"INPUT0": A + k, "INPUT1": B * k}) for k in range(100)]
        slow = [client.infer_aio("slow_reader", {"X": A + k}, parameters={"sleep_s": 0.3, "gate": gate.param})
                for k in range(2)]
        tick_task = asyncio.create_task(ticker())
        try:
            results = await asyncio.wait_for(asyncio.gather(*fast, *slow), DEADLINE_S)
        finally:
            stop.set()
            gate.open()  # (a test that failed leaves no instance held)
            await tick_task
        return results, ticks

    started = time.monotonic()
    results, ticks = asyncio.run(main())
    elapsed = time.monotonic() - started
    for k, result in enumerate(results[:100]):
        np.testing.assert_array_equal(result["OUTPUT0"], A + k + B * k)
    for k, result in enumerate(results[100:]):
        assert result["SUM"].tolist() == [int((A + k).sum())]
    assert elapsed >= 0.55  # the two slow requests ran one after the other on one instance
    assert ticks >= 10, ticks


def test_request_id_and_parameters_reach_the_model(client):
    params = {"answer": 42, "name": "zoé", "flag": True, "ratio": 0.25}
    result = client.infer("meta_echo", {"X": A}, request_id="my-request-7", parameters=params)
    assert result["REQUEST_ID"].tolist() == [b"my-request-7"]
    assert json.loads(result["PARAMETERS"][0]) == params
    np.testing.assert_array_equal(result["Y"], A + 1)
    plain = client.infer("meta_echo", {"X": A})
    assert plain["REQUEST_ID"].tolist() == [b""] and json.loads(plain["PARAMETERS"][0]) == {}


def test_calls_that_alternate_shapes_and_outputs_get_their_own_answers(client):
    """Calls that alternate shapes, dtypes, output choices and data each get their own answer,
    and a dtype the model refuses is refused every time, not only the first."""
    rng = np.random.default_rng(7)
    for round_ in range(3):
        for n, outputs in ((3, None), (5, ["Y"]), (3, ["PID", "Y"]), (5, None)):
            x = rng.integers(-1000, 1000, n, dtype=np.int32)
            result = client.infer("meta_echo", {"X": x}, outputs)
            assert sorted(result) == sorted(outputs or ["Y", "REQUEST_ID", "PARAMETERS", "PID"])
            np.testing.assert_array_equal(result["Y"], x + 1)
            result.release()
        for _ in range(2):
            with pytest.raises(InferenceServerError) as e:
                client.infer("meta_echo", {"X": np.zeros(3, np.int64)})
            assert e.value.status == 400 and "INT64" in e.value.message
    # A view into a larger array (not contiguous) is sent as its own bytes, never the base's.
    base = np.arange(12, dtype=np.int32)
    np.testing.assert_array_equal(client.infer("meta_echo", {"X": base[::3]})["Y"], base[::3] + 1)
    np.testing.assert_array_equal(client.infer("meta_echo", {"X": base[:4]})["Y"], base[:4] + 1)


def test_send_times_a_local_program_writes_are_checked(client, lc_server):
    """A local program writes its descriptors itself: the layout holds only an unsigned 64-bit
    send time (the library refuses to encode another), and one in the future is served and
    counted (the statistics must not turn negative, nor the worker die)."""
    import threading

    conn = client._conn  # noqa: SLF001 - raw descriptors, to send what the library never would
    x = np.arange(4, dtype=np.int32)

    def send(t: int) -> tuple[int, AnswerDescriptor]:
        doc = InferRequest("meta_echo", "", [InputTensor("X", "INT32", [4], 16, 0)], sent_ns=t)
        answers: list = []
        done = threading.Event()

        def answered(c) -> None:
            answers.append((c.status, c.answer))
            c.release()
            done.set()

        conn.infer(doc, [x], answered)
        assert done.wait(DEADLINE_S), f"no answer for t={t!r}"
        return answers[0]

    pids = lc_server.worker_pids("meta_echo")
    assert send(time.monotonic_ns())[0] == 200
    assert send(time.monotonic_ns())[0] == 200
    for bad in (-5, 1.5, "soon", 1 << 64):
        with pytest.raises(ValueError, match="cannot be encoded"):
            send(bad)  # type: ignore[arg-type]
    for future in (2 ** 62, (1 << 64) - 1, time.monotonic_ns() + 10 ** 12):
        assert send(future)[0] == 200
    assert send(time.monotonic_ns())[0] == 200
    assert lc_server.worker_pids("meta_echo") == pids


@pytest.mark.parametrize("model,inputs,status,needle", [
    ("no_such_model", {"X": A}, 404, "no_such_model"),
    ("add_sub", {"INPUT0": A[:5], "INPUT1": B}, 400, "Expected [16], got [5]"),
    ("add_sub", {"INPUT0": A.astype(np.float32), "INPUT1": B}, 400, "FP32"),
    ("add_sub", {"INPUT0": A}, 400, "INPUT1"),
], ids=["unknown_model", "bad_shape", "bad_datatype", "missing_input"])
def test_errors_raise_inference_server_error(client, model, inputs, status, needle):
    with pytest.raises(InferenceServerError) as e:
        client.infer(model, inputs)
    assert e.value.status == status
    assert needle in e.value.message and str(e.value) == e.value.message
    # infer_async: the same error, from the future (or at submission, when the model's config
    # cannot even be fetched to plan the request).
    with pytest.raises(InferenceServerError) as e2:
        client.infer_async(model, inputs).result(timeout=DEADLINE_S)
    assert e2.value.status == status and e2.value.message == e.value.message
    np.testing.assert_array_equal(client.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"], A + B)


def test_a_version_named_as_a_number_or_text_is_the_same_version(client):
    """The broker takes a version as a number or as text; the direct lane's routing (compiled, so
    its declared types are checked) must take both too, and an unknown one is a clear 404."""
    for version in ("1", 1):
        result = client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, version=version)
        assert result.model_version == "1", version
        np.testing.assert_array_equal(result["OUTPUT0"], A + B)
    with pytest.raises(InferenceServerError) as e:
        client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, version=7)
    assert e.value.status == 404 and "version 7 is not found" in e.value.message


def test_error_raised_in_the_model_carries_its_message(client):
    with pytest.raises(InferenceServerError) as e:
        client.infer("slow_reader", {"X": A}, parameters={"sleep_s": "not a number"})
    assert e.value.status == 500 and "could not convert" in e.value.message
    assert client.infer("slow_reader", {"X": A}, parameters={"sleep_s": 0})["SUM"].tolist() == [int(A.sum())]


# -- E. regions: by reference, outputs in place, registered arrays ----------------------------------


def test_region_inputs_travel_by_reference(lc_server):
    """A 4 MiB input in a region goes through a connection whose arena holds 64 KiB: it cannot
    have been copied. The same array outside any region needs the arena and is refused."""
    c = Client(lc_server.id, arena_bytes=64 << 10)
    try:
        region = c.create_region("lc_big", 4 << 20)
        assert http_region_names(lc_server) == ["lc_big"]
        assert shm_names(region.key.lstrip("/")) == [region.key.lstrip("/")]
        x = region.array(np.int32, (1 << 20,))
        x[:] = np.arange(1 << 20, dtype=np.int32) % 1000
        result = c.infer("slow_reader", {"X": x}, ["SUM"], parameters={"sleep_s": 0})
        assert result["SUM"].tolist() == [int(x.astype(np.int64).sum())]
        with pytest.raises(RequestTooLarge):  # (larger than the whole arena: no retry would pass)
            c.infer("slow_reader", {"X": np.array(x)}, ["SUM"], parameters={"sleep_s": 0})
        # Many views at different offsets of one region.
        a = region.array(np.int32, (N,), offset=1024)
        b = region.array(np.int32, (N,), offset=4096 + 64)
        a[:], b[:] = A * 2, B
        np.testing.assert_array_equal(c.infer("add_sub", {"INPUT0": a, "INPUT1": b})["OUTPUT1"], A * 2 - B)
        key = region.key
        c.unregister_region("lc_big")
        assert http_region_names(lc_server) == []
        assert shm_names(key.lstrip("/")) == [], "the client's own region was not unlinked"
    finally:
        c.close()


def test_a_region_name_in_use_is_a_409_as_a_registration_twice(client):
    client.create_region("lc_twice", 4096)
    with pytest.raises(InferenceServerError) as e:
        client.create_region("lc_twice", 4096)
    assert (e.value.status, e.value.message) == (409, "shared memory region 'lc_twice' already in manager")
    client.unregister_region("lc_twice")


def test_region_name_reused_after_unregister_is_a_fresh_object(client):
    """create_region, use, unregister_region (which unlinks), create_region with the same name: the
    key is the same, the object is new, and the server must use the new one."""
    for value in (10, 20, 30):
        region = client.create_region("lc_reuse", 256)
        x = region.array(np.int32, (N,))
        x[:] = value
        out = region.array(np.int32, (N,), offset=128)
        result = client.infer("add_sub", {"INPUT0": x, "INPUT1": B}, {"OUTPUT0": out, "OUTPUT1": None})
        assert result["OUTPUT1"].tolist() == [value - 3] * N, f"round {value}: stale input"
        assert out.tolist() == [value + 3] * N, f"round {value}: the output went elsewhere"
        del x, out, result
        client.unregister_region("lc_reuse")


def test_regions_change_under_a_connected_client(client, lc_server):
    """Requests naming regions go straight to the worker, which resolves them against the table
    the broker publishes: a region registered by another client is usable at once, and once it
    is unregistered a request naming it is refused with Triton's text, by whichever path."""
    x = np.arange(N, dtype=np.int32)
    with Client(lc_server.id) as other:
        region = other.create_region("lc_shared", 256)
        region.array(np.int32, (N,))[:] = x
        doc_inputs = {"INPUT0": x, "INPUT1": B}
        assert client.infer("add_sub", doc_inputs)["OUTPUT0"].tolist() == (x + B).tolist()
        # The first client names the other's region through the protocol's own fields.
        conn = client._conn  # noqa: SLF001 - the raw connection, to name a region it does not own
        answers: list = []
        doc = InferRequest("add_sub", "", [InputTensor("INPUT0", "INT32", [N], x.nbytes, region="lc_shared"),
                                           InputTensor("INPUT1", "INT32", [N], B.nbytes, 0)])
        done = threading.Event()

        def call() -> tuple:
            done.clear()
            def answered(c) -> None:
                body = c.answer
                data = bytes(c.tensor(body.outputs[0])) if c.status == 200 else b""
                answers.append((c.status, body, data))
                c.release()
                done.set()

            conn.infer(dataclasses.replace(doc, sent_ns=0), [B], answered)
            assert done.wait(DEADLINE_S)
            return answers[-1]

        status, body, data = call()
        assert status == 200 and np.frombuffer(data, np.int32).tolist() == (x + B).tolist(), body
        doc.inputs[0].offset = 224  # 224 + 64 bytes overrun the 256-byte region
        status, body, _ = call()
        assert status == 400 and "Invalid offset + byte size for shared memory region: 'lc_shared'" in body.error
        doc.inputs[0].offset = 0
        other.unregister_region("lc_shared")
        status, body, _ = call()
        assert status == 404 and body.error == "Unable to find shared memory region: 'lc_shared'"


def test_outputs_go_into_the_callers_region(client, lc_server):
    region = client.create_region("lc_out", 4096)
    raw = region.array(np.uint8, (4096,))
    raw[:] = 0xAB  # sentinel: bytes the server must not touch
    x, y = region.array(np.int32, (N,), 0), region.array(np.int32, (N,), 64)
    x[:], y[:] = A, B * 5
    out0 = region.array(np.int32, (N,), 1024)
    out1 = region.array(np.int32, (N,), 3000)
    result = client.infer("add_sub", {"INPUT0": x, "INPUT1": y}, {"OUTPUT0": out0, "OUTPUT1": out1})
    assert result["OUTPUT0"] is out0 and result["OUTPUT1"] is out1
    np.testing.assert_array_equal(out0, A + B * 5)
    np.testing.assert_array_equal(out1, A - B * 5)
    np.testing.assert_array_equal(region.array(np.int32, (N,), 1024), A + B * 5)  # in the region's memory
    untouched = np.ones(4096, dtype=bool)
    untouched[:128] = untouched[1024:1024 + 64] = untouched[3000:3000 + 64] = False
    assert (raw[untouched] == 0xAB).all(), "the server wrote outside the output places"
    # One output placed, the other returned as usual.
    mixed = client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, {"OUTPUT0": None, "OUTPUT1": out1})
    assert mixed["OUTPUT1"] is out1
    np.testing.assert_array_equal(out1, A - B)
    np.testing.assert_array_equal(mixed["OUTPUT0"], A + B)
    with pytest.raises(ValueError, match="not in a registered region"):
        client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, {"OUTPUT0": np.zeros(N, dtype=np.int32)})
    del raw, x, y, out0, out1, result, mixed


def test_an_output_placed_in_a_larger_or_other_typed_array_comes_back_as_the_server_wrote_it(client):
    """The server reports the shape and datatype it wrote into a region (as tritonclient reads
    them back): a destination larger than the output, or of another dtype, came back as given,
    the stale tail and the reinterpreted bytes included."""
    region = client.create_region("lc_wider", 4096)
    wide = region.array(np.int32, (100,))
    wide[:] = -1
    other = region.array(np.float32, (N,), 1024)
    got = client.infer("slow_reader", {"X": A}, {"COPY": wide, "SUM": None}, parameters={"sleep_s": 0})
    assert got["COPY"].dtype == np.int32 and got["COPY"].tolist() == A.tolist()
    assert wide[:N].tolist() == A.tolist() and wide[N:].tolist() == [-1] * (100 - N)  # (written in place)
    got = client.infer("slow_reader", {"X": A}, {"COPY": other, "SUM": None}, parameters={"sleep_s": 0})
    assert got["COPY"].dtype == np.int32 and got["COPY"].tolist() == A.tolist()
    del wide, other, got


def test_output_region_too_small_is_a_400(client):
    region = client.create_region("lc_small", 256)
    with pytest.raises(InferenceServerError) as e:
        client.infer("add_sub", {"INPUT0": A, "INPUT1": B}, {"OUTPUT0": region.array(np.int32, (8,))})
    assert e.value.status == 400 and "should be at least 64 bytes" in e.value.message
    np.testing.assert_array_equal(client.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"], A + B)


def _forget_registered_array(client: Client, name: str) -> None:
    client.unregister_region(name)


def test_register_array_in_multiprocessing_shared_memory(client, lc_server):
    sm = shared_memory.SharedMemory(create=True, size=8192)
    try:
        inp = np.ndarray((2, N), dtype=np.int32, buffer=sm.buf, offset=256)
        out = np.ndarray((N,), dtype=np.int32, buffer=sm.buf, offset=4096)
        inp[0], inp[1] = A * 3, B
        region = client.register_array("lc_mp_in", inp)
        assert region.key == "/" + sm.name and region.offset == 256 and region.size == inp.nbytes
        client.register_array("lc_mp_out", out)
        status = {r["name"]: r for r in raw_request(lc_server.port, "GET", "/v2/systemsharedmemory/status").json()}
        assert status["lc_mp_in"] == {"name": "lc_mp_in", "key": "/" + sm.name, "offset": 256,
                                      "byte_size": inp.nbytes}
        result = client.infer("add_sub", {"INPUT0": inp[0], "INPUT1": inp[1]}, {"OUTPUT0": out, "OUTPUT1": None})
        assert result["OUTPUT0"] is out
        np.testing.assert_array_equal(np.ndarray((N,), np.int32, buffer=sm.buf, offset=4096), A * 3 + B)
        np.testing.assert_array_equal(result["OUTPUT1"], A * 3 - B)
        # Read from the SharedMemory block; the model's in-place write went to its own copy.
        probe = client.infer("zerocopy_probe", {"X": inp[1]})
        assert probe["BEFORE"].tolist() == [3] and inp[1, 0] == 3
        del result, probe
        _forget_registered_array(client, "lc_mp_in")
        _forget_registered_array(client, "lc_mp_out")
        assert http_region_names(lc_server) == []
        del inp, out
    finally:
        gc.collect()
        sm.close()
        sm.unlink()


def test_register_array_outside_shared_memory_is_a_value_error(client, lc_server):
    with pytest.raises(ValueError, match="shared-memory"):
        client.register_array("lc_plain", np.zeros(64, dtype=np.float32))
    assert http_region_names(lc_server) == []


ARRAYS_OUTLIVE_THEIR_REGION = """
import sys
import numpy as np
from shmserve.shm.client import Client
with Client(sys.argv[1]) as c:
    kept = c.create_region("outlive", 4096).array(np.int32, (16,))
    kept[:] = np.arange(16)
    c.unregister_region("outlive")
    gone_with_the_client = c.create_region("outlive2", 4096).array(np.int32, (16,))
    gone_with_the_client[:] = 7
print(int(kept.sum()), int(gone_with_the_client.sum()))
"""


def test_a_regions_arrays_stay_readable_after_it_is_unregistered_or_closed(lc_server):
    """The arrays ``Region.array`` made hold the mapping (numpy keeps the mmap as their base):
    unregistering the region or closing the client unmapped it under them, and the next read
    killed the process (SIGSEGV)."""
    run = subprocess.run([PYTHON, "-c", ARRAYS_OUTLIVE_THEIR_REGION, lc_server.id], capture_output=True,
                         text=True, timeout=DEADLINE_S)
    assert (run.returncode, run.stdout.split()) == (0, ["120", "112"]), run.stderr


def test_unregister_region_of_a_registered_array_works(lc_server):
    sm = shared_memory.SharedMemory(create=True, size=4096)
    c = Client(lc_server.id)
    try:
        c.register_array("lc_mp_unreg", np.ndarray((N,), dtype=np.int32, buffer=sm.buf))
        c.register_array("lc_mp_close", np.ndarray((N,), dtype=np.int32, buffer=sm.buf, offset=1024))
        c.unregister_region("lc_mp_unreg")
        assert http_region_names(lc_server) == ["lc_mp_close"]
        c.close()  # unregisters lc_mp_close
        assert http_region_names(lc_server) == []
        assert client_segments(lc_server.id) == []
    finally:
        for _ in range(2):  # with the bug, the first close stops at the region and leaves the connection
            try:
                c.close()
                break
            except AttributeError:
                pass
        gc.collect()
        sm.close()
        sm.unlink()


def test_register_torch_tensor_shared_with_default_strategy_is_refused_clearly(client):
    """torch's default 'file_descriptor' strategy unlinks the /dev/shm name at once, so no other
    process can open it by name: the client says so and what to do instead."""
    import torch

    t = torch.arange(N, dtype=torch.int32).share_memory_()
    with pytest.raises(ValueError, match="set_sharing_strategy\\('file_system'\\)"):
        client.register_array("lc_torch_fd", t)


def test_register_torch_tensor_shared_with_file_system_strategy(client):
    import torch
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        t = torch.arange(N, dtype=torch.int32).share_memory_()
        client.register_array("lc_torch_fs", t)
        result = client.infer("zerocopy_probe", {"X": t})
        assert int(t[0]) == 0 and result["BEFORE"].tolist() == [0]
        _forget_registered_array(client, "lc_torch_fs")
    finally:
        tmp.set_sharing_strategy(before)


# -- F. zero copy ----------------------------------------------------------------------------------


def test_model_writing_its_input_leaves_the_clients_region_alone(client):
    """zerocopy_probe sets element 0 of its input (from as_numpy()) to 4242. Given in the client's
    region or as a plain array, the client's memory is unchanged afterwards: the model's inputs
    are its own copies, as in Triton (docs/python_backend.md). Outputs the client placed are
    written straight into its region."""
    region = client.create_region("lc_zc", 4096)
    x = region.array(np.int32, (8,), offset=512)
    x[:] = np.arange(1, 9)
    doubled = region.array(np.int32, (8,), offset=2048)
    result = client.infer("zerocopy_probe", {"X": x}, {"BEFORE": None, "DOUBLED": doubled, "PID": None})
    assert result["BEFORE"].tolist() == [1]
    assert x.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    # The output the client placed was written straight into its region, and is that very array.
    assert result["DOUBLED"] is doubled
    assert doubled.tolist() == [2, 4, 6, 8, 10, 12, 14, 16]
    assert np.shares_memory(doubled, region.array(np.uint8, (4096,)))
    plain = np.arange(1, 9, dtype=np.int32)
    again = client.infer("zerocopy_probe", {"X": plain})
    assert again["BEFORE"].tolist() == [1] and plain.tolist() == list(range(1, 9))
    del x, doubled, result, again


# -- E. lifetime of result views -------------------------------------------------------------------


def test_result_views_stay_valid_while_the_result_lives(lc_server):
    c = Client(lc_server.id)
    try:
        kept = c.infer("add_sub", {"INPUT0": A, "INPUT1": B})  # outputs in room of the request block
        echo = c.infer("meta_echo", {"X": A * 2})  # Y's size is unknown: it lives in the worker's arena
        out0, y = kept["OUTPUT0"], echo["Y"]
        for k in range(400):
            r = c.infer("add_sub" if k % 2 else "meta_echo", {"INPUT0": A * k, "INPUT1": B} if k % 2 else {"X": A * k})
            np.testing.assert_array_equal(r["OUTPUT0"] if k % 2 else r["Y"], A * k + B if k % 2 else A * k + 1)
            del r
        np.testing.assert_array_equal(out0, A + B)
        np.testing.assert_array_equal(y, A * 2 + 1)
        del out0, y, kept, echo
    finally:
        c.close()


def test_output_array_survives_dropping_its_result(lc_server):
    c = Client(lc_server.id, arena_bytes=64 << 10)  # small, so that further requests reuse freed space
    try:
        result = c.infer("add_sub", {"INPUT0": A, "INPUT1": B})
        out = result["OUTPUT0"]
        alive = weakref.ref(result)
        del result
        gc.collect()
        for k in range(1, 400):
            try:
                r = c.infer("add_sub", {"INPUT0": A * k, "INPUT1": B})
            except Backpressure:
                break  # the held block may stall the arena: acceptable, corrupting it is not
            del r
        assert out.tolist() == (A + B).tolist(), "the output array was overwritten by later requests"
        assert alive() is not None, "the result died while one of its arrays is alive"
        del out
    finally:
        c.close()


# -- G. faults -------------------------------------------------------------------------------------

KID = r"""
import os, sys, time
import numpy as np
from shmserve.shm.client import Client
server_id, mode, gate = sys.argv[1], sys.argv[2], sys.argv[3]
c = Client(server_id)
region = c.create_region(f"kid_{os.getpid()}", 4096)
x = region.array(np.int32, (8,))
x[:] = np.arange(8)
inp = x if mode == "region" else np.arange(8, dtype=np.int32)
c.infer_async("slow_reader", {"X": inp}, parameters={"sleep_s": 0, "gate": gate})
print(region.key, flush=True)
time.sleep(120)
"""


def start_kid(server_id: str, mode: str, gate: Gate) -> tuple[subprocess.Popen, str]:
    """A client process with a region and a request in slow_reader, held there until ``gate``
    opens; returns it and the region's key once the request is sent."""
    proc = subprocess.Popen([PYTHON, "-c", KID, server_id, mode, gate.param], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
    line = proc.stdout.readline().strip() if ready else ""
    if not line.startswith("/"):
        proc.kill()
        proc.wait(10)
        pytest.fail(f"the client process did not start: {line!r} {proc.stderr.read()}")
    return proc, line


def kill_kid(proc: subprocess.Popen, key: str) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    proc.stdout.close()
    proc.stderr.close()
    if os.path.exists(f"/dev/shm/{key.lstrip('/')}"):
        os.unlink(f"/dev/shm/{key.lstrip('/')}")  # a test failed before the server reclaimed it


class Traffic:
    """Another client sending add_sub requests in a loop on its own thread, counting mistakes."""

    def __init__(self, server_id: str) -> None:
        self.client = Client(server_id)
        self.done = self.errors = 0
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            try:
                r = self.client.infer("add_sub", {"INPUT0": A + k, "INPUT1": B})
                if r["OUTPUT0"].tolist() != (A + k + B).tolist():
                    raise AssertionError(f"wrong answer for request {k}")
                self.done += 1
            except BaseException as e:  # noqa: BLE001
                self.failures.append(e)
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self.client.close()

    def wait_more(self, n: int) -> None:
        """Wait until ``n`` more requests have been answered."""
        target = self.done + n
        wait_for(lambda: self.done >= target or bool(self.failures), DEADLINE_S, f"{n} more answers to the traffic")


@pytest.fixture(scope="module")
def killed_clients() -> list[tuple[str, float]]:
    """(segment name, time.monotonic() of the SIGKILL) of the client processes killed in this module,
    so that the slow check that the server unmaps them runs once, at the end, overlapping the rest."""
    return []


def test_client_killed_mid_request_is_noticed(lc_server, killed_clients, tmp_path):
    pid_before = lc_server.worker_pids("slow_reader")
    traffic = Traffic(lc_server.id)
    gate = Gate(tmp_path / "gate")
    proc, key = start_kid(lc_server.id, "plain", gate)
    try:
        kid_objects = client_segments(lc_server.id, key_ticket(key))
        assert kid_objects, "the client process has no client segment"
        (segment,) = [n for n in kid_objects if not n.startswith("sem.") and not n.endswith(".fifo")]
        assert f"kid_{proc.pid}" in http_region_names(lc_server)
        gate.wait_started(1)  # its request is in the model now
        traffic.wait_more(5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE_S)
        killed_clients.append((segment, time.monotonic()))
        gate.open()  # the model finishes the dead client's request
        wait_for(lambda: client_segments(lc_server.id, key_ticket(key)) == [], DEADLINE_S,
                 "the killed client's segment, FIFO and semaphore disappear")
        assert f"kid_{proc.pid}" not in http_region_names(lc_server), "its region is still registered"
        wait_for(lambda: not os.path.exists("/dev/shm" + key), DEADLINE_S,
                 "the server unlinks the object of the region the killed client created")
        # The server goes on serving, the slow model included (once the dead client's request is done).
        with Client(lc_server.id) as other:
            r = other.infer("slow_reader", {"X": A}, parameters={"sleep_s": 0})
            assert r["SUM"].tolist() == [int(A.sum())]
            assert r["PID"].tolist() == pid_before
        traffic.wait_more(5)  # the other client was served all along
    finally:
        gate.open()
        traffic.stop()
        kill_kid(proc, key)
    assert traffic.failures == [], traffic.failures[:3]
    assert lc_server.worker_pids("slow_reader") == pid_before


def test_client_with_region_inputs_killed_mid_request_leaves_the_worker_alive(server_factory, tmp_path):
    server = start_shm_server(server_factory)
    pid_before = server.worker_pids("slow_reader")
    gate = Gate(tmp_path / "gate")
    proc, key = start_kid(server.id, "region", gate)
    try:
        with Client(server.id) as other:
            gate.wait_started(1)  # the kid's request is in the model, which has not read its region yet
            queued = other.infer_async("slow_reader", {"X": A}, parameters={"sleep_s": 0})
            wait_pending(server, "slow_reader", 2)  # this one waits behind it
            proc.send_signal(signal.SIGKILL)
            proc.wait(DEADLINE_S)
            gate.open()
            box = bounded(lambda: queued.result(), DEADLINE_S)
            assert "value" in box, f"another client's request failed: {box.get('error')!r}"
            assert box["value"]["SUM"].tolist() == [int(A.sum())]
            assert server.worker_pids("slow_reader") == pid_before, "the worker died"
    finally:
        gate.open()
        kill_kid(proc, key)


UNCLOSED = r"""
import sys
import numpy as np
from shmserve.shm.client import Client
c = Client(sys.argv[1])
region = c.create_region("unclosed", 4096)
a = region.array(np.int32, (16,))
a[:] = 1
print(region.key, flush=True)
assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == [2] * 16
"""  # exits without closing the client


def test_a_program_that_never_closes_its_client_leaves_nothing(lc_server):
    proc = subprocess.run([PYTHON, "-c", UNCLOSED, lc_server.id], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    key = proc.stdout.strip()
    try:
        assert proc.returncode == 0, proc.stderr
        assert key.startswith("/shmclient."), proc.stdout
        assert not os.path.exists("/dev/shm" + key), "the region's object outlived the program"
        assert client_segments(lc_server.id, key_ticket(key)) == [], "its connection's objects outlived it"
        assert "unclosed" not in http_region_names(lc_server)
    finally:
        if key.startswith("/") and os.path.exists("/dev/shm" + key):
            os.unlink("/dev/shm" + key)


FORKS = r"""
import os, sys
import numpy as np
from shmserve.shm.client import Client
c = Client(sys.argv[1])
region = c.create_region("forked", 4096)
a = region.array(np.int32, (16,))
a[:] = 1
pid = os.fork()
if pid == 0:
    sys.exit(0)  # runs the atexit hooks it inherited: they must leave the parent's client alone
os.waitpid(pid, 0)
assert os.path.exists("/dev/shm" + region.key), "the child unlinked the parent's region"
assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == [2] * 16
c.close()
print("ok", flush=True)
"""


def test_a_forked_child_leaves_its_parents_client_alone(lc_server):
    proc = subprocess.run([PYTHON, "-c", FORKS, lc_server.id], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def key_ticket(key: str) -> int:
    """The liveness ticket in a key ``Client.create_region`` made (``/shmclient.<ticket>.<name>``)."""
    return int(key.split(".")[1])


def test_closed_clients_segment_is_unmapped_by_the_server(lc_server):
    before = set(client_segments(lc_server.id))
    c = Client(lc_server.id)
    (name,) = [n for n in set(client_segments(lc_server.id)) - before if not n.startswith("sem.")]
    c.infer("add_sub", {"INPUT0": A, "INPUT1": B})
    c.infer("meta_echo", {"X": A})
    assert processes_mapping(lc_server.tree(), name), "no server process maps the client's segment"
    c.close()
    wait_for(lambda: processes_mapping(lc_server.tree(), name) == [], DEADLINE_S,
             "every server process unmaps the departed client's segment")


def test_close_with_requests_in_flight_fails_them(lc_server, tmp_path):
    """close() with a request in flight resolves its future with an error (an earlier version left
    it pending forever, so .result() hung)."""
    c = Client(lc_server.id)
    gate = Gate(tmp_path / "gate")  # the request stays in the model until its future resolved
    fut = c.infer_async("slow_reader", {"X": A}, parameters={"sleep_s": 0, "gate": gate.param})
    c.close()
    try:
        error = fut.exception(timeout=DEADLINE_S)
    except concurrent.futures.TimeoutError:
        pytest.fail("the future of a request in flight at close() never resolved")
    finally:
        gate.open()
        # slow_reader finishes it (into the void) before the next test
        wait_for(lambda: pending_requests(lc_server, "slow_reader") == 0, DEADLINE_S, "slow_reader idle")
    assert isinstance(error, InferenceServerError) and error.status == 503, error
    assert "closed" in error.message
    with Client(lc_server.id) as again:  # and the instance answers the next client normally
        assert again.infer("slow_reader", {"X": A}, parameters={"sleep_s": 0})["SUM"].tolist() == [int(A.sum())]


def test_a_reserved_request_sent_after_close_says_the_client_is_closed(lc_server):
    """A block reserved before close() (the HTTP frontend reserves one while a body arrives) went
    with the arena: sending it is the closed client's error, not a fault of the unmapped buffer."""
    c = Client(lc_server.id)
    conn = c._conn  # noqa: SLF001 - the reservation API the frontends use
    reservation = conn.reserve(InferRequest("add_sub", "", [InputTensor("INPUT0", "INT32", [N], A.nbytes, 0),
                                                             InputTensor("INPUT1", "INT32", [N], B.nbytes, A.nbytes)]),
                               A.nbytes + B.nbytes)
    reservation.data[:] = A.tobytes() + B.tobytes()
    c.close()
    with pytest.raises(ConnectionClosed, match="this client is closed"):
        conn.send_reserved(reservation, lambda completion: completion.release())
    with Client(lc_server.id) as again:
        assert again.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()


def test_a_client_inherited_through_fork_says_so_and_the_parents_goes_on(lc_server):
    """A child of fork() shares the parent's segment and slots: its calls mixed the two processes'
    requests (the parent got a wrong answer, the child none). They are refused by name, and the
    parent's client is untouched, even by the child's close()."""
    with Client(lc_server.id) as c:
        kept = c.infer("add_sub", {"INPUT0": A, "INPUT1": B})  # the parent's, inherited by the child
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report what a call said, close, leave without running atexit
            try:
                c.infer("add_sub", {"INPUT0": A, "INPUT1": B})
                said = "answered"
            except Exception as e:  # noqa: BLE001 - reported to the parent
                said = f"{type(e).__name__}: {e}"
            del kept  # (its blocks are the parent's: the child must not free them)
            gc.collect()
            c.close()
            os.write(write, said.encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            said = f.read()
        os.waitpid(pid, 0)
        assert said.startswith("ConnectionClosed: this client was made before fork()"), said
        for k in range(300):  # (the arena wraps: a block the child freed would be written over)
            assert c.infer("add_sub", {"INPUT0": A * k, "INPUT1": B})["OUTPUT0"].tolist() == (A * k + B).tolist()
        assert kept["OUTPUT0"].tolist() == (A + B).tolist() and kept["OUTPUT1"].tolist() == (A - B).tolist()


def test_an_error_survives_pickling_and_a_request_past_the_arena_is_no_backpressure(lc_server):
    """A pool of processes hands errors back pickled (InferenceServerError did not unpickle, and
    the pool's result thread died of it); a request larger than the whole arena is a ValueError,
    never a Backpressure that a retry loop would retry for ever."""
    import pickle

    with Client(lc_server.id, arena_bytes=1 << 20) as c:
        with pytest.raises(InferenceServerError) as e:
            c.infer("no_such_model", {"X": A})
        again = pickle.loads(pickle.dumps(e.value))
        assert (again.status, again.message, again.code) == (e.value.status, e.value.message, e.value.code)
        with pytest.raises(RequestTooLarge, match="cannot fit this connection's shared-memory arena"):
            c.infer("add_sub", {"INPUT0": np.zeros(1 << 19, np.int32), "INPUT1": np.zeros(1 << 19, np.int32)})
        assert c.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()


def test_a_model_reloaded_with_larger_outputs_is_called_as_it_is_now(server_factory, tmp_path):
    """The client sizes the room it reserves for outputs from the model's config, which it kept
    for its whole life: after a reload with larger dims every call was refused ("should be at
    least 128 bytes") until a new client was made. It asks again once the routes change."""
    import shutil

    shutil.copytree(PRODUCT_MODELS / "add_sub", tmp_path / "add_sub", ignore=shutil.ignore_patterns("__pycache__"))
    server = server_factory.start([tmp_path], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    wide = {"name": "add_sub", "backend": "python", "max_batch_size": 0,
            "input": [{"name": n, "data_type": "TYPE_INT32", "dims": [32]} for n in ("INPUT0", "INPUT1")],
            "output": [{"name": n, "data_type": "TYPE_INT32", "dims": [32]} for n in ("OUTPUT0", "OUTPUT1")]}
    with Client(server.id) as c:
        assert c.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()
        with server.client() as http:
            http.load_model("add_sub", config=json.dumps(wide))
        x = np.arange(32, dtype=np.int32)
        assert c.infer("add_sub", {"INPUT0": x, "INPUT1": x})["OUTPUT0"].tolist() == (2 * x).tolist()
        assert c.model_config("add_sub")["output"][0]["dims"] == [32]


def test_an_ensemble_reloaded_alone_is_called_with_its_new_config(server_factory, tmp_path):
    """The client keeps a model's config while the routing table stays as it was; an ensemble has
    no workers, so reloading it alone with a new config left the table as it was, and the client
    with the old config for good. The table names each version's load now."""
    import shutil

    shutil.copytree(PRODUCT_MODELS / "add_sub", tmp_path / "add_sub", ignore=shutil.ignore_patterns("__pycache__"))

    def ensemble(dims: list[int]) -> dict:
        return {"name": "ens", "platform": "ensemble", "max_batch_size": 0,
                "input": [{"name": n, "data_type": "TYPE_INT32", "dims": [16]} for n in ("A", "B")],
                "output": [{"name": "SUM", "data_type": "TYPE_INT32", "dims": dims}],
                "ensemble_scheduling": {"step": [{"model_name": "add_sub", "model_version": -1,
                                                  "input_map": {"INPUT0": "A", "INPUT1": "B"},
                                                  "output_map": {"OUTPUT0": "SUM"}}]}}

    (tmp_path / "ens" / "1").mkdir(parents=True)
    (tmp_path / "ens" / "config.pbtxt").write_text("")
    server = server_factory.start([tmp_path], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    with server.client() as http:
        http.load_model("ens", config=json.dumps(ensemble([16])))
        with Client(server.id) as c:
            assert c.infer("ens", {"A": A, "B": B})["SUM"].tolist() == (A + B).tolist()
            assert c.model_config("ens")["output"][0]["dims"] == [16]
            http.load_model("ens", config=json.dumps(ensemble([-1])))
            assert c.model_config("ens")["output"][0]["dims"] == [-1]
            assert c.infer("ens", {"A": A, "B": B})["SUM"].tolist() == (A + B).tolist()


class Interrupted(Exception):
    """What a signal handler raises into a waiting call (as Ctrl-C raises KeyboardInterrupt)."""


def test_a_call_interrupted_while_it_waits_leaves_its_arena_whole(lc_server, tmp_path):
    """A synchronous call interrupted while it waits (Ctrl-C in a notebook) cancels its request
    and frees its answer unread when it comes: its block used to stay taken for good, and the
    FIFO arena behind it filled, so every call failed 'no room' after a few thousand more."""
    def interrupt(*_: object) -> None:
        raise Interrupted()

    gate = Gate(tmp_path / "gate")
    before = signal.signal(signal.SIGUSR1, interrupt)
    with Client(lc_server.id, arena_bytes=1 << 20) as c:
        try:
            threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1)).start()
            with pytest.raises(Interrupted):
                c.infer("slow_reader", {"X": A}, parameters={"sleep_s": 0, "gate": gate.param})
        finally:
            signal.signal(signal.SIGUSR1, before)
            gate.open()
        for _ in range(4000):  # (the 1 MiB arena wraps several times)
            assert c.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()
    wait_for(lambda: pending_requests(lc_server, "slow_reader") == 0, DEADLINE_S, "slow_reader idle")


def test_server_restart_gives_a_connected_client_a_clear_error(server_factory):
    first = start_shm_server(server_factory)
    old = Client(first.id)
    np.testing.assert_array_equal(old.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"], A + B)
    first.proc.send_signal(signal.SIGTERM)
    assert first.wait_exit(DEADLINE_S) == 0
    second = start_shm_server(server_factory, server_id=first.id)
    box = bounded(lambda: old.infer_async("add_sub", {"INPUT0": A, "INPUT1": B}).result(timeout=DEADLINE_S),
                  DEADLINE_S + 5)
    error = box.get("error")
    assert isinstance(error, (ServerUnavailable, InferenceServerError)), box
    assert first.id in str(error) and ("went away" in str(error) or "gone away" in str(error)), str(error)
    if isinstance(error, InferenceServerError):
        assert error.status == 503
    again = bounded(lambda: old.infer("add_sub", {"INPUT0": A, "INPUT1": B}), DEADLINE_S)
    assert isinstance(again.get("error"), (ServerUnavailable, InferenceServerError)), again
    with Client(second.id) as fresh:
        # Bounded: a request lost on the new server must fail this test, not hang the suite.
        answer = bounded(lambda: fresh.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT1"].copy(), DEADLINE_S)
        assert "value" in answer, f"the new server's client got no answer: {answer}"
        np.testing.assert_array_equal(answer["value"], A - B)
        server_objects = [n for n in shm_entries(second.id) if f".client.{process_ticket(second.id)[1]}-" not in n]
        assert bounded(old.close, DEADLINE_S) == {"value": None}  # closing the stale client is harmless...
        assert [n for n in shm_entries(second.id) if f".client.{process_ticket(second.id)[1]}-" not in n] == server_objects
        np.testing.assert_array_equal(fresh.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"], A + B)
    assert client_segments(second.id) == []


def test_sigkill_of_the_server_group_under_a_connected_client(server_factory, tmp_path):
    first = start_shm_server(server_factory)
    old = Client(first.id)
    region = old.create_region("lc_survivor", 4096)
    x = region.array(np.int32, (N,))
    x[:] = A
    gate = Gate(tmp_path / "gate")  # never opened: the server dies with the request in its model
    in_flight = old.infer_async("slow_reader", {"X": x}, parameters={"sleep_s": 0, "gate": gate.param})
    gate.wait_started(1)
    first.kill_group()
    box = bounded(lambda: in_flight.result(timeout=DEADLINE_S), DEADLINE_S + 5)
    error = box.get("error")
    assert isinstance(error, InferenceServerError) and error.status == 503, box
    assert "went away" in error.message
    stale = {}
    for name in shm_entries(first.id):
        try:
            stale[name] = os.stat(f"/dev/shm/{name}").st_ino
        except FileNotFoundError:
            pass
    assert any(".broker." in n for n in stale), stale  # SIGKILL left the server's objects behind
    second = start_shm_server(server_factory, server_id=first.id)
    now = {}
    for name in shm_entries(second.id):
        try:
            now[name] = os.stat(f"/dev/shm/{name}").st_ino
        except FileNotFoundError:
            pass
    assert [n for n, ino in stale.items() if now.get(n) == ino] == [], "stale objects survived"
    with Client(second.id) as fresh:
        assert http_region_names(second) == []  # registrations died with the old server
        r = fresh.infer("slow_reader", {"X": A}, parameters={"sleep_s": 0})
        assert r["SUM"].tolist() == [int(A.sum())]
    key = region.key
    del x
    assert bounded(old.close, DEADLINE_S) == {"value": None}
    assert shm_names(key.lstrip("/")) == [], "the client's own region outlived close()"
    with Client(second.id) as fresh:
        np.testing.assert_array_equal(fresh.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"], A + B)


UNMAP_DEAD_CLIENTS_S = 90.0  # workers look for dead clients every 10 s, once awake: up to ~20 s on an idle host


def test_killed_clients_segment_is_unmapped_by_the_server(lc_server, killed_clients, tmp_path):
    """Every server process lets go of a killed client's segment, so its memory is not pinned for
    the server's life. Runs last in this module, checking the clients killed earlier in it."""
    if not killed_clients:  # run on its own: kill one here
        gate = Gate(tmp_path / "gate")
        gate.open()  # (its request need not wait)
        proc, key = start_kid(lc_server.id, "plain", gate)
        (segment,) = [n for n in client_segments(lc_server.id, key_ticket(key))
                      if not n.startswith("sem.") and not n.endswith(".fifo")]
        kill_kid(proc, key)
        killed_clients.append((segment, time.monotonic()))
    for segment, killed_at in killed_clients:
        left = max(0.0, killed_at + UNMAP_DEAD_CLIENTS_S - time.monotonic())
        wait_for(lambda: processes_mapping(lc_server.tree(), segment) == [], left,
                 f"every server process unmaps the killed client's segment {segment}")



def test_a_worker_with_no_room_even_for_an_error_still_answers(server_factory):
    """A result held in a worker's output arena leaves it 0 to 1000 bytes: the next answer does
    not fit, and at some sizes not even its 503 does. The worker then completes the request
    without a block, which the client reads as NO_ROOM; before, the request was dropped and its
    caller waited forever. The same for a stream whose first response fills the arena."""
    server = start_shm_server(server_factory, ["--worker-arena-mb", "1", "--load-model", "word_stream"])
    tiny = np.array([b"x" * 300], dtype=object)  # its answer takes more room than its 503 would
    outcomes = set()
    blockless = 0
    began = time.monotonic()
    with Client(server.id) as c:
        for size in range((1 << 20) - 1000, (1 << 20) - 200, 8):
            held = c.infer("bytes_identity", {"IN": np.array([b"a" * size], dtype=object)})
            try:
                c.infer("bytes_identity", {"IN": tiny}, client_timeout=DEADLINE_S).release()
                outcomes.add("answered")
            except InferenceServerError as e:
                assert "no room" in str(e), (size, str(e))  # never 'Deadline Exceeded'
                outcomes.add("no room for the answer" if "has no room" in str(e) else str(e))
                blockless += str(e) == NO_ROOM
            held.release()
        assert outcomes == {"answered", "no room for the answer", NO_ROOM}, outcomes
        # Said in the log, with the count, at most once per 10 s (workers/answers.py): a line per
        # answer would flood it while a client holds the arena.
        said = [line for line in server.log().splitlines() if "output arena exhausted" in line]
        assert 1 <= len(said) <= 1 + (time.monotonic() - began) // 10 < blockless, (len(said), blockless)
        assert "answers its clients have not released yet" in said[0], said[0]
        assert (c.infer("bytes_identity", {"IN": tiny})["OUT"] == tiny).all()  # the arena is whole again

        outcomes.clear()
        for size in range((1 << 20) - 1000, (1 << 20) - 200, 8):
            text = np.array([b"a" * size + b" " + b"b" * 300], dtype=object)
            held = []
            try:
                for result in c.stream("word_stream", {"text_input": text}, wait_s=DEADLINE_S):
                    held.append(result)  # the first response stays in the arena meanwhile
                outcomes.add("answered")
            except InferenceServerError as e:
                assert "no room" in str(e), (size, str(e))  # never a stream left hanging
                outcomes.add("no room for the answer" if "has no room" in str(e) else str(e))
            for result in held:
                result.release()
        assert NO_ROOM in outcomes and "no room for the answer" in outcomes, outcomes


def test_a_long_running_client_never_runs_out_of_arena(lc_server):
    """Thousands of requests through a small arena (it wraps many times): results dropped by
    rebinding are freed at once, not left to the cyclic GC; one result stuck in an old GC
    generation used to stall the FIFO arena behind it, and the client then failed every request
    with 'no room'."""
    with Client(lc_server.id, arena_bytes=256 << 10) as c:
        for _ in range(3000):
            r = c.infer("add_sub", {"INPUT0": A, "INPUT1": B})
            assert (r["OUTPUT0"] == A + B).all()
        out = r["OUTPUT1"]
        del r
        assert (out == A - B).all()  # an array outlives its result, and keeps its blocks
        assert c._conn.arena.bytes_in_use < 16 << 10
