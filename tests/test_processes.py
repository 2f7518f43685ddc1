"""Process lifecycle: clean SIGTERM, recovery after SIGKILL, one server per id, idle CPU."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import (PRODUCT_MODELS, PYTHON, TEST_MODELS, cmdline, cpu_ticks, descendants, pid_alive, shm_entries,
                      stat_fields)


def _add_sub_inputs(a: np.ndarray) -> list[httpclient.InferInput]:
    """add_sub's two inputs, both ``a``."""
    inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    return inputs


def _add_sub(server) -> None:
    a = np.arange(16, dtype=np.int32)
    c = server.client()
    i0, i1 = _add_sub_inputs(a)
    np.testing.assert_array_equal(c.infer("add_sub", [i0, i1]).as_numpy("OUTPUT0"), 2 * a)
    c.close()


def _inodes(server_id: str) -> dict[str, int]:
    out = {}
    for name in shm_entries(server_id):
        try:
            out[name] = os.stat(f"/dev/shm/{name}").st_ino
        except FileNotFoundError:
            pass
    return out


def test_sigterm_exits_zero_and_leaves_nothing(server_factory):
    s = server_factory.start([PRODUCT_MODELS, TEST_MODELS])
    _add_sub(s)  # so that a frontend channel and worker output blocks exist
    tree = s.tree()
    assert len(tree) >= 3 + 7, tree  # launcher, broker, frontend and the 7 workers (sleeper has 2)
    assert shm_entries(s.id), "a running server should own shared-memory objects"
    s.proc.send_signal(signal.SIGTERM)
    code = s.wait_exit(30)
    assert code == 0, s.log_tail()
    assert shm_entries(s.id) == []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(pid_alive(p) for p in tree):
        time.sleep(0.05)
    assert [p for p in tree if pid_alive(p)] == [], "processes outlived the launcher"
    assert "Traceback" not in s.log(), s.log_tail()


def test_sigint_exits_zero_and_leaves_nothing(server_factory):
    s = server_factory.start([PRODUCT_MODELS])
    _add_sub(s)
    s.proc.send_signal(signal.SIGINT)
    assert s.wait_exit(30) == 0, s.log_tail()
    assert shm_entries(s.id) == []


