"""Wake-ups with polling first (shm/waker.py), on a real futex word: polling must never make a
receiver overstay the timeout its caller asked for (a batcher's delay, a queue timeout), it stops
once it finds nothing, and nobody polls while no core is idle.

The run queue is read from a file in /proc/loadavg's format that a test writes (``RunQueue``'s
path): this host is shared, so the kernel's own count cannot be made to show an idle core."""
from __future__ import annotations

import mmap
import os
import threading
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import PRODUCT_MODELS, CpuHogs

from shmserve.shm.waker import AWAKE, SLEEPING, RunQueue, SpinPolicy, Waker, run_queue


class FakeLoad:
    """A run queue read from a file in /proc/loadavg's format: ``set(runnable)`` changes it."""

    def __init__(self, path, cores: int = 2) -> None:
        self.path = path
        self.set(1)
        self.queue = RunQueue(str(path), cores=cores)
        self.queue.REFRESH_S = 0.0  # every check reads the file

    def set(self, runnable: int) -> None:
        self.path.write_text(f"0.50 0.40 0.30 {runnable}/321 4242\n")


@pytest.fixture
def idle(tmp_path) -> FakeLoad:
    return FakeLoad(tmp_path / "loadavg")


@pytest.fixture
def waker():
    mapping = mmap.mmap(-1, 4096)  # shared, as a segment's header is
    buf = memoryview(mapping)
    yield Waker.on_word(buf, 64)  # the flag where segments hold it


def test_polling_ends_at_the_callers_timeout(waker, idle):
    spin = SpinPolicy(2.0, idle.queue)  # recent waits were short: it would poll for two seconds
    t0 = time.perf_counter()
    waker.sleep(0.2, lambda: False, spin)
    elapsed = time.perf_counter() - t0
    # Polling alone would take 2 s, and sleeping the whole timeout after it 2.2 s.
    assert 0.2 <= elapsed < 1.5, elapsed
    assert waker.flag[0] == AWAKE


def test_a_timeout_spent_polling_is_not_slept_again(waker, idle):
    spin = SpinPolicy(0.5, idle.queue)
    t0 = time.perf_counter()
    waker.sleep(0.8, lambda: False, spin)  # polls 0.5 s, then sleeps what is left of the 0.8 s
    elapsed = time.perf_counter() - t0
    assert 0.8 <= elapsed < 1.25, elapsed  # sleeping the whole timeout again would take 1.3 s


def test_work_found_while_polling_returns_without_sleeping(waker, idle):
    spin = SpinPolicy(1.0, idle.queue)
    ready_at = time.perf_counter() + 0.02
    t0 = time.perf_counter()
    waker.sleep(5.0, lambda: time.perf_counter() >= ready_at, spin)
    assert time.perf_counter() - t0 < 1.0
    assert waker.flag[0] == AWAKE  # never declared asleep: producers did not need to post


def test_a_producer_notify_wakes_a_sleeper(waker):
    seen_asleep = threading.Event()

    def producer() -> None:
        while waker.flag[0] != SLEEPING:
            time.sleep(0.001)
        seen_asleep.set()
        waker.notify()

    t = threading.Thread(target=producer)
    t.start()
    t0 = time.perf_counter()
    waker.sleep(5.0, lambda: False)  # no polling: straight to the futex
    t.join()
    assert seen_asleep.is_set()
    assert time.perf_counter() - t0 < 2.0
    assert waker.flag[0] == AWAKE


def test_a_post_while_the_receiver_is_awake_is_kept_for_its_next_sleep(waker):
    """``post`` (start-up messages, another thread's news) counts like a semaphore's: made while
    the receiver works, its next sleep returns at once, and only that one."""
    waker.post()
    t0 = time.perf_counter()
    waker.sleep(5.0, lambda: False)
    assert time.perf_counter() - t0 < 1.0
    t0 = time.perf_counter()
    waker.sleep(0.2, lambda: False)
    assert time.perf_counter() - t0 >= 0.2


