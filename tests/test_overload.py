"""Overload: past the bounds (requests in flight per frontend, the frontend's arena) requests get a
503 with a clear message at once, nothing queues without bound, and the server serves normally
as soon as the load drops."""
from __future__ import annotations

import concurrent.futures
import threading
import time

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TESTS, TEST_MODELS

SHM_MODELS = TESTS / "models" / "shm"


def sleeper(url: str) -> str:
    """'ok' or the error's status and message (0.3 s per request, two instances)."""
    client = httpclient.InferenceServerClient(url, network_timeout=60)
    try:
        x = httpclient.InferInput("X", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, dtype=np.float32))
        client.infer("sleeper", [x])
        return "ok"
    except InferenceServerException as e:
        return f"{e.status()} {e.message()}"
    finally:
        client.close()


def test_requests_past_the_inflight_bound_get_503_and_service_recovers(server_factory):
    server = server_factory.start([TEST_MODELS], ["--http-max-inflight", "6"])
    barrier = threading.Barrier(30)  # all at once: far more than 6 in flight

    def at_once(_: int) -> str:
        barrier.wait()
        return sleeper(server.url)

    with concurrent.futures.ThreadPoolExecutor(30) as pool:
        outcomes = list(pool.map(at_once, range(30)))
    ok = outcomes.count("ok")
    refused = [o for o in outcomes if o != "ok"]
    # Refused, not queued: with no bound all 30 would have waited their turn and succeeded.
    assert ok >= 6 and refused, outcomes
    # (the frontend's slots are shared by all its clients: the text names the flag that sets them)
    assert set(refused) == {"503 the server is overloaded (6 requests in flight in this frontend, its "
                            "--http-max-inflight); retry later"}, refused
    assert [sleeper(server.url) for _ in range(4)] == ["ok"] * 4  # recovered at once: none refused


def test_requests_past_the_frontend_arena_get_503(server_factory):
    server = server_factory.start([SHM_MODELS], ["--frontend-arena-mb", "4"])
    big = np.ones(700_000, dtype=np.int32)  # 2.8 MB: one fits the 4 MiB arena, two do not

    def slow_sum() -> str:
        client = httpclient.InferenceServerClient(server.url, network_timeout=60)
        try:
            x = httpclient.InferInput("X", [big.size], "INT32")
            x.set_data_from_numpy(big)
            return str(int(client.infer("slow_reader", [x]).as_numpy("SUM")[0]))
        except InferenceServerException as e:
            return f"{e.status()} {e.message()}"
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        outcomes = list(pool.map(lambda _: slow_sum(), range(4)))
    assert str(big.size) in outcomes, outcomes
    refused = [o for o in outcomes if o != str(big.size)]
    assert refused and all(o.startswith("503 the server is overloaded (no room for a") for o in refused), outcomes
    assert slow_sum() == str(big.size)  # with the arena free again it serves


def test_a_request_that_meets_a_held_block_waits_for_it_rather_than_503(server_factory, tmp_path):
    """The arena is far from full by volume, but its space is cut by one request held in a model
    (slow_reader behind a gate) at its start: the request that comes round to it waits for the
    block to come back, up to a second, instead of a 503 that would refuse load the server can
    take. Its wait is ended by the held request finishing, and every request is served."""
    from gates import Gate

    server = server_factory.start([SHM_MODELS], ["--frontend-arena-mb", "4"])
    gate = Gate(tmp_path / "gate")
    block = np.ones(200_000, dtype=np.int32)  # 0.8 MB: five fill the 4 MiB arena

    def call(model: str, parameters: dict | None = None) -> str:
        client = httpclient.InferenceServerClient(server.url, network_timeout=60)
        try:
            x = httpclient.InferInput("X", [block.size], "INT32")
            x.set_data_from_numpy(block)
            client.infer(model, [x], parameters=parameters)
            return "ok"
        except InferenceServerException as e:
            return f"{e.status()} {e.message()}"
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        held = pool.submit(call, "slow_reader", {"gate": gate.param, "sleep_s": 0})
        gate.wait_started()
        in_flight_since: list[float] = []
        outcomes: list[str] = []

        def send_in_turn() -> None:
            for _ in range(6):  # the fifth meets the held block
                in_flight_since.append(time.monotonic())
                outcomes.append(call("meta_echo"))

        sender = pool.submit(send_in_turn)
        # Open the gate once a request has been in flight for 0.1 s: it is waiting for the room.
        while not sender.done() and not (len(in_flight_since) > len(outcomes)
                                         and time.monotonic() - in_flight_since[-1] > 0.1):
            time.sleep(0.01)
        gate.open()
        sender.result(60)
        assert held.result(60) == "ok"
    assert outcomes == ["ok"] * 6, outcomes