def test_every_process_writes_its_profile_when_the_server_stops(server_factory, tmp_path, monkeypatch):
    """SHMSERVE_PROFILE (shm/profiling.py): launcher's children each write a cProfile dump at a
    clean stop. The HTTP frontend's was lost: uvicorn raises the signal it stopped on again once
    it has shut down, and the default handler ended the process before the dump."""
    import pstats

    folder = tmp_path / "profiles"
    monkeypatch.setenv("SHMSERVE_PROFILE", str(folder))
    s = server_factory.start([PRODUCT_MODELS], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    _add_sub(s)
    s.proc.send_signal(signal.SIGTERM)
    assert s.wait_exit(30) == 0, s.log_tail()
    kinds = sorted(p.name.rsplit("-", 1)[0] for p in folder.glob("*.prof"))
    assert kinds == ["broker", "frontend0", "grpc", "worker-add_sub"], kinds
    frontend = pstats.Stats(str(next(folder.glob("frontend0-*.prof"))))
    assert any(name == "infer" for _, _, name in frontend.stats), "the frontend's dump holds the request"


def test_restart_after_sigkill_of_the_whole_group_removes_stale_objects(server_factory):
    first = server_factory.start([PRODUCT_MODELS])
    _add_sub(first)
    first.kill_group()
    stale = _inodes(first.id)
    assert stale, "SIGKILL cannot clean up: stale objects are expected at this point"

    second = server_factory.start([PRODUCT_MODELS], server_id=first.id)
    _add_sub(second)
    now = _inodes(second.id)
    # Every stale object is either gone or was removed and created anew (another inode).
    survivors = [name for name, ino in stale.items() if now.get(name) == ino]
    assert survivors == [], f"stale objects of the killed server survived: {survivors}"

    second.proc.send_signal(signal.SIGTERM)
    assert second.wait_exit(30) == 0
    assert shm_entries(first.id) == []


def test_second_server_with_same_id_is_refused(server_factory):
    first = server_factory.start([PRODUCT_MODELS])
    before = _inodes(first.id)
    second = server_factory.create([PRODUCT_MODELS], server_id=first.id).start()
    code = second.wait_exit(30)
    assert code != 0
    log = second.log()
    # The pid named is the launcher's, which stops the server (a broker killed alone restarts).
    assert f"a server with id '{first.id}' is already running (pid {first.pid})" in log, log
    # The first server is untouched: same objects, still serving.
    after = _inodes(first.id)
    assert {n: i for n, i in before.items() if n in after} == {n: i for n, i in after.items() if n in before}
    assert all(name in after for name in before if ".broker." in name or ".worker." in name)
    _add_sub(first)
    assert first.client().is_server_ready()


def test_a_live_server_is_known_by_its_broker_ticket_not_by_its_objects(server_factory):
    """A second launcher under a live server's id that cannot map all of its objects (one it does
    not expect, one missing) must still see that it lives, by the broker's ticket, and remove
    nothing: it once took 'cannot attach' for 'dead' and unlinked a serving server's objects."""
    first = server_factory.start([PRODUCT_MODELS])
    tables = f"/dev/shm/shmserve.{first.id}.tables.0"
    os.rename(tables, tables + ".away")
    try:
        second = server_factory.create([PRODUCT_MODELS], server_id=first.id).start()
        assert second.wait_exit(30) != 0
        assert "already running" in second.log(), second.log()
        assert os.path.exists(f"/dev/shm/shmserve.{first.id}.broker.0")
    finally:
        os.rename(tables + ".away", tables)
    _add_sub(first)


def test_an_idle_server_uses_next_to_no_cpu(server, client):
    """An idle server sleeps: under 3% of a core for the whole tree (about 1% on a quiet host; a
    polling or ticking thread would show tens of percent), with margin for clock-tick sampling and
    for wake-ups charged late on a loaded VM."""
    # Some traffic first, so that idle means "after work", not just "after start".
    a = np.arange(16, dtype=np.int32)
    for _ in range(20):
        client.infer("add_sub", _add_sub_inputs(a))
    time.sleep(1.0)  # let spinning thread pools (torch, OpenMP) go to sleep
    tree = [server.pid, *descendants(server.pid)]
    assert len(tree) >= 10, tree
    hz = os.sysconf("SC_CLK_TCK")
    t0 = time.monotonic()
    before = cpu_ticks(tree)
    time.sleep(6.0)  # long enough that 1% is 6 clock ticks: one stray tick is not a verdict
    after = cpu_ticks([server.pid, *descendants(server.pid)])
    elapsed = time.monotonic() - t0
    used = sum(ticks - before.get(pid, 0) for pid, ticks in after.items()) / hz
    per_process = {f"{pid} {cmdline(pid)[:40]}": after[pid] - before.get(pid, 0)
                   for pid in after if after[pid] - before.get(pid, 0)}
    assert used / elapsed < 0.03, f"idle server used {100 * used / elapsed:.2f}% CPU; ticks by process: {per_process}"


def _sleeps(pid: int) -> int:
    """How often the process's main thread blocked (its voluntary context switches)."""
    with open(f"/proc/{pid}/task/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def _idle_core_shown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers started from now on read a run queue with a core idle (shm/waker.py ``RunQueue``):
    nobody polls while none is, and this shared host cannot promise one."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.10 0.10 0.10 1/200 4242\n")
    monkeypatch.setenv("SHMSERVE_TEST_LOADAVG", str(loadavg))


@pytest.mark.parametrize("poll_us, polls", [(200_000, True), (0, False)])
def test_poll_us_decides_whether_frontend_and_worker_poll(server_factory, tmp_path, monkeypatch, poll_us, polls):
    """``--poll-us`` reaches the frontend and the worker. With a generous budget (so that on a slow
    CI host each answer and each next request still come within it) the next request of a client
    in a closed loop finds both awake: neither sleeps between requests. With 0 both sleep between
    requests (the control: the count below does see those sleeps), and every answer is still
    right."""
    _idle_core_shown(tmp_path, monkeypatch)
    s = server_factory.start([PRODUCT_MODELS], ["--poll-us", str(poll_us)])
    frontend = next(pid for pid, t in s.titles().items() if t.startswith("shmserve frontend "))
    worker = s.worker_pids("add_sub")[0]
    c = s.client()
    a = np.arange(16, dtype=np.int32)
    i0, i1 = _add_sub_inputs(a)
    for _ in range(100):  # warm up: the first requests after start-up let the frontend sleep a few
        c.infer("add_sub", [i0, i1])  # times more (10-24 in 200, measured), the steady state is what counts
    n = 200
    before, worker_before = _sleeps(frontend), _sleeps(worker)
    for _ in range(n):
        result = c.infer("add_sub", [i0, i1])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 0 * a)
    slept, worker_slept = _sleeps(frontend) - before, _sleeps(worker) - worker_before
    c.close()
    # Measured here: 0 sleeps when they poll; about once per request each without (a fast
    # client's next request is sometimes there before the loop gets to sleep).
    if polls:
        assert slept < n // 10, f"the frontend slept {slept} times in {n} closely following requests"
        assert worker_slept < n // 10, f"the worker slept {worker_slept} times in {n} closely following requests"
    else:
        assert slept >= n // 4, f"with --poll-us 0 the frontend should sleep between requests, slept {slept}"
        assert worker_slept >= n // 4, f"with --poll-us 0 the worker should sleep between requests, slept {worker_slept}"
    time.sleep(0.5)
    hz = os.sysconf("SC_CLK_TCK")
    before_cpu = cpu_ticks([frontend])[frontend]
    time.sleep(2.0)
    used = (cpu_ticks([frontend])[frontend] - before_cpu) / hz
    assert used < 0.1, f"once the requests stopped the frontend should sleep, but it used {used:.2f} s of CPU in 2 s"


