"""Wake-ups with polling first (shm/waker.py), on a real POSIX semaphore: polling must never make a
receiver overstay the timeout its caller asked for (a batcher's delay, a queue timeout)."""
from __future__ import annotations

import os
import threading
import time

import posix_ipc
import pytest

from shmserve.shm.waker import AWAKE, SLEEPING, SpinPolicy, Waker, flag_view


@pytest.fixture
def waker():
    sem = posix_ipc.Semaphore(f"/shmtest.waker.{os.getpid()}", posix_ipc.O_CREX)
    try:
        yield Waker(flag_view(memoryview(bytearray(64)), 0), sem=sem)  # the flag as segments hold it
    finally:
        sem.unlink()
        sem.close()


def test_polling_ends_at_the_callers_timeout(waker):
    spin = SpinPolicy(2.0)  # recent waits were short: it would poll for two seconds
    t0 = time.perf_counter()
    waker.sleep(0.2, lambda: False, spin)
    elapsed = time.perf_counter() - t0
    # Polling alone would take 2 s, and sleeping the whole timeout after it 2.2 s.
    assert 0.2 <= elapsed < 1.5, elapsed
    assert waker.flag[0] == AWAKE


def test_a_timeout_spent_polling_is_not_slept_again(waker):
    spin = SpinPolicy(0.5)
    t0 = time.perf_counter()
    waker.sleep(0.8, lambda: False, spin)  # polls 0.5 s, then sleeps what is left of the 0.8 s
    elapsed = time.perf_counter() - t0
    assert 0.8 <= elapsed < 1.25, elapsed  # sleeping the whole timeout again would take 1.3 s


def test_work_found_while_polling_returns_without_sleeping(waker):
    spin = SpinPolicy(1.0)
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
    waker.sleep(5.0, lambda: False)  # no polling: straight to the semaphore
    t.join()
    assert seen_asleep.is_set()
    assert time.perf_counter() - t0 < 2.0
    assert waker.flag[0] == AWAKE
