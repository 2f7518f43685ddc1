"""Triton's rate limiter against real servers: executions that need the same resource run one at
a time across models (per device and global), a larger count lets more run at once, priorities
weight the turns, a BLS call runs on its caller's resources (no deadlock), a model without
rate_limiter keeps its direct lanes, --rate-limit=off changes nothing, and bad flags and configs
are refused with Triton's texts.

The models (tests/models/ratelimit) leave a file per execution with its start and end on the
monotonic clock all processes share, and wait at a gate (tests/gates.py): what the tests check
follows from the order of events, not from how fast the host runs them.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import PYTHON, ROOT, cpu_ticks, wait_pending
from gates import Gate, pause

MODELS = Path(__file__).parent / "models" / "ratelimit"
# How long a test gives a wrongly started execution to show up before it checks that none did:
# a correct server passes whatever the host's speed; only a wrong one could slip through.
GRACE_S = 0.5


def explicit(*models: str) -> list[str]:
    return ["--model-control-mode=explicit", *(f"--load-model={m}" for m in models)]


@pytest.fixture(scope="module")
def limited(module_factory):
    """execution_count with the pools sized from the configs: R (per device) and G (global) have one copy each."""
    return module_factory.start([MODELS], ["--rate-limit=execution_count", *explicit(
        "rl_a", "rl_b", "rl_p1", "rl_p2", "rl_g1", "rl_g2", "rl_free", "rl_parent", "rl_child", "rl_seq")])


@pytest.fixture(scope="module")
def flagged(module_factory):
    """execution_count with R:1 and W:2 given on the command line."""
    return module_factory.start([MODELS], ["--rate-limit=execution_count", "--rate-limit-resource=R:1",
                                           "--rate-limit-resource", "W:2", *explicit("rl_a", "rl_w1", "rl_w2")])


def inputs(model: str) -> list[httpclient.InferInput]:
    shape = [1, 3] if model == "rl_b" else [3]  # rl_b batches
    x = httpclient.InferInput("X", shape, "INT32")
    x.set_data_from_numpy(np.arange(3, dtype=np.int32).reshape(shape))
    return [x]


def send(client: httpclient.InferenceServerClient, model: str, **params) -> object:
    return client.async_infer(model, inputs(model), parameters={k: str(v) for k, v in params.items()})


def runs(log: Path) -> list[tuple[str, int, int]]:
    """(model, start, end) of every execution that left its mark in ``log``, by start."""
    out = []
    for p in log.glob("run-*"):
        _, model, start, end = p.name.split("-")
        out.append((model, int(start), int(end)))
    return sorted(out, key=lambda r: r[1])


def overlapping(found: list[tuple[str, int, int]]) -> list[tuple]:
    return [(a, b) for i, a in enumerate(found) for b in found[i + 1:] if b[1] < a[2] and a[1] < b[2]]


def routes(server) -> dict:
    from shmserve.shm.channel import BrokerSegment

    broker = BrokerSegment.attach(server.id)
    try:
        return orjson.loads(broker.routes.read()[1])["models"]
    finally:
        broker.close()


@contextlib.contextmanager
def gated(server, gate: Gate, concurrency: int) -> Iterator[httpclient.InferenceServerClient]:
    """A client for requests held at ``gate``; the gate opens when the block ends, whatever
    happened (a failed check must not leave an execution waiting)."""
    client = httpclient.InferenceServerClient(server.url, concurrency=concurrency, network_timeout=120)
    try:
        yield client
    finally:
        gate.open()
        client.close()


def no_more_starts(gate: Gate, count: int) -> bool:
    """Whether ``gate`` still has ``count`` starts after GRACE_S (a start that must not come)."""
    deadline = time.monotonic() + GRACE_S
    while time.monotonic() < deadline:
        if len(gate.started()) > count:
            return False
        pause(0.02)  # (a request still to be sent must get its chance to start: gates.pause)
    return len(gate.started()) == count


@pytest.fixture
def folders(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    return Gate(tmp_path / "gate"), log


def test_rate_limited_versions_go_through_the_broker(limited):
    table = routes(limited)
    assert table["rl_a"]["1"]["direct"] is False
    assert table["rl_b"]["1"]["direct"] is False  # one batching instance: on its worker's lanes without the limiter
    assert table["rl_free"]["1"]["direct"] is True


@pytest.mark.parametrize("first, second", [("rl_a", "rl_b"), ("rl_g1", "rl_g2")], ids=["per-device", "global"])
def test_models_sharing_a_count_1_resource_run_one_at_a_time(limited, folders, first, second):
    gate, log = folders
    with gated(limited, gate, 2) as client:
        held = send(client, first, gate=gate.param, log=log)
        gate.wait_started(1)
        waiting = send(client, second, gate=gate.param, log=log)
        wait_pending(limited, second, 1)  # the broker has it, and waits for the resource
        assert no_more_starts(gate, 1)
        gate.open()
        for handle in (held, waiting):
            np.testing.assert_array_equal(handle.get_result().as_numpy("Y").ravel(), [0, 1, 2])
    found = runs(log)
    assert [r[0] for r in found] == [first, second]
    assert found[0][2] <= found[1][1]  # the second started once the first was done


def test_many_executions_of_two_models_never_overlap(limited, folders):
    gate, log = folders
    with gated(limited, gate, 12) as client:
        handles = [send(client, model, log=log, sleep_s=0.02) for _ in range(6) for model in ("rl_a", "rl_b")]
        for handle in handles:
            handle.get_result()
    found = runs(log)
    assert {r[0] for r in found} == {"rl_a", "rl_b"}
    assert overlapping(found) == []


def test_the_broker_sleeps_while_a_batch_waits_for_its_resource(limited, folders):
    """rl_b's batch is due at once (no delay) but waits for R: the broker sleeps until rl_a's
    finish gives R back instead of spinning on the due batch (a spinning broker takes what it can
    of a core: tens of percent even on a loaded host; a sleeping one next to nothing)."""
    gate, log = folders
    (broker,) = [pid for pid, title in limited.titles().items() if title.startswith("shmserve broker")]
    with gated(limited, gate, 2) as client:
        held = send(client, "rl_a", gate=gate.param)
        gate.wait_started(1)
        waiting = send(client, "rl_b", log=log)
        wait_pending(limited, "rl_b", 1)
        before, started = cpu_ticks([broker])[broker], time.monotonic()
        time.sleep(2.0)  # (a window to measure in, not a wait for something to happen)
        used = (cpu_ticks([broker])[broker] - before) / os.sysconf("SC_CLK_TCK") / (time.monotonic() - started)
        assert used < 0.1, f"the broker used {100 * used:.0f}% of a core while the batch waited"
        gate.open()
        held.get_result()
        waiting.get_result()
    assert [r[0] for r in runs(log)] == ["rl_b"]


def test_a_model_without_rate_limiter_is_unaffected(limited, folders):
    gate, log = folders
    with gated(limited, gate, 2) as client:
        held = send(client, "rl_a", gate=gate.param, log=log)
        gate.wait_started(1)
        free = client.infer("rl_free", inputs("rl_free"), parameters={"log": str(log)})  # while R is held
        np.testing.assert_array_equal(free.as_numpy("Y"), [0, 1, 2])
        assert [r[0] for r in runs(log)] == ["rl_free"]  # rl_a still waits at its gate
        gate.open()
        held.get_result()


def test_priority_2_gets_half_the_turns_of_priority_1(limited, folders):
    """Both models wait with work queued while rl_a holds R; once R is free, the turns go by
    priority-weighted counts: of the first nine, Triton's rule gives priority 1 six."""
    gate, log = folders
    with gated(limited, gate, 20) as client:
        held = send(client, "rl_a", gate=gate.param)
        gate.wait_started(1)
        handles = [send(client, model, log=log) for _ in range(9) for model in ("rl_p1", "rl_p2")]
        wait_pending(limited, "rl_p1", 9)
        wait_pending(limited, "rl_p2", 9)
        gate.open()
        held.get_result()
        for handle in handles:
            handle.get_result()
    order = [r[0] for r in runs(log)]
    assert len(order) == 18 and overlapping(runs(log)) == []
    first = order[:9]  # both still had work queued for each of these turns
    assert 5 <= first.count("rl_p1") <= 7, order
    assert 2 <= first.count("rl_p2") <= 4, order


