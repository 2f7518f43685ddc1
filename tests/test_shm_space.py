"""Room in /dev/shm (shm/space.py, server/shm_needs.py): a server whose /dev/shm cannot hold its
segments fails at start with one line that says how to raise it, and a model load that would not
fit fails with the same kind of line while the server goes on, instead of a SIGBUS later.

The servers run in a mount namespace of their own (unshare, as root) with a small tmpfs on
/dev/shm, as a container with a small --shm-size has.
"""
from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from as_nobody import NOBODY
from conftest import PRODUCT_MODELS, PYTHON, ROOT, TESTS, TEST_MODELS, Server
import tmpfs

from shmserve.shm import space
from shmserve.server.cli import parse_args
from shmserve.server.shm_needs import instance_bytes, startup_bytes

MIB = 1 << 20
PIB = 1 << 50


def small_shm(size_bytes: int) -> list[str]:
    """A command prefix: a private mount namespace whose /dev/shm is a tmpfs of ``size_bytes``."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            f'mount -t tmpfs -o size={size_bytes},mode=1777 tmpfs /dev/shm && exec "$@"', "sh"]


class SmallShmServer(Server):
    """A server started under ``small_shm``; its objects vanish with its namespace."""

    def __init__(self, shm_bytes: int, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.shm_bytes = shm_bytes

    def command(self) -> list[str]:
        return small_shm(self.shm_bytes) + super().command()


def post(server: Server, path: str, body: bytes = b"{}") -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{server.url}{path}", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def add_sub(server: Server) -> None:
    a = np.arange(16, dtype=np.int32)
    inputs = [httpclient.InferInput("INPUT0", [16], "INT32"), httpclient.InferInput("INPUT1", [16], "INT32")]
    for i in inputs:
        i.set_data_from_numpy(a)
    with server.client() as c:
        np.testing.assert_array_equal(c.infer("add_sub", inputs).as_numpy("OUTPUT0"), 2 * a)


def test_a_server_refuses_a_dev_shm_too_small_for_its_start_in_one_line(tmp_path):
    flags = ["--model-repository", str(PRODUCT_MODELS), "--http-port", "0", "--grpc-port", "0",
             "--metrics-port", "0", "--id", f"small{os.getpid()}"]
    done = subprocess.run(small_shm(8 * MIB) + [PYTHON, "-m", "shmserve", *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    lines = (done.stdout + done.stderr).splitlines()
    assert len(lines) == 1, lines
    args = parse_args(flags)
    need = startup_bytes(args)
    assert lines[0].startswith(f"shmserve: error: shmserve at start ({args.http_workers} HTTP frontend(s) and the "
                               f"gRPC frontend with --frontend-arena-mb=256, "
                               f"the broker) needs {space.mib(need)} of shared memory"), lines[0]
    assert "and /dev/shm has 8 MiB left" in lines[0]
    for how in ("docker run --shm-size", "podman run --shm-size", "emptyDir (medium: Memory, sizeLimit)"):
        assert how in lines[0]


def start_with_room_for_one_and_a_half(server_factory, tmp_path, frontend_mb: int) -> tuple[Server, int]:
    """A server (explicit mode, add_sub and sleeper in its repository) whose /dev/shm holds its
    start and one model instance and a half, with 16 MiB worker arenas made whole at the start;
    and one instance's bytes."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for model in (PRODUCT_MODELS / "add_sub", TEST_MODELS / "sleeper"):
        os.symlink(model, repo / model.name)
    flags = ["--model-control-mode", "explicit", "--frontend-arena-mb", str(frontend_mb), "--worker-arena-mb", "16",
             "--http-workers", "1",
             "--backend-config", f"python,shm-default-byte-size={16 * MIB}"]  # arenas made whole from the start
    need = startup_bytes(parse_args(["--model-repository", str(repo), *flags]))
    each = instance_bytes(16 * MIB)
    s = SmallShmServer(need + each * 3 // 2, [repo], tmp_path, flags)
    server_factory.servers.append(s)
    s.start().wait_ready()
    return s, each


def test_a_load_that_does_not_fit_fails_in_one_line_and_the_server_goes_on(server_factory, tmp_path):
    # add_sub's one instance fits, sleeper's two do not.
    s, each = start_with_room_for_one_and_a_half(server_factory, tmp_path, frontend_mb=4)

    assert post(s, "/v2/repository/models/add_sub/load") == (200, {})
    add_sub(s)
    status, body = post(s, "/v2/repository/models/sleeper/load")
    assert status == 400
    message = body["error"]
    assert message.startswith(f"failed to load 'sleeper', the load needs {space.mib(2 * each)} of shared memory "
                              f"(2 instance(s) of {space.mib(each)} each, growing up to --worker-arena-mb=16 with answers: "
                              f"--backend-config=python,shm-default-byte-size={16 * MIB} sets the start), and "
                              f"/dev/shm has ")
    assert "docker run --shm-size" in message and "emptyDir" in message
    assert "\n" not in message
    add_sub(s)  # what serves goes on serving
    assert s.http_status("/v2/health/live") == 200
    assert s.stop() == 0, s.log_tail()
    assert "Bus error" not in s.log() and "Traceback" not in s.log()


@pytest.fixture
def shm(tmp_path) -> Path:
    """A 8 MiB tmpfs of the test's own."""
    with tmpfs.mounted(tmp_path / "shm", "8m", mode="755") as folder:
        yield folder


def test_room_is_the_free_space_less_what_the_servers_objects_may_still_take(shm):
    assert space.free_bytes(str(shm)) == 8 * MIB
    fd = os.open(shm / "shmserve.s1.worker.0", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4 * MIB)  # reserves nothing on tmpfs
        assert space.free_bytes(str(shm)) == 8 * MIB
        assert space.unbacked_bytes("s1", str(shm)) == 4 * MIB
        assert space.unbacked_bytes("s2", str(shm)) == 0  # another server's objects are its own
        squat = shm / "shmserve.s1.squat"  # another user's file of our names: not ours to count
        squat.touch(mode=0o600)
        os.truncate(squat, PIB)  # 1 PiB, no page
        os.chown(squat, NOBODY.pw_uid, NOBODY.pw_gid)
        assert space.unbacked_bytes("s1", str(shm)) == 4 * MIB
        os.pwrite(fd, b"x" * MIB, 0)  # the pages a writer touches are taken
        assert space.unbacked_bytes("s1", str(shm)) == 3 * MIB
        assert space.room("s1", str(shm)) == 4 * MIB
        space.check("s1", 4 * MIB, "a segment", folder=str(shm))
        with pytest.raises(space.NoRoom) as caught:
            space.check("s1", 4 * MIB + 1, "a segment", " (a note)", folder=str(shm))
        assert str(caught.value) == (f"a segment needs 5 MiB of shared memory (a note), and {shm} has 4 MiB left; "
                                     f"{space.HOW_TO_RAISE}")
        assert caught.value.errno == 28  # ENOSPC, as the write that would have failed
    finally:
        os.close(fd)


def test_another_users_sparse_file_of_the_servers_names_does_not_stop_growth(server_factory):
    """Anyone may make a file named like the server's objects in /dev/shm, sparse and of any
    size: another user's 1 PiB one holds no page and is not counted, so an answer that needs a
    new extent of the arena is still served."""
    s = server_factory.start([TESTS / "models" / "growth"],
                             ["--model-control-mode", "explicit", "--load-model", "identity"])
    squat = f"/dev/shm/shmserve.{s.id}.squat"
    fd = os.open(squat, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, PIB)
        os.fchown(fd, NOBODY.pw_uid, NOBODY.pw_gid)
        x = np.arange(4 * MIB, dtype=np.float32)  # 16 MiB: past the 4 MiB first extent
        inp = httpclient.InferInput("IN", [x.size], "FP32")
        inp.set_data_from_numpy(x)
        with s.client() as c:
            np.testing.assert_array_equal(c.infer("identity", [inp]).as_numpy("OUT"), x)
        assert any(".arena." in name for name in os.listdir("/dev/shm") if name.startswith(f"shmserve.{s.id}."))
    finally:
        os.close(fd)
        os.unlink(squat)


def test_pages_are_taken_before_they_are_written_or_refused_when_the_filesystem_is_full(shm):
    """What every arena's head and every new segment does (shm/space.py ``take_pages``), and the
    same through posix_fallocate for a kernel without MADV_POPULATE_WRITE; where a write would
    have been a SIGBUS, both say False."""
    import mmap

    path = shm / "shmserve.s1.client.1-0"
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 16 * MIB)
        mapping = mmap.mmap(fd, 16 * MIB)
        assert space.take_pages(mapping, "/unused", 100, 3 * MIB)
        assert os.fstat(fd).st_blocks * 512 == 3 * MIB  # (from the page 100 is in)
        assert space.take_pages(mapping, "/unused", 0, 3 * MIB)  # taken already: nothing changes
        assert space.fallocate(str(path), 3 * MIB, 5 * MIB)
        assert os.fstat(fd).st_blocks * 512 == 5 * MIB
        assert not space.take_pages(mapping, "/unused", 5 * MIB, 12 * MIB)  # 8 MiB in all
        assert not space.fallocate(str(path), 5 * MIB, 12 * MIB)
        mapping[:5 * MIB] = b"\x01" * (5 * MIB)  # the pages taken are written without a fault
        assert space.fallocate(str(shm / "gone"), 0, MIB)  # nothing left to take pages for
        mapping.close()
    finally:
        os.close(fd)


