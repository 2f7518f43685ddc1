"""One copy of a CPU PyTorch model's weights for all its instances (workers/shared_weights.py):
the instances answer as with their own copies, the server's memory grows by less than the
weights per added instance, a model that writes into its weights changes only its own copy, the
shared file goes with the version, and it is the server's user's alone: another user's file or
held lock at the next load's name changes neither the answers nor how long the load takes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from as_nobody import NOBODY, start_as

from shmserve.shm.names import SHM_DIR
from shmserve.tools import weights_memory
from shmserve.workers import shared_weights

MB = 32


@pytest.fixture
def scripted(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    model.eval()
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(model), str(path))
    return path


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.load
def test_instances_share_one_copy_and_writes_stay_private(scripted):
    sid, key = f"sw{os.getpid()}", "m.1.1"
    first, second = torch.jit.load(str(scripted)), torch.jit.load(str(scripted))
    x = torch.randn(3, 64)
    expected = first(x)
    try:
        size = shared_weights.share(first, sid, key)
        assert shared_weights.share(second, sid, key) == size > 0
        assert os.path.getsize(shared_weights.weights_path(sid, key)) == shared_weights.ALIGN + size
        assert torch.equal(first(x), expected) and torch.equal(second(x), expected)
        with torch.no_grad():
            next(first.parameters()).add_(1.0)  # copy-on-write: the other instance is untouched
        assert not torch.equal(first(x), expected) and torch.equal(second(x), expected)
    finally:
        for suffix in ("", ".lock"):
            path = shared_weights.weights_path(sid, key) + suffix
            if os.path.exists(path):
                os.unlink(path)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.load
def test_a_file_of_ours_not_whole_for_this_layout_is_written_again(scripted):
    """A file of the server's user at the key whose header or size is not this layout's (cut
    short, or another model's) is not mapped: it is removed and written again."""
    sid, key = f"swl{os.getpid()}", "m.1.1"
    model = torch.jit.load(str(scripted))
    x = torch.randn(3, 64)
    expected = model(x)
    path = shared_weights.weights_path(sid, key)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        os.write(fd, bytes(shared_weights.ALIGN + 64))  # a header of no layout, and too short
        os.close(fd)
        size = shared_weights.share(model, sid, key)
        assert os.path.getsize(path) == shared_weights.ALIGN + size
        assert torch.equal(model(x), expected)
    finally:
        for suffix in ("", ".lock"):
            if os.path.exists(path + suffix):
                os.unlink(path + suffix)


def test_a_second_instance_costs_less_than_the_weights():
    shared = weights_memory.measure(MB, 2, True)
    own = weights_memory.measure(MB, 2, False)
    assert shared["workers"] == own["workers"] == 2
    # Two own copies hold the weights twice; shared, once (give or take a few MB of heap).
    assert own["pss_mb"] - shared["pss_mb"] > MB * 0.6, (shared, own)


def test_the_shared_file_goes_with_the_version(server_factory, tmp_path):
    weights_memory.write_model(tmp_path, 4, 2, True)
    s = server_factory.start([tmp_path], ["--model-control-mode", "explicit", "--load-model", "weights"])
    files = [f for f in os.listdir(SHM_DIR) if f.startswith(f"shmserve.{s.id}.weights.")]
    assert any(not f.endswith(".lock") for f in files), files
    x = httpclient.InferInput("INPUT__0", [1024], "FP32")
    x.set_data_from_numpy(torch.ones(1024).numpy())
    assert s.client().infer("weights", [x]).as_numpy("OUTPUT__0").shape == (1024,)
    s.client().unload_model("weights")
    s.wait_until(lambda: not [f for f in os.listdir(SHM_DIR) if f.startswith(f"shmserve.{s.id}.weights.")],
                 "the shared weights removed")


def test_onnx_instances_share_weights_in_an_external_data_file():
    """SHARE_WEIGHTS "yes" turns onnxruntime's prepacking off: it then reads the weights from
    its mapping of the external data file, one copy in the page cache for every instance."""
    shared = weights_memory.measure(MB, 2, True, "onnx")
    own = weights_memory.measure(MB, 2, False, "onnx")
    assert shared["workers"] == own["workers"] == 2
    assert own["pss_mb"] - shared["pss_mb"] > MB * 0.6, (shared, own)


def weights_server(server_factory, tmp_path):
    """A server with the 'weights' model (two CPU instances sharing one copy) loaded."""
    weights_memory.write_model(tmp_path, 4, 2, True)
    return server_factory.start([tmp_path], ["--model-control-mode", "explicit", "--load-model", "weights"])


def answer(s) -> np.ndarray:
    x = httpclient.InferInput("INPUT__0", [1024], "FP32")
    x.set_data_from_numpy(np.linspace(-1, 1, 1024, dtype=np.float32))
    return s.client().infer("weights", [x]).as_numpy("OUTPUT__0")


def current_file(s) -> tuple[str, int]:
    """The path of the server's file of the load's weights, and its load number (the key's
    last part)."""
    stem = f"shmserve.{s.id}.weights.weights.1."
    found = [f for f in os.listdir(SHM_DIR) if f.startswith(stem) and f[len(stem):].isdigit()
             and os.stat(f"{SHM_DIR}/{f}").st_uid == os.geteuid()]
    assert len(found) == 1, found
    return f"{SHM_DIR}/{found[0]}", int(found[0][len(stem):])


def assert_ours_alone(path: str) -> None:
    st = os.stat(path, follow_symlinks=False)
    assert (st.st_uid, st.st_mode & 0o777, st.st_nlink) == (os.geteuid(), 0o600, 1), (path, st)


def reload(s, timeout: float) -> float:
    """Unload and load the model again (a new load: the next key); the seconds the load took."""
    for op in ("unload", "load"):
        start = time.monotonic()
        req = urllib.request.Request(f"http://{s.url}/v2/repository/models/weights/{op}", b"{}", method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            assert r.status == 200
    return time.monotonic() - start


def test_another_users_file_at_the_next_key_is_never_used(server_factory, tmp_path):
    """Another user who makes the next load's weights file first (a doctored copy, header and
    size right) gets no say in the answers: the server removes it and writes its own, 0600."""
    s = weights_server(server_factory, tmp_path)
    expected = answer(s)
    path, n = current_file(s)
    assert_ours_alone(path)
    assert_ours_alone(path + ".lock")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    data[shared_weights.ALIGN:] = bytes(len(data) - shared_weights.ALIGN)  # every weight and bias 0
    planted = [shared_weights.weights_path(s.id, f"weights.1.{k}") for k in range(n + 1, n + 4)]
    try:
        for p in planted:
            with open(p, "wb") as f:
                f.write(data)
            os.chmod(p, 0o644)
            os.chown(p, NOBODY.pw_uid, NOBODY.pw_gid)
        reload(s, 60)
        np.testing.assert_array_equal(answer(s), expected)
        path, _ = current_file(s)
        assert_ours_alone(path)
    finally:
        for p in planted:
            if os.path.lexists(p):
                os.unlink(p)


HOLD = """
import fcntl
held = []
for path in args:
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    held.append(fd)
print("HOLDING", flush=True)
sys.stdin.readline()
result = len(held)
"""


def test_a_lock_another_user_holds_does_not_delay_a_load(server_factory, tmp_path):
    """Another user who makes the next loads' lock files first and holds their locks makes no
    load wait: the lock a load waits on is the server's user's alone."""
    s = weights_server(server_factory, tmp_path)
    expected = answer(s)
    start = time.monotonic()
    reload(s, 60)
    usual = time.monotonic() - start
    _, n = current_file(s)
    locks = [shared_weights.weights_path(s.id, f"weights.1.{k}") + ".lock" for k in range(n + 1, n + 4)]
    holder = start_as(NOBODY.pw_uid, NOBODY.pw_gid, HOLD, locks)
    try:
        assert holder.stdout.readline().strip() == "HOLDING", holder.stderr.read()
        took = reload(s, 60)
        assert took < usual + 15, (took, usual)
        np.testing.assert_array_equal(answer(s), expected)
        path, _ = current_file(s)
        assert_ours_alone(path)
        assert_ours_alone(path + ".lock")
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.communicate(timeout=30)
        for p in locks:
            if os.path.lexists(p):
                os.unlink(p)


AS_ANOTHER_SERVER_USER = """
import json, os, sys, torch
from shmserve.workers import shared_weights
sid, key, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
os.setgroups([]); os.setgid(uid); os.setuid(uid)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
x = torch.randn(3, 64)
with torch.no_grad():
    expected = model(x)
    size = shared_weights.share(model, sid, key)
    print(json.dumps({"size": size, "same": bool(torch.equal(model(x), expected))}))
"""


def test_names_a_server_that_is_not_root_cannot_remove_are_passed_over():
    """A server's user other than root may not remove another user's files in a sticky /dev/shm:
    the load's instances pass over the keys where another user's lock file or weights file stands
    and meet at the next key, written 0600 as theirs, with the model's own weights."""
    sid, key, server_uid = f"swu{os.getpid()}", "m.1.1", 4242
    keys = [key, f"{key}~1", f"{key}~2"]  # (shared_weights.candidates)
    nobodys = [shared_weights.weights_path(sid, keys[0]) + ".lock", shared_weights.weights_path(sid, keys[1])]
    try:
        for path in nobodys:
            with open(path, "wb") as f:
                f.write(bytes(shared_weights.ALIGN))
            os.chmod(path, 0o666)
            os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
        got = []
        for _ in range(2):  # the first instance writes the file, the second maps it
            done = subprocess.run([sys.executable, "-c", AS_ANOTHER_SERVER_USER, sid, key, str(server_uid)],
                                  capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            got.append(json.loads(done.stdout.splitlines()[-1]))
        size = os.path.getsize(shared_weights.weights_path(sid, keys[2])) - shared_weights.ALIGN
        assert got == [{"size": size, "same": True}] * 2 and size > 0, got
        assert [os.stat(p).st_uid for p in nobodys] == [NOBODY.pw_uid] * 2  # (not the server user's to remove)
        assert not os.path.exists(shared_weights.weights_path(sid, keys[0]))
        for path in (shared_weights.weights_path(sid, keys[2]), shared_weights.weights_path(sid, keys[2]) + ".lock"):
            st = os.stat(path)
            assert (st.st_uid, st.st_mode & 0o777, st.st_nlink) == (server_uid, 0o600, 1), path
    finally:
        for k in keys:
            for path in (shared_weights.weights_path(sid, k), shared_weights.weights_path(sid, k) + ".lock"):
                if os.path.lexists(path):
                    os.unlink(path)