def test_a_bls_call_runs_on_its_callers_resources(limited, folders):
    """rl_parent holds the only copy of R while it calls rl_child, which needs R too: the call
    runs on what its caller holds instead of waiting for it forever. rl_a, sent while the parent
    held R, still waits for the parent to finish."""
    gate, log = folders
    with gated(limited, gate, 2) as client:
        parent = send(client, "rl_parent", gate=gate.param, log=log)
        gate.wait_started(1)
        other = send(client, "rl_a", log=log)
        wait_pending(limited, "rl_a", 1)
        gate.open()
        np.testing.assert_array_equal(parent.get_result().as_numpy("Y"), [0, 1, 2])
        other.get_result()
    found = {model: (start, end) for model, start, end in runs(log)}
    assert set(found) == {"rl_parent", "rl_child", "rl_a"}
    assert found["rl_parent"][0] <= found["rl_child"][0] and found["rl_child"][1] <= found["rl_parent"][1]
    assert found["rl_a"][0] >= found["rl_parent"][1]


def test_a_sequence_model_waits_for_its_resource_and_keeps_its_state(limited, folders, tmp_path):
    gate, log = folders
    marks = Gate(tmp_path / "marks")
    marks.open()  # (an open gate only marks when the sequence's steps started)
    with gated(limited, gate, 2) as client:
        def step(value: int, start: bool = False, end: bool = False):
            x = httpclient.InferInput("VALUE", [1, 1], "INT32")
            x.set_data_from_numpy(np.array([[value]], np.int32))
            return client.async_infer("rl_seq", [x], sequence_id=77, sequence_start=start, sequence_end=end,
                                      parameters={"gate": marks.param})

        assert step(1, start=True).get_result().as_numpy("SUM").ravel().tolist() == [1]
        held = send(client, "rl_a", gate=gate.param, log=log)
        gate.wait_started(1)
        waiting = step(2)
        wait_pending(limited, "rl_seq", 1)
        gate.open()
        held.get_result()
        assert waiting.get_result().as_numpy("SUM").ravel().tolist() == [3]
        assert step(3, end=True).get_result().as_numpy("SUM").ravel().tolist() == [6]
    (rl_a,) = runs(log)
    second_step = sorted(int(p.name.split("-")[2]) for p in marks.folder.glob("started-*"))[1]
    assert second_step >= rl_a[2]