def test_the_frontends_segments_exist_from_the_start_so_loads_cannot_take_their_room(server_factory, tmp_path):
    """The start's check counts every frontend's segment; they are made at start, not at a first
    request, so the room a load is given never includes a frontend's (the gRPC frontend made its
    own at its first call, and a later load could overcommit /dev/shm by its size). With a
    frontend's 16 MiB not yet made, a load would see room for two instances and a half, and
    sleeper's two would be let in."""
    s, each = start_with_room_for_one_and_a_half(server_factory, tmp_path, frontend_mb=16)
    status, body = post(s, "/v2/repository/models/sleeper/load")
    assert status == 400, body
    assert body["error"].startswith(f"failed to load 'sleeper', the load needs {space.mib(2 * each)}")
    assert post(s, "/v2/repository/models/add_sub/load") == (200, {})
    add_sub(s)
    assert s.stop() == 0, s.log_tail()


def test_the_readme_sizes_dev_shm_for_the_repository_it_serves():
    """The README's container command must hold what model_repository/ starts: the start's
    segments and one per model instance."""
    import re

    from shmserve.server.broker.config import instance_count, load_config

    readme = (ROOT / "README.md").read_text()
    instances = sum(instance_count(load_config(folder, strict=False)) for folder in sorted(PRODUCT_MODELS.iterdir())
                    if (folder / "config.pbtxt").exists())
    words = {8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    assert f"per model instance ({words[instances]} here" in readme
    args = parse_args(["--model-repository", str(PRODUCT_MODELS)])
    need = startup_bytes(args) + instances * instance_bytes(args.worker_arena_start_bytes)
    for doc in (readme, (ROOT / "docs" / "deploy.md").read_text()):
        sizes = re.findall(r"--shm-size=(\d+)g -p 8000-8002:8000-8002 -v \"\$PWD/model_repository", doc)
        assert sizes and all(int(g) << 30 >= need for g in sizes), (sizes, need >> 20)