@pytest.mark.parametrize("poll_us, polls", [(100_000, False), (1_000_000, True)])
def test_frontend_does_not_poll_for_a_model_whose_answers_are_slow(server_factory, tmp_path, monkeypatch, poll_us,
                                                                   polls):
    """Once the frontend has seen a model answer more slowly than --poll-us (the sleeper: 0.3 s
    against 0.1 s), it waits for that model's answers asleep; the control, with a budget above
    0.3 s, polls through every request."""
    repo = tmp_path / "repo"
    shutil.copytree(TEST_MODELS / "sleeper", repo / "sleeper")
    _idle_core_shown(tmp_path, monkeypatch)
    s = server_factory.start([repo], ["--poll-us", str(poll_us)])
    frontend = next(pid for pid, t in s.titles().items() if t.startswith("shmserve frontend "))
    c = s.client()
    i0 = httpclient.InferInput("X", [1], "FP32")
    i0.set_data_from_numpy(np.array([1.0], dtype=np.float32))
    c.infer("sleeper", [i0])  # the first answer of a model is polled for: its time is unknown
    hz = os.sysconf("SC_CLK_TCK")
    before, slept_before = cpu_ticks([frontend])[frontend], _sleeps(frontend)
    t0 = time.monotonic()
    for _ in range(3):
        assert c.infer("sleeper", [i0]).as_numpy("PID")[0] in s.worker_pids("sleeper")
    elapsed = time.monotonic() - t0
    used = (cpu_ticks([frontend])[frontend] - before) / hz
    c.close()
    slept = _sleeps(frontend) - slept_before
    if polls:  # a polling loop yields the CPU but never blocks, however busy the host is
        assert slept < 3, f"the control should poll through the requests, but its loop blocked {slept} times"
    else:
        assert slept >= 3, f"the frontend should wait for each slow answer asleep; it blocked {slept} times"
        assert used / elapsed < 0.1, f"the frontend polled for slow answers: {used:.2f} s of CPU in {elapsed:.2f} s"


