"""A worker's output arena starts small and grows with its answers (shm/extents.py): a large
answer makes a new extent, counted against /dev/shm first, and is read over HTTP, gRPC, the local
client, an ensemble and a stream; a growth past the cap or the room left is a clear 503 and the
next request is served; a retired extent is unlinked once drained; and many small models load
where each instance used to be counted at its whole arena.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from as_nobody import NOBODY, run_as_nobody
from conftest import TESTS, shm_entries
from test_shm_space import SmallShmServer, post

from shmserve import Client
from shmserve.server.cli import parse_args
from shmserve.server.shm_needs import SMALL_OBJECTS_BYTES, instance_bytes, startup_bytes
from shmserve.shm import space
from shmserve.shm.channel import CONTROL_EXTENTS_OFFSET, WorkerSegment
from shmserve.shm.extents import DEFAULT_START_BYTES, map_broker_extent, map_worker_extent
from shmserve.shm.names import extent_name, object_name
from shmserve.shm.segment import SegmentCache

MIB = 1 << 20
GROWTH_MODELS = TESTS / "models" / "growth"
BIG = 12 * MIB  # float32 elements: a 48 MiB answer, far past the 4 MiB first extent


def extents(server_id: str) -> list[str]:
    return sorted(n for n in shm_entries(server_id) if ".arena." in n)


def worker_segments(server_id: str) -> dict[str, int]:
    """Worker segments (no extents) and their sizes."""
    out = {}
    for name in shm_entries(server_id):
        if ".worker." in name and ".arena." not in name and not name.startswith("sem."):
            out[name] = os.stat(f"/dev/shm/{name.lstrip('/')}").st_size
    return out


def namespace_shm_sizes(server) -> dict[str, int]:
    """Sizes of the objects in a SmallShmServer's own /dev/shm (seen through its root)."""
    folder = Path(f"/proc/{server.pid}/root/dev/shm")
    return {e.name: e.stat().st_size for e in os.scandir(folder) if e.is_file()}


def http_identity(server, n: int) -> np.ndarray:
    x = np.arange(n, dtype=np.float32)
    inp = httpclient.InferInput("IN", [n], "FP32")
    inp.set_data_from_numpy(x)
    with server.client() as c:
        out = c.infer("identity", [inp]).as_numpy("OUT")
    np.testing.assert_array_equal(out, x)
    return out


@pytest.fixture(scope="module")
def growth_server(module_factory):
    return module_factory.start([GROWTH_MODELS])


def test_a_large_answer_grows_the_arena_and_is_read_over_every_protocol(growth_server):
    s = growth_server
    sizes = worker_segments(s.id).values()  # before: a whole 256 MiB arena per instance
    assert sizes and all(size < DEFAULT_START_BYTES + 2 * MIB for size in sizes), sizes
    http_identity(s, BIG)
    assert extents(s.id), "no extent was made for the large answer"

    x = np.arange(BIG, dtype=np.float32)[::-1].copy()
    with grpcclient.InferenceServerClient(s.grpc_url) as c:
        inp = grpcclient.InferInput("IN", [BIG], "FP32")
        inp.set_data_from_numpy(x)
        np.testing.assert_array_equal(c.infer("identity", [inp]).as_numpy("OUT"), x)
    with Client(s.id) as c:
        with c.infer("identity", {"IN": x}) as result:
            np.testing.assert_array_equal(result["OUT"], x)
        with c.infer("identity_ens", {"IN": x}) as result:  # the broker reads the step's extent
            np.testing.assert_array_equal(result["OUT"], x)
        small = np.ones(4, np.float32)
        with c.infer("identity", {"IN": small}) as result:  # small answers: the first extent
            np.testing.assert_array_equal(result["OUT"], small)
    assert "Traceback" not in s.log()


def test_a_stream_of_large_responses_is_read_from_its_extents(growth_server):
    n, size = 3, 3 * MIB  # 12 MiB each
    with Client(growth_server.id) as c:
        got = []
        for result in c.stream("big_stream", {"N": np.array([n], np.int32), "SIZE": np.array([size], np.int32)}):
            out = result["OUT"]
            assert out.shape == (size,)
            got.append(float(out[0]))
            assert float(out[-1]) == got[-1]
            result.release()
    assert got == [0.0, 1.0, 2.0]