def run_at_once(server, models: tuple[str, ...], gate: Gate) -> None:
    """One request to each model, held at ``gate``: every one must start before it opens."""
    with gated(server, gate, len(models)) as client:
        handles = [send(client, model, gate=gate.param) for model in models]
        assert len(gate.wait_started(len(models))) == len(models)
        gate.open()
        for handle in handles:
            handle.get_result()


def test_a_count_2_resource_lets_two_run_at_once(flagged, folders):
    run_at_once(flagged, ("rl_w1", "rl_w2"), folders[0])  # each holds one of the two copies of W


@pytest.mark.parametrize("model, error", [
    ("rl_big", 'Resource count for "R" is limited to 1 which will prevent scheduling of one or more model '
               'instances, the minimum required count is 2'),
    ("rl_g1", 'Resource count for "G" is limited to 0 which will prevent scheduling of one or more model '
              'instances, the minimum required count is 1'),
    ("rl_global_r", 'Resource "R" is present as both global and device-specific resource in the model '
                    'configuration.'),
])
def test_a_config_the_resources_cannot_serve_fails_to_load(flagged, model, error):
    client = flagged.client()
    with pytest.raises(InferenceServerException) as e:
        client.load_model(model)
    assert error in str(e.value)
    assert not client.is_model_ready(model)
    assert client.is_model_ready("rl_a")


def test_rate_limit_off_changes_nothing(server_factory, folders):
    """The default, as Triton's: rate_limiter blocks load without a warning and have no effect,
    resource flags included, and the models keep their direct lanes."""
    server = server_factory.start([MODELS], ["--rate-limit-resource=R:0", *explicit("rl_a", "rl_big")])
    run_at_once(server, ("rl_a", "rl_big"), folders[0])  # R:0, and they need three copies between them
    assert routes(server)["rl_a"]["1"]["direct"] is True
    assert "rate_limiter" not in server.log()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "shmserve", "--model-repository", str(MODELS), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("flag, error", [
    ("--rate-limit=sometimes", "invalid argument for --rate-limit: 'sometimes'"),
    ("--rate-limit-resource=R", "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
                                "'<resource_name>:<count>'. Got R"),
    ("--rate-limit-resource=R:two", "Got R:two (count and device must be integers)"),
    ("--rate-limit-resource=R:1:0:1", "Got R:1:0:1"),
    ("--rate-limit-resource=R:-1", "Got R:-1 (count and device must be 0 or more)"),
    ("--rate-limit-resource=:1", "Got :1"),
])
def test_bad_rate_limit_flags_stop_the_server_at_start(flag, error):
    r = run_cli(flag)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.startswith("shmserve: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert error in r.stderr


def test_help_describes_the_rate_limit_flags():
    r = run_cli("--help")
    assert r.returncode == 0 and "--rate-limit " in r.stdout and "--rate-limit-resource" in r.stdout