def test_frontend_stops_polling_while_a_request_runs_long(server, client):
    """The frontend polls for answers only while they keep coming: a request that runs for
    seconds must cost it no more than a sleeping loop would, and still be answered (the worker
    then wakes it through its FIFO)."""
    frontends = [pid for pid, t in server.titles().items() if t.startswith("shmserve frontend ")]
    assert frontends
    hz = os.sysconf("SC_CLK_TCK")
    before = cpu_ticks(frontends)
    t0 = time.monotonic()
    for k in range(4):  # 0.3 s each
        i0 = httpclient.InferInput("X", [1], "FP32")
        i0.set_data_from_numpy(np.array([float(k)], dtype=np.float32))
        result = client.infer("sleeper", [i0])
        assert result.as_numpy("PID")[0] in server.worker_pids("sleeper")
    elapsed = time.monotonic() - t0
    assert elapsed >= 1.2
    used = sum(ticks - before.get(pid, 0) for pid, ticks in cpu_ticks(frontends).items()) / hz
    assert used / elapsed < 0.05, f"the frontend used {100 * used / elapsed:.1f}% CPU while 4 slow requests ran"


def _kill_launcher_and_see_it_followed(server, tree: list[int], within_s: float) -> None:
    """SIGKILL the launcher alone: every process of ``tree`` follows it within ``within_s``, and
    nothing of the server is left in /dev/shm."""
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(10)
    killed = time.monotonic()
    while time.monotonic() - killed < 4 * within_s and any(pid_alive(p) for p in tree):
        time.sleep(0.02)
    took = time.monotonic() - killed
    assert [p for p in tree if pid_alive(p)] == [], "processes outlived the launcher"
    assert took < within_s, f"the server's processes took {took:.2f} s to follow the launcher"
    assert shm_entries(server.id) == []


def test_sigkill_of_the_launcher_alone_leaves_no_process_and_nothing_in_dev_shm(server_factory):
    """The OOM killer or a supervisor's SIGKILL ends only the launcher: every other process of
    the server follows it (the kernel signals them), the broker removes the server's objects, and
    the next start under the same id and ports works."""
    first = server_factory.start([PRODUCT_MODELS])
    _add_sub(first)
    tree = [p for p in first.tree() if p != first.pid]
    assert len(tree) >= 3, tree  # broker, frontend(s), workers
    _kill_launcher_and_see_it_followed(first, tree, within_s=2.0)

    second = server_factory.create([PRODUCT_MODELS], server_id=first.id, http_port=first.port)
    second.metrics_port, second.grpc_port = first.metrics_port, first.grpc_port
    second.start().wait_ready()
    _add_sub(second)