def test_a_retired_extent_is_unlinked_once_drained(server_factory):
    s = server_factory.start([GROWTH_MODELS])
    http_identity(s, 2 * MIB)  # 8 MiB: extent 1
    first = extents(s.id)
    assert len(first) == 1, first
    http_identity(s, 10 * MIB)  # 40 MiB: extent 2; extent 1 is retired and nobody holds its answer
    time.sleep(0.2)
    http_identity(s, 4)
    after = extents(s.id)
    assert len(after) == 1 and after != first, (first, after)
    http_identity(s, 10 * MIB)  # served from extent 2, which stays
    assert extents(s.id) == after


SQUAT = """
fd = os.open(args["path"], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o666)
os.ftruncate(fd, 64 << 20)
os.close(fd)
result = os.stat(args["path"]).st_uid
"""


def test_an_extent_name_another_user_made_first_is_never_used(server_factory):
    """Anyone may make a name in /dev/shm: another user who makes the next extent's name first
    (world-writable) gets neither the answer nor a say in where it is read from."""
    s = server_factory.start([GROWTH_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity"])
    path = "/dev/shm" + extent_name(s.id, 0, 1)
    assert run_as_nobody(SQUAT, {"path": path}) == NOBODY.pw_uid
    http_identity(s, BIG)
    st = os.stat(path)  # the worker made its own in its place
    assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o600)
    with Client(s.id) as c:
        x = np.arange(BIG, dtype=np.float32)
        with c.infer("identity", {"IN": x}) as result:
            np.testing.assert_array_equal(result["OUT"], x)


def test_extent_names_the_server_cannot_remove_are_skipped(server_factory):
    """In a sticky /dev/shm another user's object of the next extent's name cannot be removed (a
    directory stands for it here, which not even root may shm_unlink): the arena grows past that
    number instead of refusing every growth from then on, and says which name it skipped."""
    s = server_factory.start([GROWTH_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity"])
    squatted = [Path("/dev/shm" + extent_name(s.id, 0, k)) for k in (1, 2)]
    for path in squatted:
        path.mkdir()
    try:
        np.testing.assert_array_equal(http_identity(s, BIG), np.arange(BIG, dtype=np.float32))
        assert all(path.is_dir() for path in squatted)
        st = os.stat("/dev/shm" + extent_name(s.id, 0, 3))
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o600)
        assert f"{extent_name(s.id, 0, 1)} exists and is not the server's to remove" in s.log()
    finally:
        for path in squatted:
            path.rmdir()


def test_extent_names_squatted_far_ahead_do_not_stop_growth(server_factory):
    """Another user's non-empty directories (which no unlink removes) at the next 40 extent names:
    the arena grows at a number past them that no one could make in advance, and every consumer
    (HTTP, the local client) reads the answer there, named by the number its completion carries."""
    s = server_factory.start([GROWTH_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity"])
    squatted = [Path("/dev/shm" + extent_name(s.id, 0, k)) for k in range(1, 41)]
    for path in squatted:
        path.mkdir()
        (path / "x").touch()
        for p in (path / "x", path):
            os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid)
    try:
        x = np.arange(BIG, dtype=np.float32)
        np.testing.assert_array_equal(http_identity(s, BIG), x)
        with Client(s.id) as c, c.infer("identity", {"IN": x}) as result:
            np.testing.assert_array_equal(result["OUT"], x)
        stem = f"shmserve.{s.id}.worker.0.arena."
        made = [int(n[len(stem):]) for n in extents(s.id)
                if n.startswith(stem) and os.stat("/dev/shm/" + n).st_uid == os.geteuid()]
        assert made and min(made) > 40, made
    finally:
        for path in squatted:
            shutil.rmtree(path)


def test_a_consumer_maps_an_extent_only_if_the_server_owns_it_at_its_size(server_factory):
    """``map_worker_extent``, as every consumer calls it, against a live server's worker: an
    extent the worker never made, one of the wrong size and one of another user are refused;
    and the broker's own (``map_broker_extent``) only where its tables give it a size."""
    s = server_factory.start([GROWTH_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity"])
    http_identity(s, 2 * MIB)  # extent 1, 8 MiB
    cache = SegmentCache()
    try:
        control = cache.get(object_name(s.id, "control", 0))  # where the worker writes the sizes
        size = WorkerSegment.extent_size_in(control.buf, 1)
        assert map_worker_extent(cache, s.id, 0, 1, control).size == size > 0
        with pytest.raises(OSError, match="is not an extent the server made"):
            map_worker_extent(cache, s.id, 0, 2, control)
        tables = cache.get(object_name(s.id, "tables", 0), readonly=True)
        with pytest.raises(OSError, match=r"broker\.0\.arena\.1 is not an extent the server made"):
            map_broker_extent(cache, s.id, 1, tables)  # (it never grew)
        path = "/dev/shm" + extent_name(s.id, 0, 2)
        at = CONTROL_EXTENTS_OFFSET + 8 * 2  # the worker's table says extent 2 has 64 MiB
        control.buf[at:at + 8] = (64 << 20).to_bytes(8, "little")
        try:
            run_as_nobody(SQUAT, {"path": path})  # another user's, of that size
            with pytest.raises(OSError, match="is not the server's"):
                map_worker_extent(cache, s.id, 0, 2, control)
            os.unlink(path)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # the server's uid, the wrong size
            os.ftruncate(fd, 16 << 20)
            os.close(fd)
            with pytest.raises(OSError, match="is not the server's"):
                map_worker_extent(cache, s.id, 0, 2, control)
        finally:
            control.buf[at:at + 8] = bytes(8)
            os.unlink(path)
    finally:
        cache.clear()


def test_a_growth_counts_and_makes_its_extent_under_the_servers_lock(server_factory):
    """Two workers growing at once would each see the same room in /dev/shm and take, between
    them, more than there is: a growth counts and makes its extent holding the server's counting
    lock (space.counting), which this test holds for a while."""
    import fcntl
    import threading

    s = server_factory.start([GROWTH_MODELS], ["--model-control-mode", "explicit", "--load-model", "identity"])
    fd = os.open(space.lock_path(s.id), os.O_RDONLY)
    done = threading.Event()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        worker = threading.Thread(target=lambda: (http_identity(s, 2 * MIB), done.set()), daemon=True)
        worker.start()
        assert not done.wait(3.0), "the growth did not wait for the lock"
        assert not extents(s.id)
    finally:
        os.close(fd)
    assert done.wait(60.0)
    assert len(extents(s.id)) == 1


def test_a_load_counts_and_makes_its_worker_segments_under_the_servers_lock(server_factory):
    """The broker's room check for a load and the worker segments it then makes hold the same
    lock as a growth: a worker growing in between would otherwise take the room the load counted."""
    import fcntl
    import threading

    s = server_factory.start([GROWTH_MODELS], ["--model-control-mode", "explicit"])
    loaded: list[bool] = []
    fd = os.open(space.lock_path(s.id), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        def load() -> None:
            with s.client() as c:
                c.load_model("identity")
            loaded.append(True)
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        time.sleep(2.0)
        assert not loaded and not worker_segments(s.id), "the load made its workers without the lock"
    finally:
        os.close(fd)
    loader.join(60.0)
    assert loaded and len(worker_segments(s.id)) == 1
    http_identity(s, 2 * MIB)  # and it serves, growing under the same lock


def test_an_answer_past_the_cap_is_a_500_naming_the_flag_and_the_next_request_works(server_factory):
    """No retry could serve it: a 500 (Triton's INTERNAL for an output its pool cannot take), not a
    503 that invites clients to try again."""
    s = server_factory.start([GROWTH_MODELS], ["--worker-arena-mb", "16"])
    x = np.zeros(8 * MIB, np.float32)  # 32 MiB: more than the cap
    inp = httpclient.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with s.client() as c:
        with pytest.raises(InferenceServerException) as e:
            c.infer("identity", [inp])
    assert e.value.status() == "500"
    assert "Failed to increase the shared memory pool size" in str(e.value)
    assert ("model instance 'identity_0_0' for a 33554560-byte response: larger than the cap of the instance's "
            "output arena lets it ever hold, --worker-arena-mb=16: raise it") in str(e.value)  # as docs/deploy.md
    http_identity(s, 16)
    http_identity(s, 2 * MIB)  # 8 MiB: a growth within the cap still works
    assert s.http_status("/v2/health/ready") == 200


def test_an_idle_extent_under_the_cap_makes_way_for_a_larger_answer(server_factory):
    """A 24 MiB answer grows a 25 MiB extent; a 48 MiB one then needs more than the 64 MiB cap
    leaves beside it, though nothing is in it: the idle extent goes and the answer is served,
    where it was a 503 "retry later" that no retry ever passed."""
    s = server_factory.start([GROWTH_MODELS], ["--worker-arena-mb", "64"])
    for _ in range(2):
        http_identity(s, 6 * MIB)  # 24 MiB
        http_identity(s, 12 * MIB)  # 48 MiB
        assert len(extents(s.id)) == 1, extents(s.id)
    http_identity(s, 16)
    assert "Traceback" not in s.log()


def test_the_backend_config_sets_the_first_extent(server_factory):
    s = server_factory.start([GROWTH_MODELS], ["--backend-config", "python,shm-default-byte-size=1048576",
                                               "--backend-config", "python,shm-growth-byte-size=2097152"])
    assert set(worker_segments(s.id).values()) == {WorkerSegment.lanes_nbytes(1 * MIB)}
    assert instance_bytes(1 * MIB) == WorkerSegment.lanes_nbytes(1 * MIB) + WorkerSegment.control_nbytes()
    assert "shm-default-byte-size" not in s.log()  # honoured: no warning that it has no effect
    http_identity(s, MIB // 2)


@pytest.mark.parametrize("setting, why", [
    ("python,shm-default-byte-size=lots", "expected a number of bytes"),
    ("python,shm-default-byte-size=1024", "must lie between"),
    (f"python,shm-default-byte-size={512 * MIB}", "--worker-arena-mb"),
    ("python,shm-growth-byte-size=0", "must be at least 1"),
])
def test_a_bad_arena_setting_is_refused_by_name(setting, why, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model-repository", str(GROWTH_MODELS), "--backend-config", setting])
    err = capsys.readouterr().err
    assert f"--backend-config {setting}" in err and why in err, err


def test_a_growth_that_does_not_fit_dev_shm_is_a_503_and_nothing_breaks(server_factory, tmp_path):
    flags = ["--model-control-mode", "explicit", "--load-model", "identity", "--frontend-arena-mb", "64",
             "--allow-grpc=false", "--http-workers", "1"]
    args = parse_args(["--model-repository", str(GROWTH_MODELS), *flags])
    need = startup_bytes(args) + instance_bytes(args.worker_arena_start_bytes)
    s = SmallShmServer(need + 24 * MIB, [GROWTH_MODELS], tmp_path, flags)
    server_factory.servers.append(s)
    s.start().wait_ready()
    x = np.zeros(8 * MIB, np.float32)  # 32 MiB: under the cap, over the room left
    inp = httpclient.InferInput("IN", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with s.client() as c:
        with pytest.raises(InferenceServerException) as e:
            c.infer("identity", [inp])
    text = str(e.value)
    assert "Failed to increase the shared memory pool size" in text and "docker run --shm-size" in text, text
    http_identity(s, 16)
    http_identity(s, MIB)  # 4 MiB: a growth that fits
    assert s.stop() == 0, s.log_tail()
    assert "Bus error" not in s.log() and "Traceback" not in s.log()


MANY = 40


def test_many_small_models_load_with_default_flags_in_little_dev_shm(server_factory, tmp_path):
    """MANY python models load on a /dev/shm that would not have held MANY whole arenas (each
    instance was counted at 257 MiB), and the server's objects total what docs/deploy.md says."""
    repo = tmp_path / "many"
    repo.mkdir()
    for i in range(MANY):
        model = repo / f"m{i}"
        shutil.copytree(GROWTH_MODELS / "identity", model)
        config = (model / "config.pbtxt").read_text().replace('name: "identity"', f'name: "m{i}"')
        (model / "config.pbtxt").write_text(config)
    args = parse_args(["--model-repository", str(repo), "--http-workers", "1"])  # (as the tests' servers)
    need = startup_bytes(args) + MANY * instance_bytes(args.worker_arena_start_bytes)
    assert need < MANY * instance_bytes(args.worker_arena_mb << 20) // 8
    s = SmallShmServer(need + 16 * MIB, [repo], tmp_path)
    server_factory.servers.append(s)
    started = time.monotonic()
    s.start().wait_ready(timeout=600)
    loaded = time.monotonic() - started
    status, index = post(s, "/v2/repository/index")
    assert status == 200 and sum(m.get("state") == "READY" for m in index) == MANY, index
    with s.client() as c:
        for i in (0, MANY - 1):
            inp = httpclient.InferInput("IN", [4], "FP32")
            inp.set_data_from_numpy(np.ones(4, np.float32))
            assert c.infer(f"m{i}", [inp]).as_numpy("OUT").tolist() == [1, 1, 1, 1]
    # What the namespace's /dev/shm holds by size: the start's share and MANY first extents.
    sizes = namespace_shm_sizes(s)
    total = sum(sizes.values())
    assert total <= need + SMALL_OBJECTS_BYTES, (space.mib(total), space.mib(need), sorted(sizes.items())[:5])
    print(f"{MANY} models: loaded in {loaded:.1f} s, /dev/shm objects {space.mib(total)}")
    assert s.stop() == 0, s.log_tail()
