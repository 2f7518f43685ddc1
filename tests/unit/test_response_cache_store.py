"""The response cache's store over real shared memory, as two processes see it (the broker's
mapping and a worker's): payloads come back exactly or not at all, eviction takes the least
recently used entry, an entry larger than the cache is not stored, and a lock left by a process
that died is released by the broker's look. (tests/test_response_cache.py covers the server.)"""
from __future__ import annotations

import hashlib
import itertools
import os
import random
import signal
import subprocess
import sys

import pytest

from shmserve.shm.response_cache import CacheStore, layout

_ids = itertools.count()


@pytest.fixture
def stores():
    """(the broker's store, a second process's view of it), removed after the test."""
    made: list[tuple[CacheStore, CacheStore]] = []

    def make(size: int) -> tuple[CacheStore, CacheStore]:
        server_id = f"unit{os.getpid()}_{next(_ids)}"
        created = CacheStore.create(server_id, size)
        made.append((created, CacheStore.attach(server_id)))
        return made[-1]

    yield make
    for created, attached in made:
        attached.close()
        created.close()
        created.unlink()
    left = [n for n in os.listdir("/dev/shm") if f"shmserve.unit{os.getpid()}_" in n]
    assert not left, f"shared memory left behind: {left}"


def key(i: object) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()[:16]


def test_a_payload_inserted_by_one_process_is_found_by_the_other(stores):
    broker, worker = stores(64 << 10)
    assert worker.lookup(key("a")) is None
    assert worker.insert(key("a"), [b"head", memoryview(b"-and-tail")], 13)
    assert broker.lookup(key("a")) == b"head-and-tail"
    assert not broker.insert(key("a"), [b"another"], 7)  # the first answer stays
    assert worker.lookup(key("a")) == b"head-and-tail"


def test_a_forgotten_key_is_a_miss_and_takes_the_next_insert(stores):
    """What a reader found unreadable is forgotten: the next answer stored under its key replaces
    it, and the log still wraps past its old bytes."""
    _, store = stores(16 << 10)
    assert store.insert(key("a"), [b"garbage"], 7)
    store.forget(key("a"))
    store.forget(key("never stored"))
    assert store.lookup(key("a")) is None
    assert store.insert(key("a"), [b"answer"], 6)
    assert store.lookup(key("a")) == b"answer"
    for i in range(200):  # wrap the log many times over the forgotten copy
        assert store.insert(key(i), [bytes(300)], 300)
    assert store.lookup(key(199)) == bytes(300)


def test_random_use_never_returns_a_wrong_payload(stores):
    """Inserts and lookups of payloads from 1 byte to a third of the cache, wrapping the log
    many times: what comes back is always what was stored under that key."""
    _, store = stores(16 << 10)
    rng = random.Random(7)
    stored: dict[int, bytes] = {}
    hits = 0
    for step in range(20000):
        i = rng.randrange(60)
        if rng.random() < 0.5:
            data = bytes([i]) * rng.choice([1, 10, 100, 500, 2000, 5000]) + str(step).encode()
            if store.insert(key(i), [data], len(data)):
                stored[i] = data
        else:
            got = store.lookup(key(i))
            if got is not None:
                hits += 1
                assert got == stored[i]
    assert hits > 1000  # the check above ran


def test_the_least_recently_used_entry_is_evicted(stores):
    """Room for three entries: A, B, C stored, A used, D stored: B goes, A, C and D stay."""
    _, capacity = layout(64 << 10)
    _, store = stores(64 << 10)
    n = capacity // 3 - 64  # three fit, four do not
    payload = {name: name.encode() * n for name in "ABCD"}
    for name in "ABC":
        assert store.insert(key(name), [payload[name]], n)
    assert store.lookup(key("A")) == payload["A"]
    assert store.insert(key("D"), [payload["D"]], n)
    for name in "CAD":  # least recently used first: each lookup uses the entry that would go next
        assert store.lookup(key(name)) == payload[name], name
    assert store.lookup(key("B")) is None


def test_an_entry_larger_than_the_cache_is_not_stored(stores):
    _, store = stores(4096)
    assert store.insert(key("small"), [b"x"], 1)
    big = b"y" * store.capacity
    assert not store.fits(len(big)) and not store.insert(key("big"), [big], len(big))
    assert store.lookup(key("big")) is None
    assert store.lookup(key("small")) == b"x"  # nothing was evicted for it


def test_the_index_bounds_the_number_of_entries(stores):
    """Many tiny entries: the oldest go once the index holds as many as it may."""
    _, store = stores(4096)
    for i in range(store.max_entries * 3):
        assert store.insert(key(i), [b"z"], 1)
    assert store.entries() == store.max_entries
    assert store.lookup(key(0)) is None
    assert store.lookup(key(store.max_entries * 3 - 1)) == b"z"


def test_an_entry_written_anew_on_a_hit_counts_once(stores):
    """A hit in the older half of the log writes the entry again at the head; the count of
    entries (Triton's nv_cache_num_entries) still counts it once, and a forgotten one not at all."""
    _, store = stores(4096)
    assert store.insert(key("a"), [b"x"], 1)
    assert store.lookup(key("a")) == b"x"  # (alone in the log: in its older half, written anew)
    assert store.entries() == 1
    assert store.insert(key("b"), [b"y"], 1) and store.entries() == 2
    store.forget(key("a"))
    assert store.entries() == 1 and store.totals().entries == 1


HOLD_AND_DIE = """
import os, signal, sys
from shmserve.shm.response_cache import CacheStore
store = CacheStore.attach(sys.argv[1])
store._lock(1.0)  # the lock, as a lookup takes it ...
os.kill(os.getpid(), signal.SIGKILL)  # ... and a death before it is released
"""


def test_a_lock_left_by_a_dead_process_is_released_by_the_broker(stores):
    broker, worker = stores(64 << 10)
    assert worker.insert(key("kept?"), [b"payload"], 7)
    server_id = broker.seg.name.split(".")[1]
    r = subprocess.run([sys.executable, "-c", HOLD_AND_DIE, server_id], timeout=60)
    assert r.returncode == -signal.SIGKILL
    assert worker.lookup(key("kept?")) is None  # locked: the lookup gives up, the request runs uncached
    assert not broker.recover()  # first look: the lock may be between two stores of a live holder
    assert broker.recover()  # second look, nothing moved: the holder is gone
    assert worker.lookup(key("kept?")) is None  # emptied: it may have been half changed
    assert worker.insert(key("new"), [b"fresh"], 5) and broker.lookup(key("new")) == b"fresh"
    assert not broker.recover()  # a free lock is left alone