def test_a_launcher_killed_while_the_server_drains_takes_the_server_with_it_at_once(server_factory, tmp_path):
    """SIGTERM starts the drain, which would wait --exit-timeout-secs for a request held in its
    model; a SIGKILL of the launcher meanwhile ends it: the broker stops at once, as when the
    launcher dies at any other time, and leaves nothing behind."""
    import threading

    from conftest import SHM_MODELS
    from gates import Gate

    s = server_factory.start([SHM_MODELS])
    gate = Gate(tmp_path / "gate")

    def held() -> None:  # (its answer never comes: its frontend goes with the launcher)
        client = httpclient.InferenceServerClient(s.url, network_timeout=60)
        x = httpclient.InferInput("X", [4], "INT32")
        x.set_data_from_numpy(np.ones(4, dtype=np.int32))
        try:
            client.infer("slow_reader", [x], parameters={"gate": gate.param, "sleep_s": 0})
        except Exception:  # noqa: BLE001
            pass

    caller = threading.Thread(target=held, daemon=True)
    caller.start()
    try:
        gate.wait_started()
        tree = [p for p in s.tree() if p != s.pid]
        os.kill(s.pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while "waiting up to" not in s.log() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "waiting up to" in s.log(), s.log_tail()  # the broker drains
        _kill_launcher_and_see_it_followed(s, tree, within_s=5.0)
    finally:
        gate.open()


def test_a_stopped_worker_does_not_outlive_the_broker_that_died(server_factory):
    """A worker that cannot act on the SIGTERM its broker's death sends it (stopped here, as a
    model stuck in C code would be) is adopted by the launcher and killed, not left holding the
    server's memory; the restarted broker's worker serves meanwhile."""
    s = server_factory.start([PRODUCT_MODELS])
    _add_sub(s)
    worker = s.worker_pids("add_sub")[0]
    broker = next(p for p, t in s.titles().items() if t.startswith("shmserve broker "))
    os.kill(worker, signal.SIGSTOP)
    os.kill(broker, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and pid_alive(worker):
        time.sleep(0.1)
    assert not pid_alive(worker), f"the stopped worker outlived its broker:\n{s.log_tail()}"
    assert "outlived its parent" in s.log()
    s.wait_ready()
    _add_sub(s)


def _live_in_group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that have not exited (zombies left out), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None and int(fields[2]) == pgid and fields[0] != b"Z":
                out.append(int(entry))
    return out


def test_a_stopped_worker_adopted_by_the_launcher_is_killed_when_the_launcher_stops(server_factory):
    """A worker that cannot act on the SIGTERM its broker's death sends it (stopped here) is
    adopted by the launcher, which kills it 10 s later; a launcher stopped before then kills it as
    it stops (``Adopted.kill_workers``), not leaving it behind, stopped for ever with the
    server's memory mapped, for init to inherit."""
    s = server_factory.start([PRODUCT_MODELS])
    _add_sub(s)
    worker = s.worker_pids("add_sub")[0]
    broker = next(p for p, t in s.titles().items() if t.startswith("shmserve broker "))
    tree = s.tree()
    os.kill(worker, signal.SIGSTOP)
    os.kill(broker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and int(stat_fields(worker)[1]) != s.pid:
        time.sleep(0.01)
    assert int(stat_fields(worker)[1]) == s.pid, "the launcher did not adopt the worker"
    adopted = time.monotonic()
    os.kill(s.pid, signal.SIGTERM)
    code = s.wait_exit(30)
    took = time.monotonic() - adopted
    left = [p for p in tree if pid_alive(p)] + [p for p in _live_in_group(s.pid) if p not in tree]
    assert left == [], (f"processes outlived the launcher's stop: "
                        f"{ {p: (cmdline(p), stat_fields(p)[0]) for p in left} }\n{s.log_tail()}")
    assert code == 0, s.log_tail()
    assert took < 9.0, f"the launcher took {took:.1f} s to stop after it adopted the worker"  # (not its 10 s)
    assert "outlived its parent: killed as the server stops" in s.log(), s.log_tail()
    assert shm_entries(s.id) == []


def test_a_busy_port_names_the_process_that_holds_it(server_factory, tmp_path):
    holder = subprocess.Popen([PYTHON, "-c", "import socket, time\ns = socket.socket()\n"
                               "s.bind(('127.0.0.1', 0))\ns.listen()\nprint(s.getsockname()[1], flush=True)\n"
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(holder.stdout.readline())
        s = server_factory.create([tmp_path], http_port=port).start()
        assert s.wait_exit(60) != 0
        assert (f"cannot bind HTTP to 127.0.0.1:{port}: Address already in use (held by pid {holder.pid}: "
                f"{PYTHON} -c import socket") in s.log(), s.log()
    finally:
        holder.kill()
        holder.wait()


STUCK_MODEL = '''
import json
import time


class TritonPythonModel:
    def execute(self, requests):
        open(json.loads(requests[0].parameters())["mark"], "w").close()
        while True:  # never returns: a model stuck in a call that does not come back
            time.sleep(0.05)
'''
STUCK_CONFIG = '''name: "stuck"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
'''


@pytest.mark.parametrize("how", ["sigterm", "broker_killed"])
def test_a_worker_stuck_in_execute_does_not_outlive_its_server(server_factory, tmp_path, how):
    """A model that never returns from execute(): when the server stops (its drain and the
    broker's wait for its workers run out) or its broker dies, the stuck worker is killed, not
    left behind as an orphan holding the server's memory. Stopped, the whole server is gone about
    --exit-timeout-secs after the signal, as Triton: the stuck worker is killed at its end, not
    after a grace of its own (it was 5 s more)."""
    (tmp_path / "repo" / "stuck" / "1").mkdir(parents=True)
    (tmp_path / "repo" / "stuck" / "config.pbtxt").write_text(STUCK_CONFIG)
    (tmp_path / "repo" / "stuck" / "1" / "model.py").write_text(STUCK_MODEL)
    s = server_factory.start([tmp_path / "repo"], ["--exit-timeout-secs", "1"])
    worker = s.worker_pids("stuck")[0]
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([1], dtype=np.int32))
    client = httpclient.InferenceServerClient(s.url, network_timeout=120)
    mark = tmp_path / "executing"
    sent = client.async_infer("stuck", [x], parameters={"mark": str(mark)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not mark.exists():
        time.sleep(0.02)
    assert mark.exists(), "the request did not reach execute()"
    if how == "sigterm":
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.wait_exit(60) == 0, s.log_tail()
        took = time.monotonic() - start
        # the flag, the workers' least grace (1 s) and what a loaded host adds; the old grace took over 7 s
        assert took < 1 + 1 + 3.5, f"the server took {took:.1f} s to stop with --exit-timeout-secs 1\n{s.log_tail()}"
    else:
        broker = next(p for p, t in s.titles().items() if t.startswith("shmserve broker"))
        os.kill(broker, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and pid_alive(worker):
        time.sleep(0.05)
    assert not pid_alive(worker), f"the stuck worker {worker} outlived its {'server' if how == 'sigterm' else 'broker'}"
    with pytest.raises(Exception):
        sent.get_result()
    client.close()


# -- names another user made first in /dev/shm (sticky, world-writable) ---------------------------

SQUAT_FILES = """
for path in args:
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
result = len(args)
"""


def _squat_dir(path: Path) -> None:
    """A non-empty directory of nobody's at ``path``: neither shm_unlink nor root may remove it."""
    from as_nobody import NOBODY

    path.mkdir()
    (path / "x").touch()
    for p in (path / "x", path):
        os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid)


def _broker(server) -> int | None:
    return next((p for p, t in server.titles().items() if t.startswith("shmserve broker ")), None)


def _worker_numbers(server_id: str) -> list[int]:
    """The numbers of the worker segments the server's user owns."""
    stem = f"shmserve.{server_id}.worker."
    mine = []
    for n in shm_entries(server_id):
        try:
            if n.startswith(stem) and n[len(stem):].isdigit() and os.stat(f"/dev/shm/{n}").st_uid == os.geteuid():
                mine.append(int(n[len(stem):]))
        except FileNotFoundError:  # (a worker reaped meanwhile)
            continue
    return sorted(mine)


def test_objects_the_server_cannot_remove_stop_neither_its_start_nor_its_launcher(server_factory):
    """Another user's non-empty directory under the server's prefix, which no unlink removes,
    and a symlink there: the server starts (its clean-up of a previous run's objects says what it
    left), and after a broker crash the launcher's clean-up leaves it too and starts a new broker."""
    sid = f"t{os.getpid()}_squat"
    folder = Path(f"/dev/shm/shmserve.{sid}.d")
    link = Path(f"/dev/shm/shmserve.{sid}.link")
    _squat_dir(folder)
    link.symlink_to("/etc/hostname")
    try:
        s = server_factory.start([PRODUCT_MODELS], ["--model-control-mode", "explicit", "--load-model", "add_sub"],
                                 server_id=sid)
        _add_sub(s)
        assert f"/shmserve.{sid}.d could not be removed from /dev/shm" in s.log(), s.log_tail()
        assert Path("/etc/hostname").exists()  # (a symlink is removed, never followed)
        old = _broker(s)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while _broker(s) in (None, old) or s.http_status("/v2/health/ready") != 200:
            assert s.proc.poll() is None, f"the launcher died:\n{s.log_tail()}"
            assert time.monotonic() < deadline, f"no new broker:\n{s.log_tail()}"
            time.sleep(0.2)
        _add_sub(s)
        assert folder.is_dir()
        assert "Traceback" not in s.log(), s.log_tail()
    finally:
        shutil.rmtree(folder)
        link.unlink(missing_ok=True)


def test_worker_names_another_user_made_first_are_skipped_by_a_load(server_factory):
    """A stale object of the server's own user at the next worker names is removed and the number
    used; when another user made the next 40 names first, a load takes a number whose names are
    free (published in the routes and its spec: HTTP and the local client reach it), instead of
    failing, and leaving the model's later loads waiting for good."""
    from as_nobody import run_as_nobody

    from shmserve import Client

    s = server_factory.start([PRODUCT_MODELS], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    stale = [Path(f"/dev/shm/shmserve.{s.id}.{role}.1") for role in ("worker", "control")]
    for path in stale:  # as a process of the server's user that died would leave them
        path.write_bytes(b"")
    inodes = [path.stat().st_ino for path in stale]
    squatted = [f"/dev/shm/shmserve.{s.id}.worker.{n}" for n in range(2, 42)]
    c = s.client()
    try:
        c.unload_model("add_sub")
        c.load_model("add_sub")
        _add_sub(s)
        assert 1 in _worker_numbers(s.id) and [p.stat().st_ino for p in stale] != inodes
        assert run_as_nobody(SQUAT_FILES, squatted) == 40
        c.unload_model("add_sub")
        c.load_model("add_sub")
        _add_sub(s)
        a = np.arange(16, dtype=np.int32)
        with Client(s.id) as lc, lc.infer("add_sub", {"INPUT0": a, "INPUT1": a}) as result:
            np.testing.assert_array_equal(result["OUTPUT0"], 2 * a)
        numbers = [n for n in _worker_numbers(s.id) if n > 1]
        assert numbers and not set(numbers) & set(range(2, 42)), numbers
        assert f"/shmserve.{s.id}.worker.2 (or /shmserve.{s.id}.control.2, or a user's lanes object beside it) exists" \
            in s.log()
    finally:
        c.close()
        for path in squatted:
            Path(path).unlink(missing_ok=True)


def test_a_restart_past_squatted_worker_names_never_fails_the_broker(server_factory):
    """A worker dies while another user holds the next worker names: its restart takes a free
    number; the broker, and every request it holds, lives on."""
    from as_nobody import run_as_nobody

    s = server_factory.start([PRODUCT_MODELS], ["--model-control-mode", "explicit", "--load-model", "add_sub"])
    squatted = [f"/dev/shm/shmserve.{s.id}.worker.{n}" for n in range(1, 41)]
    run_as_nobody(SQUAT_FILES, squatted)
    try:
        broker = _broker(s)
        os.kill(s.worker_pids("add_sub")[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not [n for n in _worker_numbers(s.id) if n > 0] or s.http_status("/v2/models/add_sub/ready") != 200:
            assert time.monotonic() < deadline, f"add_sub did not come back:\n{s.log_tail()}"
            time.sleep(0.2)
        _add_sub(s)
        assert _broker(s) == broker, s.log_tail()
        assert "the broker died" not in s.log(), s.log_tail()
    finally:
        for path in squatted:
            Path(path).unlink(missing_ok=True)
