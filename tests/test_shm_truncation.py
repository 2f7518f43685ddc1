"""A client that truncates its registered system shared-memory region (and extends it again) while
the server reads or writes it, against a real server: the broker and every worker live on (the
same pids), other clients' requests all succeed, and the truncating client's requests either
succeed or fail with a 400 naming its region. A region that was short once serves again once it
is registered again, and a key that names another object than the one registered is refused.

Touching a mapped page past the end of a truncated tmpfs object is SIGBUS: these tests would
kill the process that maps a client's region, so this test process itself only reads and writes
regions through their descriptors.
"""
from __future__ import annotations

import itertools
import os
import threading
import time
from typing import Callable

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from conftest import TESTS, raw_request

MODELS = TESTS / "models" / "truncation"
MIB = 1 << 20
ATTACK_S = 2.0  # how long each attack runs
_keys = itertools.count()


@pytest.fixture(scope="module")
def server(module_factory):
    """fp32_identity, the ensemble of it, and that ensemble with its own response cache (the broker
    then reads the inputs for the key)."""
    return module_factory.start([MODELS], ["--cache-config", f"local,size={4 * MIB}"])


class Region:
    """A POSIX shm object of this test, registered whole under ``name``; read and written through
    its descriptor only."""

    def __init__(self, server, name: str, size: int) -> None:
        self.server, self.name, self.size = server, name, size
        self.key = f"/ttrunc_{server.id}_{name}_{next(_keys)}"
        self.fd = os.open("/dev/shm" + self.key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(self.fd, size)
            self.register()
        except BaseException:
            self.close()
            raise

    def register(self) -> None:
        with self.server.client() as c:
            c.register_system_shared_memory(self.name, self.key, self.size)

    def unregister(self) -> None:
        raw_request(self.server.port, "POST", f"/v2/systemsharedmemory/region/{self.name}/unregister")

    def fill(self, arr: np.ndarray) -> None:
        os.pwrite(self.fd, arr.tobytes(), 0)

    def read(self, dtype, count: int) -> np.ndarray:
        return np.frombuffer(os.pread(self.fd, count * np.dtype(dtype).itemsize, 0), dtype=dtype)

    def close(self) -> None:
        self.unregister()
        os.close(self.fd)
        try:
            os.unlink("/dev/shm" + self.key)
        except FileNotFoundError:
            pass


@pytest.fixture
def regions(server):
    made: list[Region] = []

    def make(name: str, size: int) -> Region:
        made.append(Region(server, f"{name}{next(_keys)}", size))
        return made[-1]

    yield make
    for r in made:
        r.close()


class Truncator(threading.Thread):
    """Truncates a region to nothing and extends it back, over and over, until stopped."""

    def __init__(self, region: Region) -> None:
        super().__init__(daemon=True)
        self.region = region
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            os.ftruncate(self.region.fd, 0)
            time.sleep(0.0005)
            os.ftruncate(self.region.fd, self.region.size)
            time.sleep(0.0005)

    def stop(self) -> None:
        self.halt.set()
        self.join()


def server_processes(server) -> dict[str, int]:
    """Broker, frontends and workers by title: a process that died and was restarted has a new pid."""
    return {title: pid for pid, title in server.titles().items()
            if title.startswith(("shmserve broker", "shmserve worker", "shmserve frontend", "shmserve grpc"))}


def fp32_input(name: str, arr: np.ndarray | None = None, region: Region | None = None, count: int = 0):
    t = httpclient.InferInput(name, [count if arr is None else arr.size], "FP32")
    if region is not None:
        t.set_shared_memory(region.name, count * 4)
    else:
        t.set_data_from_numpy(arr)
    return t


def region_output(region: Region, count: int):
    o = httpclient.InferRequestedOutput("OUT")
    o.set_shared_memory(region.name, count * 4)
    return o


def attack(server, truncated: Region, send_attack: Callable[[httpclient.InferenceServerClient], None],
           peers: list[Callable[[httpclient.InferenceServerClient], None]]) -> int:
    """Truncate ``truncated`` in a loop while ``send_attack`` and each of ``peers`` send requests for
    ATTACK_S: every peer request must succeed, every attack request succeed or be a 400 naming the
    region; the server's processes are the same after. Returns how many attack requests failed."""
    before = server_processes(server)
    errors: list[BaseException] = []
    done = threading.Event()

    def peer_loop(send) -> None:
        with server.client() as c:
            while not done.is_set():
                try:
                    send(c)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return

    threads = [threading.Thread(target=peer_loop, args=(p,), daemon=True) for p in peers]
    truncator = Truncator(truncated)
    refused = 0
    for t in threads:
        t.start()
    truncator.start()
    try:
        with server.client() as c:
            deadline = time.monotonic() + ATTACK_S
            while time.monotonic() < deadline:
                try:
                    send_attack(c)
                except InferenceServerException as e:
                    assert e.status() == "400", e
                    assert f"'{truncated.name}'" in e.message(), e.message()
                    refused += 1
    finally:
        truncator.stop()
        done.set()
        for t in threads:
            t.join(60)
    assert not errors, f"another client's request failed: {errors[0]!r}"
    assert server_processes(server) == before, "a server process died (and was restarted)"
    return refused


def test_input_region_truncated_in_a_loop_fails_only_its_own_requests(server, regions):
    """The worker reads a 1 MiB input from a region its client truncates and extends in a loop:
    it used to die of SIGBUS over and over, failing everyone's requests on it."""
    count = MIB // 4
    victim, peer_in = regions("victim_in", MIB), regions("peer_in", MIB)
    values = np.arange(count, dtype=np.float32)
    peer_in.fill(values)
    small = np.arange(16, dtype=np.float32)

    def through_region(c) -> None:
        out = c.infer("fp32_identity", [fp32_input("IN", region=peer_in, count=count)]).as_numpy("OUT")
        assert np.array_equal(out, values)

    def plain(c) -> None:
        assert np.array_equal(c.infer("fp32_identity", [fp32_input("IN", small)]).as_numpy("OUT"), small)

    refused = attack(server, victim, lambda c: c.infer("fp32_identity", [fp32_input("IN", region=victim, count=count)]),
                     [through_region, plain])
    assert refused > 0, "no request saw the region truncated: the test did not test anything"


def test_16_mib_output_into_a_region_truncated_in_a_loop(server, regions):
    """The worker writes a 16 MiB output into a region truncated in a loop."""
    count = 16 * MIB // 4
    source, victim = regions("big_in", 16 * MIB), regions("big_out", 16 * MIB)
    source.fill(np.ones(count, dtype=np.float32))
    small = np.arange(16, dtype=np.float32)

    def plain(c) -> None:
        assert np.array_equal(c.infer("fp32_identity", [fp32_input("IN", small)]).as_numpy("OUT"), small)

    refused = attack(server, victim, lambda c: c.infer("fp32_identity", [fp32_input("IN", region=source, count=count)],
                                                       outputs=[region_output(victim, count)]), [plain])
    assert refused > 0, "no request saw the region truncated: the test did not test anything"


def test_ensemble_output_region_truncated_mid_run(server, regions):
    """The broker copies an ensemble's 16 MiB output into a region truncated in a loop: it used to
    die (an uncaught ValueError, or SIGBUS mid-copy), failing every client and reloading every model."""
    count = 16 * MIB // 4
    source, victim = regions("ens_in", 16 * MIB), regions("ens_out", 16 * MIB)
    source.fill(np.full(count, 3, dtype=np.float32))
    small = np.arange(16, dtype=np.float32)

    def plain(c) -> None:
        assert np.array_equal(c.infer("fp32_identity_ens", [fp32_input("IN", small)]).as_numpy("OUT"), small)

    refused = attack(server, victim,
                     lambda c: c.infer("fp32_identity_ens", [fp32_input("IN", region=source, count=count)],
                                       outputs=[region_output(victim, count)]), [plain])
    assert refused > 0, "no request saw the region truncated: the test did not test anything"
    ok = np.full(16, 7, dtype=np.float32)  # and the region serves once left alone
    with server.client() as c:
        source.fill(ok)
        c.infer("fp32_identity_ens", [fp32_input("IN", region=source, count=16)], outputs=[region_output(victim, 16)])
    assert np.array_equal(victim.read(np.float32, 16), ok)


def test_cached_ensemble_input_region_truncated_in_a_loop(server, regions):
    """The broker reads an input in a region for the response cache's key while its client
    truncates it in a loop."""
    count = MIB // 4
    victim = regions("key_in", MIB)
    small = np.arange(16, dtype=np.float32)

    def plain(c) -> None:
        assert np.array_equal(c.infer("fp32_identity_cached_ens", [fp32_input("IN", small)]).as_numpy("OUT"), small)

    refused = attack(server, victim,
                     lambda c: c.infer("fp32_identity_cached_ens", [fp32_input("IN", region=victim, count=count)]),
                     [plain])
    assert refused > 0, "no request saw the region truncated: the test did not test anything"


def test_region_short_once_serves_again_once_registered_again(server, regions):
    """A worker that met the region while it was short used to keep its short mapping and fail
    every later request on it ("16 bytes cannot hold a FP32 tensor"), even after the client
    extended it and registered it again."""
    count = 4096
    region = regions("short", count * 4)
    values = np.arange(count, dtype=np.float32)
    region.fill(values)
    workers = server_processes(server)
    with server.client() as c:
        def infer() -> np.ndarray:
            return c.infer("fp32_identity", [fp32_input("IN", region=region, count=count)]).as_numpy("OUT")

        os.ftruncate(region.fd, 16)
        with pytest.raises(InferenceServerException) as e:
            infer()
        assert e.value.status() == "400"
        assert "was truncated since it was registered" in e.value.message()
        os.ftruncate(region.fd, count * 4)
        region.fill(values + 1)
        region.unregister()
        region.register()
        assert np.array_equal(infer(), values + 1)
        region.fill(values + 2)  # and nothing cached keeps old bytes
        assert np.array_equal(infer(), values + 2)
    assert server_processes(server) == workers
    assert f"shared memory region '{region.name}'" in e.value.message()  # named as the client registered it


def test_key_naming_another_object_is_refused_until_registered_again(server, regions):
    """The client unlinks its object and makes another under the same key without registering it:
    the server reads neither the new object (nobody checked it) nor the old one it has open (the
    client's answers would silently go nowhere); registered again, the new object serves."""
    count = 16
    region = regions("swapped", count * 4)
    region.fill(np.ones(count, dtype=np.float32))
    with server.client() as c:
        def infer() -> np.ndarray:
            return c.infer("fp32_identity", [fp32_input("IN", region=region, count=count)]).as_numpy("OUT")

        assert np.array_equal(infer(), np.ones(count, dtype=np.float32))  # opened by the worker now
        os.unlink("/dev/shm" + region.key)
        os.close(region.fd)
        region.fd = os.open("/dev/shm" + region.key, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(region.fd, count * 4)
        region.fill(np.full(count, 5, dtype=np.float32))
        with pytest.raises(InferenceServerException) as e:
            infer()
        assert e.value.status() == "400"
        assert f"shared memory region '{region.name}' was replaced since it was registered" in e.value.message()
        region.unregister()
        region.register()
        assert np.array_equal(infer(), np.full(count, 5, dtype=np.float32))


def test_a_region_truncated_in_a_tight_loop_stalls_no_other_client(server, regions):
    """A client truncates its 32 MiB input region and extends it again as fast as it can (another
    process, no pause) while it sends requests that read it: a worker's (fp32_identity) and the
    broker's (the ensemble's input). Each copy used to take a fault per page, each waiting on the
    truncating process, so one request held the broker or the worker for seconds to minutes and
    every other client with it. Now the first fault zeroes the mapping and the copy is refused:
    other clients' requests through the same worker and the broker wait no longer than a copy."""
    import subprocess
    import sys

    count = 32 * MIB // 4
    victim = regions("tight_in", 32 * MIB)
    victim.fill(np.ones(count, dtype=np.float32))
    small = np.arange(16, dtype=np.float32)
    slowest: list[float] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def peer(model: str) -> None:
        with server.client(network_timeout=300) as c:
            while not done.is_set():
                started = time.monotonic()
                try:
                    assert np.array_equal(c.infer(model, [fp32_input("IN", small)]).as_numpy("OUT"), small)
                except BaseException as e:  # noqa: BLE001 - reported below
                    errors.append(e)
                    return
                slowest.append(time.monotonic() - started)

    cutter = subprocess.Popen([sys.executable, "-c", "import os, sys\nprint(flush=True)\nwhile True:\n"
                               "    os.truncate(sys.argv[1], 0)\n    os.truncate(sys.argv[1], int(sys.argv[2]))\n",
                               "/dev/shm" + victim.key, str(victim.size)], stdout=subprocess.PIPE)
    peers = [threading.Thread(target=peer, args=(m,), daemon=True) for m in ("fp32_identity", "fp32_identity_ens")]
    before = server_processes(server)
    refused = 0
    try:
        assert cutter.stdout is not None and cutter.stdout.readline() == b"\n"
        for t in peers:
            t.start()
        with server.client(network_timeout=300) as c:
            for model in ("fp32_identity", "fp32_identity_ens") * 4:
                try:
                    c.infer(model, [fp32_input("IN", region=victim, count=count)])
                except InferenceServerException as e:
                    assert e.status() == "400" and f"'{victim.name}'" in e.message(), e
                    refused += 1
    finally:
        cutter.kill()
        cutter.wait()
        done.set()
        for t in peers:
            t.join(300)
    assert not errors, f"another client's request failed: {errors[0]!r}"
    assert refused > 0, "no request saw the region truncated: the test did not test anything"
    assert slowest and max(slowest) < 5, f"another client waited {max(slowest):.1f} s behind a truncated copy"
    assert server_processes(server) == before, "a server process died (and was restarted)"