def test_a_sleeper_in_another_process_is_woken_through_the_shared_word(tmp_path):
    """The futex is keyed by the file and offset, not the address: a process that maps the
    segment elsewhere wakes the sleeper as one that shares its mapping would."""
    import subprocess
    import sys

    path = f"/dev/shm/shmtest.waker.{os.getpid()}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        mapping = mmap.mmap(fd, 4096)
        receiver = Waker.on_word(memoryview(mapping), 64)
        producer = subprocess.Popen([sys.executable, "-c", f"""
import mmap, os, time
from shmserve.shm.waker import SLEEPING, Waker
fd = os.open({path!r}, os.O_RDWR)
waker = Waker.on_word(memoryview(mmap.mmap(fd, 4096)), 64)
while waker.flag[0] != SLEEPING:
    time.sleep(0.001)
waker.notify()
"""])
        t0 = time.perf_counter()
        receiver.sleep(20.0, lambda: False)
        assert time.perf_counter() - t0 < 10.0, "woken by the other process, not by the timeout"
        assert producer.wait(30) == 0
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_flag_a_client_lowered_costs_one_timeout_and_no_more(waker):
    """Whatever a client writes into the flag, its receiver writes it again before each sleep: a
    sleeper whose flag was lowered is not woken (the producer thinks it awake) until its timeout,
    and the next sleep is woken as usual."""
    stop = threading.Event()

    def scribble_then_notify() -> None:
        while waker.flag[0] != SLEEPING:
            time.sleep(0.001)
        time.sleep(0.05)  # (asleep in the kernel by now: before that, the lowered flag would end the sleep)
        waker.flag[0] = AWAKE  # the scribble: no producer will wake it now
        waker.notify()
        while not stop.is_set() and waker.flag[0] != SLEEPING:
            time.sleep(0.001)
        waker.notify()

    t = threading.Thread(target=scribble_then_notify)
    t.start()
    try:
        t0 = time.perf_counter()
        waker.sleep(0.5, lambda: False)
        assert time.perf_counter() - t0 >= 0.45, "nobody woke it: its timeout did"
        t0 = time.perf_counter()
        waker.sleep(5.0, lambda: False)
        assert time.perf_counter() - t0 < 2.0, "the next sleep was woken"
    finally:
        stop.set()
        t.join()


def test_an_idle_receiver_stops_polling_and_quick_work_brings_the_polling_back(waker, idle):
    """A poll that finds nothing, then a long sleep: the receiver sleeps at once next time; waits
    that come quickly again make the next ones polled."""
    spin = SpinPolicy(0.1, idle.queue)
    waker.sleep(1.0, lambda: False, spin)  # polls 100 ms, then sleeps the rest: ten times the budget
    assert spin.missed == 1 and spin.budget() == 0
    cpu = time.process_time()
    waker.sleep(0.2, lambda: False, spin)
    assert time.process_time() - cpu < 0.1  # slept, not polled
    assert spin.missed == 1
    for woken in range(1, 11):  # slept, woken after 5 ms each time: a poll would have paid
        ready = threading.Event()

        def produce() -> None:
            ready.set()
            waker.notify()

        producer = threading.Timer(0.005, produce)
        producer.start()
        waker.sleep(5.0, ready.is_set, spin)
        producer.join()
        if spin.budget() > 0:
            break
    assert spin.budget() == 0.1 and woken <= 4 and spin.found == 0
    ready_at = time.perf_counter() + 0.001
    waker.sleep(5.0, lambda: time.perf_counter() >= ready_at, spin)
    assert spin.found == 1 and waker.flag[0] == AWAKE


def test_a_loop_whose_waits_lie_just_under_the_budget_keeps_polling_past_a_late_one(waker, idle):
    """A closed loop's next request comes a little before the budget ends; one that comes late
    must not cost the following ones their poll (they would each pay a sleep and a wake-up)."""
    spin = SpinPolicy(0.05, idle.queue)

    def wait_for(after_s: float) -> None:
        ready_at = time.perf_counter() + after_s
        producer = threading.Timer(after_s, waker.notify)
        producer.start()
        waker.sleep(5.0, lambda: time.perf_counter() >= ready_at, spin)
        producer.join()

    for _ in range(3):
        wait_for(0.03)
    wait_for(0.08)  # late: the poll gives up and the receiver sleeps until it comes
    assert spin.missed == 1 and spin.found == 3
    for _ in range(3):
        wait_for(0.03)
    assert spin.found == 6 and spin.missed == 1  # each found by polling again


def test_no_polling_while_no_core_is_idle(waker, idle):
    """With more runnable tasks than cores (and the partner poller), the receiver sleeps at once:
    its budget is kept for when a core is idle again; a poll under way stops once the count rises."""
    spin = SpinPolicy(1.0, idle.queue)
    idle.set(4)  # on 2 cores: the reader, its partner poller and 2 more
    cpu = time.process_time()
    waker.sleep(1.0, lambda: False, spin)  # polling would take the whole second
    assert spin.busy == 1 and spin.found == spin.missed == 0
    assert time.process_time() - cpu < 0.1
    assert spin.budget() == 1.0  # not spent on a poll that never started
    idle.set(3)
    assert spin.poll(lambda: True, time.perf_counter())  # a core idle again: polled
    rising = threading.Timer(0.05, idle.set, (6,))
    rising.start()
    t0 = time.perf_counter()
    assert not spin.poll(lambda: False, t0)
    rising.join()
    assert time.perf_counter() - t0 < 0.9 and spin.busy >= 2  # cut short, not polled the whole second


def test_the_run_queue_check_is_cheap_and_reads_the_kernel():
    """The real /proc/loadavg: a count at least this process, and a check well under a
    microsecond amortized (generous: 5 us on a loaded host)."""
    queue = run_queue()
    queue.idle_core()
    assert queue.runnable >= 1 and queue.cores == os.cpu_count()
    n = 20_000
    t0 = time.perf_counter()
    for _ in range(n):
        queue.idle_core()
    assert (time.perf_counter() - t0) / n < 5e-6


def test_a_busy_host_sleeps_a_non_polling_receiver_at_once_whatever_the_budget(waker):
    """With every core taken by processes that never block, the kernel's own count stops a poll
    with a budget of seconds: the receiver sleeps and costs next to no CPU."""
    with CpuHogs(2 * os.cpu_count()):
        spin = SpinPolicy(2.0)  # the real run queue
        cpu = time.process_time()
        waker.sleep(1.0, lambda: False, spin)  # polling would take the whole second
        assert spin.busy == 1 and spin.found == spin.missed == 0
        assert time.process_time() - cpu < 0.1


# -- with a real server ------------------------------------------------------------------------

ADD_SUB = ["--model-control-mode", "explicit", "--load-model", "add_sub"]


class MainThread:
    """CPU time (ns, exact) and blocking sleeps of a process's main thread, where our pollers run."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def read(self) -> tuple[int, int]:
        with open(f"/proc/{self.pid}/task/{self.pid}/schedstat") as f:
            cpu_ns = int(f.read().split()[0])
        with open(f"/proc/{self.pid}/task/{self.pid}/status") as f:
            slept = next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))
        return cpu_ns, slept


def _pollers(server) -> list[MainThread]:
    """The add_sub worker and the HTTP frontend(s): the server's processes that poll."""
    pids = [pid for pid, title in server.titles().items()
            if title.startswith("shmserve worker add_sub ") or title.startswith(f"shmserve frontend {server.id}")]
    assert len(pids) >= 2, server.titles()
    return [MainThread(pid) for pid in pids]


def _closed_loops(server, clients: int, requests: int) -> tuple[float, int]:
    """``clients`` requests of add_sub in flight over HTTP (tritonclient's connection pool),
    ``requests`` rounds of them: (CPU of the pollers' main threads in us per request, their
    blocking sleeps per request)."""
    x = np.arange(16, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
    inputs[0].set_data_from_numpy(x)
    inputs[1].set_data_from_numpy(x)

    def rounds(conn: httpclient.InferenceServerClient, n: int) -> None:
        for _ in range(n):
            for pending in [conn.async_infer("add_sub", inputs) for _ in range(clients)]:
                assert pending.get_result().as_numpy("OUTPUT0").tolist() == (2 * x).tolist()

    conn = httpclient.InferenceServerClient(server.url, concurrency=clients)
    try:
        rounds(conn, 5)  # connected and warm
        pollers = _pollers(server)
        before = [p.read() for p in pollers]
        rounds(conn, requests)
        after = [p.read() for p in pollers]
    finally:
        conn.close()
    n = clients * requests
    cpu_us = sum(a[0] - b[0] for a, b in zip(after, before)) / 1e3 / n
    slept = sum(a[1] - b[1] for a, b in zip(after, before)) / n
    return cpu_us, slept


def test_a_polling_server_on_a_busy_host_costs_what_a_non_polling_one_does(server_factory):
    """Every core taken by processes that never block (as busy clients are): a server with a long
    poll budget must not poll, so its frontend and worker cost per request about what they cost
    with --poll-us 0, and they sleep between requests instead. Before, each poll ran for its
    whole budget (yielding, but still taking a share of a core from the busy processes)."""
    polling = server_factory.start([PRODUCT_MODELS], [*ADD_SUB, "--poll-us", "20000"])
    still = server_factory.start([PRODUCT_MODELS], [*ADD_SUB, "--poll-us", "0"])
    with CpuHogs(2 * os.cpu_count() + 2):
        rounds = []
        for _ in range(2):  # interleaved: the host's phases hit both alike
            rounds.append((_closed_loops(polling, 4, 40), _closed_loops(still, 4, 40)))
        lone, lone_still = _closed_loops(polling, 1, 80), _closed_loops(still, 1, 80)
    cpu = min(r[0][0] for r in rounds)
    cpu_still = min(r[1][0] for r in rounds)
    # Polling 20 ms a wait at a quarter of a core or so would cost a few ms a request.
    assert cpu < 1.5 * cpu_still + 200, (rounds, lone, lone_still)
    # One client: the pollers sleep on every request (two sleeps, and more), as without polling.
    assert lone[1] >= 1.0 and lone[0] < 1.5 * lone_still[0] + 200, (lone, lone_still)


def test_with_an_idle_core_a_closed_loop_is_answered_by_polling(server_factory, tmp_path, monkeypatch):
    """The run queue says a core is idle (a file in /proc/loadavg's format: this shared host
    cannot promise one): one client's closed loop is then served by polling, the frontend and the
    worker sleeping on few of its requests; with --poll-us 0 they sleep on every one. Once the
    file says the cores are busy, the same loop is served by sleeping."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.10 0.10 0.10 1/200 4242\n")
    monkeypatch.setenv("SHMSERVE_TEST_LOADAVG", str(loadavg))
    polling = server_factory.start([PRODUCT_MODELS], [*ADD_SUB, "--poll-us", "50000"])
    still = server_factory.start([PRODUCT_MODELS], [*ADD_SUB, "--poll-us", "0"])
    _, slept = _closed_loops(polling, 1, 200)
    _, slept_still = _closed_loops(still, 1, 200)
    assert slept_still >= 1.5, slept_still  # the frontend and the worker, each once a request at least
    assert slept < 0.5, (slept, slept_still)
    loadavg.write_text(f"9.00 9.00 9.00 {os.cpu_count() + 2}/200 4242\n")
    time.sleep(0.1)  # (read at most every 2 ms)
    _, slept_busy = _closed_loops(polling, 1, 200)
    assert slept_busy >= 1.0, (slept, slept_busy)


def test_at_the_default_budget_a_client_slower_than_it_still_gets_its_answers_polled(server_factory, tmp_path,
                                                                                      monkeypatch):
    """--poll-us at its default (500 us), a core idle, one tritonclient in a closed loop: the
    client takes longer than the budget between an answer and its next request, but the answer
    itself comes within it, so the frontend polls for it and sleeps at most once a request (for
    the client's next one). Its policy once counted the client's time as a wait: the polling then
    stopped for good, and a 1-client p50 went from 0.96x to 1.39x Triton's."""
    loadavg = tmp_path / "loadavg"
    loadavg.write_text("0.10 0.10 0.10 1/200 4242\n")
    monkeypatch.setenv("SHMSERVE_TEST_LOADAVG", str(loadavg))
    server = server_factory.start([PRODUCT_MODELS], ADD_SUB)
    still = server_factory.start([PRODUCT_MODELS], [*ADD_SUB, "--poll-us", "0"])

    def frontend_sleeps(srv) -> float:
        frontend = next(MainThread(pid) for pid, title in srv.titles().items()
                        if title.startswith(f"shmserve frontend {srv.id}"))
        x = np.arange(16, dtype=np.int32)
        inputs = [httpclient.InferInput(name, [16], "INT32") for name in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(x)
        with httpclient.InferenceServerClient(srv.url) as client:
            for _ in range(50):  # warm: the policy's average settles
                client.infer("add_sub", inputs)
            _, before = frontend.read()
            for _ in range(300):
                client.infer("add_sub", inputs)
            _, after = frontend.read()
        return (after - before) / 300

    polled, asleep = frontend_sleeps(server), frontend_sleeps(still)
    assert asleep >= 1.7, asleep  # for the answer and for the next request
    assert polled <= 1.3, (polled, asleep)
