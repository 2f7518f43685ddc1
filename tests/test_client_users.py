"""Local clients of another user than the server's, as an application container with its own
runAsUser beside the server in one pod: ``--local-client-users`` names them (shm/access.py).
They get an ACL entry on what clients open (owner, and the users named; `ls` shows the ACL's
mask as the group's bits, but the owning group and others get nothing), and nothing else changes for
them: a user not named is refused with a clear error, a named client's own objects stay its own,
and one killed mid-request is reclaimed. The server runs as root here (this host's interpreter
lies under /root); the podman test (tests/test_pod.py) runs it as uid 1000 and the application
as uid 2000, where the client's objects must name the server's user too.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time

import numpy as np
import pytest
import tritonclient.http as httpclient

from as_nobody import NOBODY, result_after, run_as, run_as_nobody, start_as, stop
from conftest import DEADLINE_S, PRODUCT_MODELS, SHM_MODELS, TESTS, edge_refusals, http_connections, shm_names, wait_until
from gates import Gate
from shmserve.shm.access import acl, readers_of
from shmserve.shm.client import Client
from shmserve.shm.extents import DEFAULT_START_BYTES

GROWTH_MODELS = TESTS / "models" / "growth"
STRANGER = 4321  # a user no one named (not even in the user database): a third container's
LOADED = ["add_sub", "slow_reader", "identity", "identity_ens"]

# A client of a named user: plain inputs, a region of its own, an answer large enough to grow the
# worker's arena into a new extent, and an ensemble; then what it sees of the objects.
CLIENT = r"""
from shmserve.shm.access import readers_of
from shmserve.shm.client import ServerUnavailable
c = Client(args["server"])
a = np.arange(16, dtype=np.int32)
result = {"add": c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist()}
region = c.create_region("users_mine", 4096)
x = region.array(np.int32, (16,))
x[:] = 5
result["region"] = c.infer("add_sub", {"INPUT0": x, "INPUT1": a})["OUTPUT0"].tolist()
big = np.full(3 << 20, 1.5, dtype=np.float32)  # 12 MiB: past extent 0 (4 MiB)
out = c.infer("identity", {"IN": big})["OUT"]
result["big"] = [int(out.size), float(out.sum())]
result["ensemble"] = c.infer("identity_ens", {"IN": np.ones(8, np.float32)})["OUT"].tolist()
seg = "/dev/shm" + c._conn.name
result["segment"] = [c._conn.name, oct(os.stat(seg).st_mode & 0o777), list(readers_of(seg))]
c.close()
"""

STRANGER_CLIENT = r"""
from shmserve.shm.client import ServerUnavailable
try:
    Client(args["server"])
    result = "connected"
except ServerUnavailable as e:
    result = str(e)
"""

# Holds a request in slow_reader at the gate, says its segment, then waits to be killed.
HELD = r"""
c = Client(args["server"])
a = np.arange(8, dtype=np.int32)
held = c.infer_async("slow_reader", {"X": a}, parameters={"sleep_s": 0, "gate": args["gate"]})
print("SEGMENT " + c._conn.name, flush=True)
sys.stdin.read()
"""


def _start(factory, *flags: str):
    return _start_as_id(factory, None, *flags)


def _start_as_id(factory, server_id: str | None, *flags: str):
    loads = [arg for name in LOADED for arg in ("--load-model", name)]
    return factory.start([PRODUCT_MODELS, SHM_MODELS, GROWTH_MODELS],
                         ["--model-control-mode", "explicit", *loads, *flags], server_id=server_id)


@pytest.fixture(scope="module")
def users_server(module_factory):
    return _start(module_factory, "--local-client-users=nobody")


def test_a_client_of_a_named_user_is_served_over_every_object_it_opens(users_server):
    got = run_as_nobody(CLIENT, {"server": users_server.id})
    a = np.arange(16)
    assert got["add"] == (2 * a).tolist() and got["region"] == (5 + a).tolist()
    assert got["big"] == [3 << 20, 1.5 * (3 << 20)]
    assert got["ensemble"] == [1.0] * 8
    name, mode, readers = got["segment"]
    # The server is root here: the client's segment needs no entry, and stays its own.
    assert mode == "0o600" and readers == [], got["segment"]  # (no ACL: its mode is what it says)
    assert not shm_names(name.lstrip("/")), "the client removed its segment when it closed"
    # The server's objects clients open: 0600, with one entry for nobody.
    objects = [n for n in os.listdir("/dev/shm") if users_server.id in n]
    broker = f"/dev/shm/shmserve.{users_server.id}.broker.0"
    assert os.getxattr(broker, "system.posix_acl_access") == acl((NOBODY.pw_uid,))  # group and others: none
    assert os.stat(broker).st_mode & 0o007 == 0
    # What workers trust (lane holders, routes, regions) lies beside it, for nobody to read only.
    tables = f"/dev/shm/shmserve.{users_server.id}.tables.0"
    assert os.getxattr(tables, "system.posix_acl_access") == acl((NOBODY.pw_uid,), write=False)
    # A worker's segment is the server's user's alone; nobody's clients' lanes lie beside it, in an
    # object only nobody (and the server's user) may open.
    workers = [n for n in objects if ".worker." in n and not n.endswith(".fifo") and ".arena." not in n
               and ".lanes." not in n]
    assert workers and all(readers_of("/dev/shm/" + n) == () for n in workers), objects
    lanes = [n for n in objects if ".lanes." in n]
    assert sorted(lanes) == sorted(f"{n}.lanes.u{NOBODY.pw_uid}" for n in workers), objects
    assert all(readers_of("/dev/shm/" + n) == (NOBODY.pw_uid,) for n in lanes), objects
    controls = [n for n in objects if ".control." in n]
    assert controls and all(os.getxattr("/dev/shm/" + n, "system.posix_acl_access") == acl((NOBODY.pw_uid,), write=False)
                            for n in controls), objects
    assert readers_of(f"/dev/shm/shmserve.{users_server.id}.batches.0") == ()
    # No semaphore is a client's to write: receivers sleep on their flag words (shm/futex.py).
    semaphores = [n for n in os.listdir("/dev/shm") if n.startswith(f"sem.shmserve.{users_server.id}.")]
    assert semaphores and all(readers_of("/dev/shm/" + n) == () for n in semaphores), semaphores
    # Answers lie in extents of each user's own: nobody's, or the server's user's alone.
    extents = {n: readers_of("/dev/shm/" + n) for n in objects if ".arena." in n}
    assert set(extents.values()) == {(), (NOBODY.pw_uid,)}, extents
    assert sum(".worker." in n and readers == (NOBODY.pw_uid,) for n, readers in extents.items()) >= 2, \
        f"nobody's home extent, and one the 12 MiB answer grew: {extents}"
    # A home extent is as small as a worker's first, the broker's too (its first is 60 MiB).
    homes = [os.stat("/dev/shm/" + n).st_size for n, readers in extents.items()
             if ".broker." in n and readers == (NOBODY.pw_uid,)]
    assert homes == [DEFAULT_START_BYTES], extents


# A client of a named user: answers marked with its own values (a model's and an ensemble's), held;
# then, when told, what it finds of every user's marks in the server's objects it can open.
PEEK = r"""
c = Client(args["server"])
kept = [c.infer("identity", {"IN": np.full(64, args["mine"][0], np.float32)}),
        c.infer("identity_ens", {"IN": np.full(64, args["mine"][1], np.float32)})]
assert [float(k["OUT"][0]) for k in kept] == args["mine"]
print("HELD", flush=True)
sys.stdin.readline()
marks = {float(v): np.full(64, v, np.float32).tobytes() for v in args["all"]}
found = {}
for name in os.listdir("/dev/shm"):
    if args["server"] not in name:
        continue
    try:
        with open("/dev/shm/" + name, "rb") as f:
            data = f.read()
    except OSError:
        continue  # not this user's to open
    for value, mark in marks.items():
        if mark in data:
            found.setdefault(value, []).append(name)
result = {str(k): v for k, v in found.items()}
c.close()
"""


def test_a_named_user_reads_no_answer_but_its_own_users(server_factory):
    """Each user's clients get their answers in extents only that user and the server's can open
    (shm/extents.py): a client of a named user finds its own marks where it looks, and no mark of
    the server's user's clients (local, HTTP, an ensemble's answer from the broker) or of another
    named user's, while all of them still hold those answers."""
    server = _start(server_factory, f"--local-client-users=nobody,{STRANGER}")
    root, root_ens, over_http, nobody, nobody_ens, stranger, stranger_ens = 1111.5, 2222.5, 3333.5, 4444.5, \
        5555.5, 6666.5, 7777.5
    marks = [root, root_ens, over_http, nobody, nobody_ens, stranger, stranger_ens]
    with Client(server.id) as c:
        kept = [c.infer("identity", {"IN": np.full(64, root, np.float32)}),
                c.infer("identity_ens", {"IN": np.full(64, root_ens, np.float32)})]
        with httpclient.InferenceServerClient(server.url) as http:
            x = httpclient.InferInput("IN", [64], "FP32")
            x.set_data_from_numpy(np.full(64, over_http, np.float32))
            assert http.infer("identity", [x]).as_numpy("OUT")[0] == over_http
        held = start_as(NOBODY.pw_uid, NOBODY.pw_gid, PEEK, {"server": server.id, "mine": [nobody, nobody_ens],
                                                               "all": marks})
        try:
            assert held.stdout.readline().strip() == "HELD", held.stderr.read()
            seen = run_as(STRANGER, STRANGER, PEEK.replace("sys.stdin.readline()", ""),
                          {"server": server.id, "mine": [stranger, stranger_ens], "all": marks})
            seen_by_nobody = result_after(held, timeout=60)
        finally:
            stop(held)
        assert [float(k["OUT"][0]) for k in kept] == [root, root_ens]
    assert set(seen) == {str(stranger), str(stranger_ens)}, seen
    assert set(seen_by_nobody) == {str(nobody), str(nobody_ens)}, seen_by_nobody
    # Where it found its own: its segment (its inputs), and answers in extents of its own.
    assert any(".arena." in name for name in seen[str(stranger)]), seen
    assert any(".broker.0.arena." in name for name in seen_by_nobody[str(nobody_ens)]), seen_by_nobody


def test_a_user_not_named_is_refused_by_name(users_server):
    said = run_as(STRANGER, STRANGER, STRANGER_CLIENT, {"server": users_server.id})
    assert "runs as another user" in said and f"--local-client-users={STRANGER}" in said, said


def test_without_the_flag_another_user_is_refused(server_factory):
    plain = _start(server_factory)
    said = run_as_nobody(STRANGER_CLIENT, {"server": plain.id})
    assert "runs as another user" in said and f"uid {NOBODY.pw_uid}" in said, said
    assert readers_of(f"/dev/shm/shmserve.{plain.id}.broker.0") == ()


# Makes an object at a name of the server's before it starts, writable by all (so that the user it
# is named for can open it), as any local user may.
SQUAT = r"""
fd = os.open(args["path"], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
os.fchmod(fd, 0o666)
os.ftruncate(fd, 1 << 20)
os.close(fd)
result = "made"
"""


def test_a_connect_ring_another_user_made_is_refused_by_name(server_factory):
    """Any local user may make /dev/shm/shmserve.<id>.connect.u<uid> before the server starts. A
    server that may remove it (root, as here) does so at start, and that user connects; where it
    may not (another user's file in a sticky /dev/shm), the broker says that user cannot connect,
    and that user's library refuses the object by name instead of announcing itself there and
    waiting for a lane no one would give (here the object is put in place of the server's)."""
    import pwd
    import uuid

    daemon = pwd.getpwnam("daemon")
    sid = f"squat{uuid.uuid4().hex[:8]}"
    path = f"/dev/shm/shmserve.{sid}.connect.u{NOBODY.pw_uid}"
    assert run_as(daemon.pw_uid, daemon.pw_gid, SQUAT, {"path": path}) == "made"
    try:
        server = _start_as_id(server_factory, sid, "--local-client-users=nobody")
        assert os.stat(path).st_uid == os.geteuid()  # (the server's own now)
        assert run_as_nobody(CLIENT, {"server": sid})["add"] == (2 * np.arange(16)).tolist()
        os.unlink(path)
        assert run_as(daemon.pw_uid, daemon.pw_gid, SQUAT, {"path": path}) == "made"
        said = run_as_nobody(STRANGER_CLIENT, {"server": sid})
        assert f"{path[len('/dev/shm'):]}, was made by uid {daemon.pw_uid}, not by the server" in said, said
        with Client(server.id) as local:
            a = np.arange(16, dtype=np.int32)
            assert local.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
    finally:
        if os.path.exists(path):
            os.unlink(path)


def test_a_client_of_another_user_killed_mid_request_is_reclaimed(users_server, tmp_path):
    gate = Gate(tmp_path / "gate")
    gate.folder.chmod(0o777)
    tmp_path.chmod(0o755)
    proc = start_as(NOBODY.pw_uid, NOBODY.pw_gid, HELD, {"server": users_server.id, "gate": gate.param})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("SEGMENT "), (line, proc.stderr.read() if proc.poll() is not None else "")
        segment = line.split()[1].lstrip("/")
        gate.wait_started(1)
        workers = users_server.worker_pids("slow_reader")
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE_S)
        wait_until(lambda: not shm_names(segment), "the killed client's segment is reclaimed", DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=DEADLINE_S)
    gate.open()
    with users_server.client() as http:
        import tritonclient.http as httpclient

        x = httpclient.InferInput("X", [4], "INT32")
        x.set_data_from_numpy(np.arange(4, dtype=np.int32))
        assert http.infer("slow_reader", [x], parameters={"sleep_s": 0}).as_numpy("SUM").tolist() == [6]
    assert users_server.worker_pids("slow_reader") == workers


# Tries to write what the server's processes trust: the region table (a worker opens the object
# a region names as the server's user) and the lane holders, through its own mapping and anew.
TABLES = r"""
c = Client(args["server"])
broker = c._conn.broker
result = {}
def departures():
    broker.departures[0] += 1
for what, write in (("regions", lambda: broker.regions.publish(b'{"regions": {}}')),
                    ("lanes", lambda: broker.set_lane_client(0, "/elsewhere", 1)),
                    ("departures", departures),
                    ("open", lambda: os.open(args["tables"], os.O_RDWR)),
                    ("control", lambda: os.open(args["control"], os.O_RDWR)),
                    ("batches", lambda: os.open(args["batches"], os.O_RDONLY))):
    try:
        write()
        result[what] = "written"
    except (TypeError, ValueError, PermissionError) as e:
        result[what] = type(e).__name__
a = np.arange(16, dtype=np.int32)
result["add"] = c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist()[:4]
c.close()
"""


def test_a_named_user_cannot_write_what_workers_trust(users_server):
    """What a worker acts on as the server's user lies where a client of another user cannot
    write: the broker's tables (read only: its departures counter too, which a client bumping
    it kept workers remapping and one holding it still kept them mapping every departed segment),
    a worker's control object (its inbox and outbox; read only) and the batch manifests (not even
    readable). It is still served."""
    sid = users_server.id
    got = run_as_nobody(TABLES, {"server": sid, "tables": f"/dev/shm/shmserve.{sid}.tables.0",
                                 "control": f"/dev/shm/shmserve.{sid}.control.0",
                                 "batches": f"/dev/shm/shmserve.{sid}.batches.0"})
    assert got == {"regions": "TypeError", "lanes": "TypeError", "departures": "ValueError",
                   "open": "PermissionError", "control": "PermissionError", "batches": "PermissionError",
                   "add": [0, 2, 4, 6]}


# Lowers, every 0.2 ms for args["secs"], the words where a receiver's sleeping flag could lie in the
# objects a named user may write (broker.0 and its lanes beside every worker.<n>), after trying to
# open the objects that hold the broker's and the workers' flags (tables.0, control.<n>), and a
# worker's segment, for writing.
LOWER_FLAGS = r"""
import mmap, struct, time  # (modules loaded already: nobody cannot read the interpreter's folders)
from shmserve.shm.channel import BrokerSegment, WorkerSegment
sid = args["server"]
broker, worker = BrokerSegment.attach(sid), WorkerSegment.attach(f"/shmserve.{sid}.worker.0")
result = {"read-only flags": [broker.waker.flag.readonly, worker.waker.flag.readonly]}
broker.close()
worker.close()
for what in ("tables.0", "control.0", "worker.0"):
    try:
        os.close(os.open(f"/dev/shm/shmserve.{sid}.{what}", os.O_RDWR))
        result[what] = "opened"
    except PermissionError:
        result[what] = "PermissionError"
maps = []
for entry in sorted(os.listdir("/dev/shm")):
    parts = entry.split(".")
    if entry == f"shmserve.{sid}.broker.0" or (entry.startswith(f"shmserve.{sid}.worker.")
                                               and entry.endswith(f".lanes.u{os.getuid()}")):
        path = "/dev/shm/" + entry
        fd = os.open(path, os.O_RDWR)
        maps.append(mmap.mmap(fd, 4096))
        os.close(fd)
result["maps"] = len(maps)
print("lowering", flush=True)
end = time.monotonic() + args["secs"]
while time.monotonic() < end:
    for m in maps:
        struct.pack_into("<I", m, 64, 0)
    time.sleep(0.0002)
"""


def test_a_named_user_cannot_lower_the_flags_that_wake_the_broker_and_workers(users_server):
    """A worker's and the broker's sleeping flags lay in objects every named user may write: one
    that lowered them under a sleeping receiver swallowed every producer's wake-up, so each
    request waited out the receiver's sleep (10 s for a worker). They lie where such a user may
    only read now, and requests sent while it tries are answered at once."""
    a = np.arange(16, dtype=np.int32)
    proc = start_as(NOBODY.pw_uid, NOBODY.pw_gid, LOWER_FLAGS, {"server": users_server.id, "secs": 8})
    try:
        assert proc.stdout.readline().strip() == "lowering", proc.stderr.read()
        with users_server.client() as http:
            took = []
            for _ in range(5):
                time.sleep(0.3)  # (the worker and the broker go to sleep meanwhile)
                inputs = [httpclient.InferInput(n, [16], "INT32") for n in ("INPUT0", "INPUT1")]
                for t in inputs:
                    t.set_data_from_numpy(a)
                started = time.monotonic()
                assert http.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist() == (2 * a).tolist()
                assert http.is_model_ready("add_sub")  # (a control request: the broker answers it)
                took.append(time.monotonic() - started)
        out, err = proc.communicate(timeout=DEADLINE_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    got = json.loads(out.splitlines()[-1][len("RESULT "):])
    workers = sum(t.startswith("shmserve worker ") for t in users_server.titles().values())
    assert got == {"read-only flags": [True, True], "tables.0": "PermissionError", "control.0": "PermissionError",
                   "worker.0": "PermissionError", "maps": 1 + workers}, got
    assert max(took) < 2.0, took  # (a lost wake-up costs the worker's 10 s sleep, the broker's 1 s)
    # The server's user maps both flags writable: it lowers a flag as it wakes its receiver, so no
    # wake-up of its is lost in the instant before the receiver's wait (waker.py).
    from shmserve.shm.channel import BrokerSegment, WorkerSegment

    broker, worker = BrokerSegment.attach(users_server.id), WorkerSegment.attach(f"/shmserve.{users_server.id}.worker.0")
    try:
        assert [broker.waker.flag.readonly, worker.waker.flag.readonly] == [False, False]
    finally:
        broker.close()
        worker.close()


# Puts a link to a file of the server's user where its wake-up FIFO was, then has requests
# answered while it says it sleeps (so that the worker and the broker post to that path).
FIFO_SWAP = r"""
import time
from shmserve.shm.completion import Answer
from shmserve.shm.connection import Connection
from shmserve.shm.descriptor import InferRequest, InputTensor
from shmserve.shm.waker import SLEEPING
conn = Connection(args["server"], loop_driven=True)
os.unlink(conn.seg.fifo_path)
os.symlink(args["target"], conn.seg.fifo_path)
answered = 0
for _ in range(3):
    conn.seg.waker.flag[0] = SLEEPING
    ans = Answer()
    conn.infer(InferRequest("add_sub", "", [InputTensor("INPUT0", "INT32", [16], 64, 0),
                                            InputTensor("INPUT1", "INT32", [16], 64, 64)]),
               [np.zeros(16, np.int32), np.zeros(16, np.int32)], ans)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not ans.done():
        conn.complete_ready()
        time.sleep(0.01)
    if ans.done():
        answered += 1
        ans.completion.release()
os.unlink(conn.seg.fifo_path)
conn.close()
result = answered
"""


def test_a_named_users_swapped_fifo_is_never_written_through(users_server, tmp_path):
    """A FIFO-woken client owns the path of its FIFO in /dev/shm, which anyone writes: a process of
    the server's user writes only to a FIFO of that client there, never through a link it put in
    its place (here, to a file of the server's user; the host may let root follow it)."""
    target = tmp_path / "servers_own"
    target.write_bytes(b"the server user's file\n")
    target.chmod(0o600)
    tmp_path.chmod(0o755)
    workers = users_server.worker_pids("add_sub")
    answered = run_as_nobody(FIFO_SWAP, {"server": users_server.id, "target": str(target)})
    assert target.read_bytes() == b"the server user's file\n"
    assert answered == 3, "its answers still came (it looked for them itself)"
    assert users_server.worker_pids("add_sub") == workers


# Holds a lock on the whole broker segment's file (which a named user may open), tries the
# server's counting lock, says what it got, then waits to be killed.
LOCKER = r"""
import fcntl
fd = os.open(args["broker"], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
try:
    os.open(args["lock"], os.O_RDONLY)
    opened = "opened"
except PermissionError:
    opened = "refused"
print("HELD " + opened, flush=True)
sys.stdin.read()
"""


def test_a_named_user_holding_locks_on_the_broker_file_stalls_no_growth(users_server):
    """The lock under which segments are counted and made (shm/space.py) lies on a file only the
    server's user opens: a client that locks every file it can open stalls no worker's growth."""
    import tritonclient.http as httpclient

    from shmserve.shm import space

    sid = users_server.id
    proc = start_as(NOBODY.pw_uid, NOBODY.pw_gid, LOCKER,
                    {"broker": f"/dev/shm/shmserve.{sid}.broker.0", "lock": space.lock_path(sid)})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
        assert ready, "the locking client did not start"
        assert proc.stdout.readline().strip() == "HELD refused"
        before = {n for n in os.listdir("/dev/shm") if sid in n and ".arena." in n}
        n = 6 << 20  # 24 MiB of float32: past extent 0 and past the extent a 12 MiB answer made
        x = np.arange(n, dtype=np.float32)
        inp = httpclient.InferInput("IN", [n], "FP32")
        inp.set_data_from_numpy(x)
        with users_server.client(network_timeout=DEADLINE_S) as http:
            out = http.infer("identity", [inp]).as_numpy("OUT")
        np.testing.assert_array_equal(out, x)
        after = {n for n in os.listdir("/dev/shm") if sid in n and ".arena." in n}
        assert after - before, f"the answer grew a new extent: {sorted(after)}"
    finally:
        proc.kill()
        proc.communicate(timeout=DEADLINE_S)


# Holds the lock of its own user's connect ring (the first byte of connect.u<uid>) until killed,
# as a client of a named user may, after trying to open the other rings for writing.
CONNECT_LOCKER = r"""
from shmserve.shm.liveness import try_lock_byte
sid = args["server"]
opened = {}
for what in ("connect.0", "connect.u%d" % args["other"]):
    try:
        os.close(os.open(f"/dev/shm/shmserve.{sid}.{what}", os.O_RDWR))
        opened[what] = "opened"
    except PermissionError:
        opened[what] = "PermissionError"
fd = os.open(f"/dev/shm/shmserve.{sid}.connect.u{os.geteuid()}", os.O_RDWR)
print(("HELD " if try_lock_byte(fd, 0) else "NOT HELD ") + json.dumps(opened), flush=True)
sys.stdin.read()
"""


def test_a_named_user_holding_the_connect_lock_keeps_no_other_user_from_connecting(server_factory):
    """A named user may take the lock of the connect ring it writes and keep it. When every
    client of another user than the server's announced itself on one ring in broker.0, no
    other named user's client could connect then; the server's own user connects on a ring of
    its own (connect.0), or no frontend the launcher restarted would have served until the lock
    was let go. Each named user has a ring of its own (connect.u<uid>), which no other may open.
    (A server of its own: the frontend it kills is a death the others' tests would see in the log.)"""
    import pwd

    daemon = pwd.getpwnam("daemon")
    users_server = _start(server_factory, "--local-client-users=nobody,daemon")
    sid = users_server.id
    a = np.arange(16, dtype=np.int32)
    proc = start_as(NOBODY.pw_uid, NOBODY.pw_gid, CONNECT_LOCKER, {"server": sid, "other": daemon.pw_uid})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
        assert ready, "the locking client did not start"
        said = proc.stdout.readline().strip()
        assert said.startswith("HELD "), f"the locking client did not take the lock: {said}"
        assert json.loads(said[len("HELD "):]) == {"connect.0": "PermissionError",
                                                  f"connect.u{daemon.pw_uid}": "PermissionError"}
        got = run_as(daemon.pw_uid, daemon.pw_gid, CLIENT, {"server": sid})
        assert got["add"] == (2 * np.arange(16)).tolist()
        with Client(sid) as local:  # (the server's user)
            assert local.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
        [frontend] = [pid for pid, title in users_server.titles().items() if title.startswith("shmserve frontend ")]
        os.kill(frontend, signal.SIGKILL)
        wait_until(lambda: [pid for pid, title in users_server.titles().items()
                            if title.startswith("shmserve frontend ") and pid != frontend], "the frontend restarted")
        inputs = [httpclient.InferInput(n, [16], "INT32") for n in ("INPUT0", "INPUT1")]
        for t in inputs:
            t.set_data_from_numpy(a)

        def served() -> bool:
            try:
                with users_server.client() as http:
                    return http.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist() == (2 * a).tolist()
            except Exception:  # noqa: BLE001 - not serving yet
                return False

        wait_until(served, "the restarted frontend serves while the lock is held", DEADLINE_S)
        assert proc.poll() is None, "the lock was let go"
    finally:
        proc.kill()
        proc.communicate(timeout=DEADLINE_S)


# Truncates every object it may write (its own segment, broker.0, its connect ring, its lanes beside
# each worker's segment and the extents of its answers) to nothing, twice, a second apart. Its own segment is a loop-driven
# connection's, which nothing of its own touches again (its process would die of the cut: only
# what another user may write is guarded); it leaves without a word, as a killed client would.
TRUNCATE = r"""
import time
from shmserve.shm.connection import Connection
c = Client(args["server"])
a = np.arange(16, dtype=np.int32)
result = {"before": c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist()[:4]}
c.close()
conn = Connection(args["server"], loop_driven=True)
sid = args["server"]
targets = ["/dev/shm" + conn.name, f"/dev/shm/shmserve.{sid}.broker.0", f"/dev/shm/shmserve.{sid}.connect.u{os.geteuid()}"]
workers = sorted("/dev/shm/" + n for n in os.listdir("/dev/shm")
                 if n.startswith(f"shmserve.{sid}.worker.") and not n.endswith(".fifo"))
# Its user's lanes beside every worker segment, and the extents holding its own answers (a worker's
# segment and the server's user's extents are not its to open).
targets += [path for path in workers if os.access(path, os.W_OK)]
assert any(".lanes." in path for path in targets), targets
assert not [path for path in targets[3:] if len(os.path.basename(path).split(".")) == 4], targets
result["extents"] = [os.path.basename(path) for path in targets if ".arena." in path]
cut = set()
for _ in range(2):
    for path in targets:
        try:
            os.truncate(path, 0)  # (PermissionError would fail the test: the ACL lets it write all of these)
        except FileNotFoundError:
            if path != targets[0]:
                raise
            continue  # (its own segment: the broker disconnected it for the first cut, and removed it)
        cut.add(os.path.basename(path))
    time.sleep(1.5)
result["cut"] = sorted(cut)
print("RESULT " + json.dumps(result), flush=True)
os._exit(0)
"""


def test_a_named_user_truncating_what_it_may_write_kills_no_server_process(users_server):
    """A client of another user may write its own segment, broker.0, its connect ring, its lanes
    beside a worker's segment and the extents of its answers, and so may shrink them; a server process that then touched a lost page died of
    SIGBUS. The truncation guard (shm/truncation_guard.py) grows each file back, so a truncation
    only zeroes what the client could zero anyway: every process lives on, and serves."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    sid = users_server.id
    with users_server.client() as http:  # (a worker answered HTTP before, so it maps a frontend's segment)
        x = httpclient.InferInput("INPUT0", [16], "INT32")
        x.set_data_from_numpy(np.arange(16, dtype=np.int32))
        y = httpclient.InferInput("INPUT1", [16], "INT32")
        y.set_data_from_numpy(np.ones(16, dtype=np.int32))
        assert http.infer("add_sub", [x, y]).as_numpy("OUTPUT0").tolist() == list(range(1, 17))
        processes = users_server.titles()
        got = run_as_nobody(TRUNCATE, {"server": sid})
        assert got["before"] == [0, 2, 4, 6], got
        assert {name.split(".")[2] for name in got["cut"]} == {"broker", "connect", "worker", "client"}, got["cut"]
        # (the broker's mapping of a client's segment is not grown back: it disconnects the client)
        wait_until(lambda: "it truncated its segment" in users_server.log(), "the truncating client is disconnected")
        assert got["extents"], "it cut the extent its answer lay in too"

        def served() -> bool:
            try:
                return http.infer("add_sub", [x, y]).as_numpy("OUTPUT0").tolist() == list(range(1, 17))
            except Exception:
                return False

        wait_until(served, "HTTP is served after the truncations", DEADLINE_S)
        started = time.monotonic()
        for _ in range(20):
            assert http.infer("add_sub", [x, y]).as_numpy("OUTPUT0").tolist() == list(range(1, 17))
    with grpcclient.InferenceServerClient(users_server.grpc_url) as grpc:
        gx = grpcclient.InferInput("INPUT0", [16], "INT32")
        gx.set_data_from_numpy(np.arange(16, dtype=np.int32))
        gy = grpcclient.InferInput("INPUT1", [16], "INT32")
        gy.set_data_from_numpy(np.ones(16, dtype=np.int32))
        assert grpc.infer("add_sub", [gx, gy]).as_numpy("OUTPUT0").tolist() == list(range(1, 17))
    assert time.monotonic() - started < 10, "wake-ups work again: no request waited for a sleeper's timeout"
    again = run_as_nobody(TRUNCATE, {"server": sid})  # a new local client connects, and is served
    assert again["before"] == [0, 2, 4, 6], again
    assert users_server.titles() == processes, "no server process died or was restarted"
    broker = f"/dev/shm/shmserve.{sid}.broker.0"
    wait_until(lambda: os.stat(broker).st_size > 0, "broker.0 is grown back", DEADLINE_S)
    assert "grown back" in users_server.log(), "the broker said what it repaired"
    assert not [line for line in users_server.log().splitlines() if line.startswith("E")], users_server.log_tail()


class Peer:
    """A client of the server's user calling slow_reader (the model an attack's requests hold) in a
    loop on a thread while the ``with`` block runs: ``check`` says every call succeeded, none slower
    than ``bound_s``."""

    def __init__(self, server) -> None:
        import threading

        self.server = server
        self.slowest: list[float] = []
        self.errors: list[BaseException] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._calls, daemon=True)

    def _calls(self) -> None:
        x = np.arange(16, dtype=np.int32)
        with Client(self.server.id) as client:
            while not self.done.is_set():
                started = time.monotonic()
                try:
                    got = client.infer("slow_reader", {"X": x}, parameters={"sleep_s": 0.01})
                    assert got["SUM"].tolist() == [int(x.sum())]
                except BaseException as e:  # noqa: BLE001 - reported by check
                    self.errors.append(e)
                    return
                self.slowest.append(time.monotonic() - started)

    def __enter__(self) -> "Peer":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join(300)

    def check(self, bound_s: float) -> None:
        assert not self.errors, f"the other client's request failed: {self.errors[0]!r}"
        assert self.slowest and max(self.slowest) < bound_s, \
            f"the other client waited {max(self.slowest):.1f} s behind the attack"


# Sends slow_reader a 64 MiB input from its own arena, then leaves a child that truncates the
# segment and extends it again, as fast as it can for args["seconds"], while the model sleeps and
# then reads it (the broker disconnects the client meanwhile: the model runs on) (nobody cannot start the interpreter: a fork; the parent leaves at once, since
# its own threads would touch the segment too).
TRUNCATE_OWN = r"""
import time
c = Client(args["server"], arena_bytes=160 << 20)
x = np.ones(16 << 20, dtype=np.int32)
pending = c.infer_async("slow_reader", {"X": x}, parameters={"sleep_s": 1.0})
time.sleep(0.3)  # (the model sleeps now: a request cancelled before it ran would read nothing)
fd = os.open("/dev/shm" + c._conn.name, os.O_RDWR)
size = os.fstat(fd).st_size
print("RESULT " + json.dumps(size), flush=True)
if os.fork() == 0:
    end = time.monotonic() + args["seconds"]
    while time.monotonic() < end:
        os.ftruncate(fd, 0)
        os.ftruncate(fd, size)
    os._exit(0)
os._exit(0)
"""


def test_a_named_user_truncating_its_segment_in_a_loop_holds_no_worker(users_server):
    """A client of a named user truncates its own segment and extends it again as fast as it can
    while a worker reads its 64 MiB input: the worker's mapping of it used to be grown back page
    by page, each page a fault that waited on the next truncation, and the worker (and every
    other client of that model) waited as long as the truncations went on. The worker's mapping is zeroed at the
    first fault now (and mapped anew by the next request that needs it)."""
    before = users_server.titles()
    with Peer(users_server) as peer:
        assert run_as_nobody(TRUNCATE_OWN, {"server": users_server.id, "seconds": 8.0}, timeout=300) > 0
    peer.check(4.0)
    assert users_server.titles() == before, "no server process died or was restarted"


# Has slow_reader answer it 3 MiB a few times (in its user's home extent, whose pages are then
# taken), then again and again while a child truncates every extent of the workers it may open and
# extends it again, as fast as it can for args["seconds"] (nobody cannot start the interpreter:
# a fork); what became of each of those requests.
TRUNCATE_EXTENTS = r"""
import time
sid = args["server"]
c = Client(sid)
x = np.ones(3 << 18, dtype=np.int32)  # 3 MiB: answered in the user's home extent (4 MiB), whose pages are taken
for _ in range(3):
    c.infer("slow_reader", {"X": x}, parameters={"sleep_s": 0.0}).release()
time.sleep(0.2)
if os.fork() == 0:
    end = time.monotonic() + args["seconds"]
    fds = {}
    while time.monotonic() < end:
        for name in os.listdir("/dev/shm"):
            if name.startswith(f"shmserve.{sid}.worker.") and ".arena." in name and name not in fds:
                try:
                    fds[name] = os.open("/dev/shm/" + name, os.O_RDWR)
                except OSError:
                    fds[name] = -1  # (another user's)
        for fd in fds.values():
            if fd >= 0:
                size = os.fstat(fd).st_size or (1 << 20)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, size)
    os._exit(0)
result = []
end = time.monotonic() + args["seconds"]
while time.monotonic() < end:
    try:
        c.infer("slow_reader", {"X": x}, parameters={"sleep_s": 0.0}).release()
        result.append("answered")
    except Exception as e:
        result.append(type(e).__name__)
"""


def test_a_named_user_truncating_its_extents_in_a_loop_delays_others_only_briefly(users_server):
    """A client of a named user may write the extents its answers lie in (it frees them there), so
    it may truncate them too, in a tight loop while a worker writes its answers there. The worker
    grows the extent back at each fault of an answer's copy (its pages are not taken again before
    each answer: shm/arena.py takes them once, as its head first reaches them), which holds it
    for a while, but no server process dies and another client's requests are delayed by less
    than the bound below (docs/serving.md)."""
    before = users_server.titles()
    with Peer(users_server) as peer:
        got = run_as_nobody(TRUNCATE_EXTENTS, {"server": users_server.id, "seconds": 8.0}, timeout=300)
    peer.check(4.0)
    assert got, "the truncating client sent nothing"
    assert users_server.titles() == before, "no server process died or was restarted"
    assert run_as_nobody(CLIENT, {"server": users_server.id})["add"] == (2 * np.arange(16)).tolist()



# Tries to open every worker's segment, where the frontends' lanes lie; then, on its own client's
# lane in its user's lanes object (which every process of its user may write), puts again each
# record left there (a replay) and the same block for another slot.
FORGE = r"""
import time
from shmserve.shm.channel import WorkerSegment
from shmserve.shm.protocol import RECORD, REQ_INFER
sid = args["server"]
result = {"opened": [], "refused": 0, "replayed": 0, "moved": 0}
def lanes_mapped():  # (an earlier test truncated them: their worker writes their headers again)
    try:
        for entry in os.listdir("/dev/shm"):
            if entry.startswith(f"shmserve.{sid}.worker.") and entry.count(".") == 3:
                WorkerSegment.attach("/" + entry, control_writable=False).close()
        return True
    except ConnectionError:
        return False
deadline = time.monotonic() + 30
while not lanes_mapped() and time.monotonic() < deadline:
    time.sleep(0.2)
c = Client(sid)
a = np.arange(16, dtype=np.int32)
for _ in range(8):
    assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
lane, cookie = c._conn.lane, c._conn._cookie
for entry in sorted(os.listdir("/dev/shm")):
    parts = entry.split(".")
    if not entry.startswith(f"shmserve.{sid}.worker.") or len(parts) != 4 or not parts[3].isdigit():
        continue
    try:
        os.close(os.open("/dev/shm/" + entry, os.O_RDWR))
        result["opened"].append(entry)
    except PermissionError:
        result["refused"] += 1
    worker = WorkerSegment.attach("/" + entry, control_writable=False)
    assert [i for i, ring in enumerate(worker.lanes) if ring is not None] == list(range(128, 256)), "its user's"
    ring = worker.lanes[lane]
    left = [RECORD.unpack_from(ring._buf, ring._data + i * RECORD.size) for i in range(ring._cap)]
    left = [r for r in left if r[4] == cookie and r[0] & 0xFF == REQ_INFER and r[3] > 0]
    for kind, slot, off, total, _ in left[:8]:
        result["replayed"] += ring.put(kind, slot, off, total, cookie)
        result["moved"] += ring.put(kind, (slot + 1) % 64, off, total, cookie)
    worker.ring_bell(lane)
    worker.waker.notify()
    worker.close()
time.sleep(1.0)  # (the worker takes them meanwhile)
assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
c.close()
"""


def test_a_named_user_can_make_a_worker_run_no_request_of_another_client(users_server):
    """A worker's lanes lay in its segment, which every local client could write, a named user's
    too: records it wrote on a frontend's lane with the frontend's cookie were run as the
    frontend's (one network client got another's answer), and garbage there had the frontend
    disconnected. The server's user's lanes now lie in the worker's segment, which no other user
    may open, and each named user's in an object of its own. Within a user, whose processes may
    write each other's lanes, a worker still runs a lane record only if its client's own slot
    binds it to that block, pending and not taken yet: replayed and moved records run nothing."""
    import tritonclient.http as httpclient

    def add(http, value: int) -> list[int]:
        x = httpclient.InferInput("INPUT0", [16], "INT32")
        x.set_data_from_numpy(np.full(16, value, dtype=np.int32))
        y = httpclient.InferInput("INPUT1", [16], "INT32")
        y.set_data_from_numpy(np.arange(16, dtype=np.int32))
        return http.infer("add_sub", [x, y]).as_numpy("OUTPUT0").tolist()

    def executed(http) -> int:
        return http.get_inference_statistics("add_sub")["model_stats"][0]["inference_stats"]["success"]["count"]

    with users_server.client() as http:
        for value in range(8):
            assert add(http, value) == [value + i for i in range(16)]
        processes = users_server.titles()
        before = executed(http)
        logged = len(users_server.log())
        got = run_as_nobody(FORGE, {"server": users_server.id})
        assert got["opened"] == [] and got["refused"] >= 1, got
        assert got["replayed"] >= 1 and got["moved"] >= 1, got
        assert "name no request of its client" in users_server.log()[logged:]
        assert executed(http) == before + 9, "its own 9 requests ran, and no record put again"
        for value in range(20, 30):
            assert add(http, value) == [value + i for i in range(16)]
        assert executed(http) == before + 19
    assert users_server.titles() == processes, "no server process died or was restarted"
    said = users_server.log()[logged:]
    assert "wrote garbage" not in said and "disconnect" not in said, said


def test_a_request_whose_lane_record_was_removed_is_put_again(users_server, tmp_path):
    """A request waits on its worker's lane while the worker runs another; a process of its
    client's user empties the lane (every process of that user may write it; no other user may),
    and the request was lost: the worker never saw it and its caller waited for good. Its client
    puts the record again once two of its checks found it untaken with the lane empty, and the
    request is answered, once."""
    import tritonclient.http as httpclient

    from shmserve.shm.channel import BrokerSegment, WorkerSegment

    gate = Gate(tmp_path / "gate")

    def reader(values: np.ndarray) -> httpclient.InferInput:
        x = httpclient.InferInput("X", [len(values)], "INT32")
        x.set_data_from_numpy(values)
        return x

    def empty_frontends_lanes() -> int:
        """Records skipped on the lanes the frontends hold, in every worker's segment."""
        broker = BrokerSegment.attach(users_server.id)
        theirs = [lane for lane in range(256) if broker.lane_client(lane)[0]]
        broker.close()
        skipped = 0
        prefix = f"shmserve.{users_server.id}.worker."
        for entry in os.listdir("/dev/shm"):
            if entry.startswith(prefix) and entry[len(prefix):].isdigit():
                worker = WorkerSegment.attach("/" + entry, control=False)
                for lane in theirs:
                    ring = worker.lanes[lane]
                    if ring is not None:
                        skipped += ring.pending()
                        ring._ctr[0] = ring._ctr[1]  # noqa: SLF001 - the consumer's counter set to the producer's
                worker.close()
        return skipped

    with users_server.client(concurrency=2) as http:
        stats = lambda: http.get_inference_statistics("slow_reader")["model_stats"][0]["inference_stats"]  # noqa: E731
        before = stats()["success"]["count"]
        held = http.async_infer("slow_reader", [reader(np.arange(4, dtype=np.int32))],
                                parameters={"sleep_s": 0, "gate": gate.param})
        gate.wait_started(1)
        waiting = http.async_infer("slow_reader", [reader(np.full(8, 3, dtype=np.int32))], parameters={"sleep_s": 0})
        skipped = 0
        deadline = time.monotonic() + DEADLINE_S
        while not skipped and time.monotonic() < deadline:  # (once the request is on the lane)
            skipped = empty_frontends_lanes()
            time.sleep(0.01)
        assert skipped == 1, skipped
        logged = len(users_server.log())
        gate.open()
        assert held.get_result(timeout=DEADLINE_S).as_numpy("SUM").tolist() == [6]
        assert waiting.get_result(timeout=DEADLINE_S).as_numpy("SUM").tolist() == [24]
        assert "put again the lane records" in users_server.log()[logged:]
        time.sleep(0.5)
        assert stats()["success"]["count"] == before + 2, "each ran once"


# Control requests as only a frontend may send them: a region registered for a network caller it
# names (the server's user, an admin), and a model loaded from 'file:' contents.
CLAIMS = r"""
import base64
from shmserve.shm.client import InferenceServerError
from shmserve.shm.control_messages import LoadModel, NetworkCaller, RegisterSystemRegion
c = Client(args["server"])
result = {}
def attempt(what, message):
    try:
        c._control(message)
        result[what] = "done"
    except InferenceServerError as e:
        result[what] = [e.status, e.message]
attempt("plain", RegisterSystemRegion("users_plain", args["key"], 64))
attempt("claimed", RegisterSystemRegion("users_claimed", args["key"], 64, caller=NetworkCaller(0, True)))
attempt("unowned", RegisterSystemRegion("users_unowned", args["key"], 64, caller=NetworkCaller(None, False)))
model = "open(%r, 'w').write('ran')\nclass TritonPythonModel:\n    def execute(self, requests):\n        return []\n" % args["marker"]
config = json.dumps({"name": "users_upload", "backend": "python", "max_batch_size": 0,
                     "input": [{"name": "X", "data_type": "TYPE_INT32", "dims": [1]}],
                     "output": [{"name": "Y", "data_type": "TYPE_INT32", "dims": [1]}]})
attempt("upload", LoadModel("users_upload", {"config": config,
                                             "file:1/model.py": base64.b64encode(model.encode()).decode()},
                            from_network="key"))
c.close()
"""


def test_a_named_user_can_claim_no_frontends_rights(users_server, tmp_path):
    """A local client of another user writes its control requests itself: the broker does not take
    from it what only a frontend may say (a network caller with the server's rights or an admin's,
    a key that allows uploads). Its regions are its own user's, and model code it sends never runs."""
    import posix_ipc

    key = f"/users_secret_{os.getpid()}"
    secret = posix_ipc.SharedMemory(key, posix_ipc.O_CREX, mode=0o600, size=4096)  # the server's user's alone
    secret.close_fd()
    marker = tmp_path / "ran"
    tmp_path.chmod(0o777)
    try:
        got = run_as_nobody(CLAIMS, {"server": users_server.id, "key": key, "marker": str(marker)})
    finally:
        secret.unlink()
    for what in ("plain", "claimed", "unowned"):
        assert got[what][0] == 403 and f"uid {NOBODY.pw_uid} may not read and write it" in got[what][1], got
    assert got["upload"][0] == 403 and "--allow-model-file-uploads" in got["upload"][1], got
    assert not marker.exists()
    with users_server.client() as http:
        assert http.get_system_shared_memory_status() == []
        assert "users_upload" not in [m["name"] for m in http.get_model_repository_index()]


def test_the_flag_refuses_an_unknown_user_name(tmp_path):
    import subprocess

    from conftest import PYTHON, ROOT

    done = subprocess.run([PYTHON, "-m", "shmserve", "--model-repository", str(PRODUCT_MODELS),
                           "--local-client-users=nobody,no-such-user-here"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2 and "--local-client-users: unknown user 'no-such-user-here'" in done.stderr, \
        done.stderr


OURS = """
from shmserve.shm.names import ours
result = ours(args["shms"], args["sems"])
"""


def test_a_server_of_another_user_removes_only_its_own_objects(tmp_path):
    """A server not run as root may not remove what a local client of another user made in a
    sticky /dev/shm (its segment, semaphore and FIFO): after a broker crash and at its stop it
    leaves them to that client, which removes its own as it closes; before, the launcher's
    unlink raised and the launcher died with its frontends. ``ours`` is what both unlink."""
    server_id = f"own{os.getpid()}"
    names = {uid: f"/shmserve.{server_id}.client.{uid}-0" for uid in (0, NOBODY.pw_uid)}
    try:
        for uid, name in names.items():
            for path in ("/dev/shm" + name, f"/dev/shm/sem.{name[1:]}"):
                with open(path, "wb"):
                    pass
                os.chown(path, uid, -1)
        mine = names[NOBODY.pw_uid]
        result = run_as_nobody(OURS, {"shms": sorted(names.values()), "sems": sorted(names.values())})
        assert result == [[mine], [mine]]
    finally:
        for name in names.values():
            for path in ("/dev/shm" + name, f"/dev/shm/sem.{name[1:]}"):
                if os.path.exists(path):
                    os.unlink(path)


# A named user's way to pass for the server's user: its client segment's owner says who the client
# is, and the kernel lets a user hard-link a file it may write (protected_hardlinks), such as an
# extent of a worker's arena that holds its answers (the server's user's, with nobody's ACL entry).
LINKED = r"""
import mmap
import shmserve.shm.channel as channel
import shmserve.shm.segment as segment
from shmserve.shm.client import InferenceServerError, ServerUnavailable
from shmserve.shm.control_messages import RegisterSystemRegion
c = Client(args["server"])
c.infer("identity", {"IN": np.ones(4, np.float32)})  # its home extent is made
prefix = "shmserve.%s.worker." % args["server"]
src = next("/dev/shm/" + f for f in sorted(os.listdir("/dev/shm")) if f.startswith(prefix) and ".arena." in f
           and os.stat("/dev/shm/" + f).st_uid == 0 and os.access("/dev/shm/" + f, os.R_OK | os.W_OK))
size = os.stat(src).st_size
result = {}
# 1. A new client whose segment is a link of the extent, laid out as a segment.
class Linked(segment.Segment):
    def unlink(self):
        pass  # (nobody may not remove a file of root's: the test does)
made = segment.Segment.create
def linked(name, nbytes, readers=(), readers_write=True, taken=None):
    if ".client." not in name:
        return made(name, nbytes, readers, readers_write, taken)
    os.link(src, "/dev/shm" + name)
    fd = os.open("/dev/shm" + name, os.O_RDWR)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    mm[:] = bytes(nbytes)
    return Linked(name, nbytes, mm, owner=True)
segment.Segment.create = linked
try:
    Client(args["server"], arena_bytes=(size - channel.ClientSegment.nbytes(1024, 0)) & ~4095)
    result["linked"] = "connected"
except ServerUnavailable as e:
    result["linked"] = str(e)
segment.Segment.create = made
# 2. A connected client's segment put aside for a link of the extent, then a region of the
# server's user's registered: as whom?
name = "/dev/shm" + c._conn.name
os.rename(name, name + ".aside")
os.link(src, name)
try:
    c._control(RegisterSystemRegion("users_linked", args["key"], 64))
    result["swapped"] = "registered"
except InferenceServerError as e:
    result["swapped"] = [e.status, e.message]
os.unlink(name + ".aside")  # (the link stays: nobody may not remove a file of root's)
"""


def test_a_named_user_cannot_pass_for_the_servers_user_through_a_link(server_factory):
    """A client segment that another user could have written (a second name of a file, an ACL
    entry for someone else) says nothing of who made it: the broker refuses to attach it, by
    name, and a client's user is what the broker saw when it attached its segment, not whatever
    now lies at its segment's name. Before, nobody became the server's user both ways: it
    registered an object only root may open, and could then read and write it through a model.
    A server of its own: the link's content was the user's answers (in its home extent), which
    it then zeroes."""
    import posix_ipc

    users_server = _start(server_factory, "--local-client-users=nobody")

    key = f"/users_linked_secret_{os.getpid()}"
    secret = posix_ipc.SharedMemory(key, posix_ipc.O_CREX, mode=0o600, size=4096)
    secret.close_fd()
    try:
        got = run_as_nobody(LINKED, {"server": users_server.id, "key": key})
    finally:
        secret.unlink()
    assert "did not accept the connection" in got["linked"], got
    wait_until(lambda: "names (a hard link)" in users_server.log(), "the broker names the linked segment")
    assert got["swapped"][0] == 403 and f"uid {NOBODY.pw_uid} may not read and write it" in got["swapped"][1], got
    with users_server.client() as http:
        assert http.get_system_shared_memory_status() == []
    for name in shm_names(f"shmserve.{users_server.id}.client."):  # the links nobody may not remove
        os.unlink(f"/dev/shm/{name}")
    with Client(users_server.id) as client:
        a = np.arange(16, dtype=np.int32)
        assert client.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()


# A client of one named user sending requests on its lane for a while; and one of another named
# user that scribbles on the lanes of the first in every worker it can reach.
LANE_VICTIM = r"""
import time
c = Client(args["server"])
a = np.arange(16, dtype=np.int32)
print("LANE %d" % c._conn.lane, flush=True)
ok, failed = 0, []
end = time.monotonic() + args["seconds"]
while time.monotonic() < end:
    try:
        assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
        ok += 1
    except Exception as e:
        failed.append(repr(e))
    time.sleep(0.01)
result = {"ok": ok, "failed": failed[:3]}
c.close()
"""

LANE_SCRIBBLER = r"""
from shmserve.shm.descriptor import InferRequest
c = Client(args["server"])
conn = c._conn
num, worker = conn._router.pick(InferRequest("add_sub"))
result = {"mapped": worker.lanes[args["lane"]] is not None}
try:
    os.close(os.open("/dev/shm" + worker.name + ".lanes.u%d" % args["victim"], os.O_RDWR))
    result["open"] = "opened"
except PermissionError:
    result["open"] = "PermissionError"
c.close()
"""


def test_a_named_user_cannot_have_another_named_users_client_disconnected(server_factory):
    """With two users named, either could write the lanes of the other's clients (they lay in each
    worker's segment): garbage written there had the lane's holder disconnected. Each user's lanes
    now lie in an object only that user (and the server's) may open: the other cannot map or open
    them, and the holder's requests all succeed."""
    import pwd

    daemon = pwd.getpwnam("daemon")
    server = _start(server_factory, "--local-client-users=nobody,daemon")
    victim = start_as(daemon.pw_uid, daemon.pw_gid, LANE_VICTIM, {"server": server.id, "seconds": 6})
    try:
        lane = int(victim.stdout.readline().split()[1])
        tried = run_as_nobody(LANE_SCRIBBLER, {"server": server.id, "lane": lane, "victim": daemon.pw_uid})
        out, err = victim.communicate(timeout=DEADLINE_S)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert victim.returncode == 0, err
    got = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert got["failed"] == [] and got["ok"] > 0, got
    assert tried == {"mapped": False, "open": "PermissionError"}, tried
    assert "disconnect" not in server.log(), server.log()


# Clients of a named user up to and past its bounds, through raw connects (a segment and a
# connect record each, as the library makes them), and then one through the library.
BOUNDED = r"""
import time
from shmserve.shm.access import others
from shmserve.shm.channel import LANE_PENDING, BrokerSegment, ClientSegment
from shmserve.shm.client import ServerUnavailable
from shmserve.shm.liveness import process_ticket
from shmserve.shm.names import object_name
sid = args["server"]
broker = BrokerSegment.attach(sid)
readers = others((broker.seg.uid,))
tickets, ticket = process_ticket(sid)
def connect(k, arena):
    name = object_name(sid, "client", "%d-%d" % (ticket, k))
    seg = ClientSegment.create(name, arena, ticket, 4, readers=readers)
    broker.announce(ticket, name, timeout=30)
    deadline = time.monotonic() + 30
    while seg.lane == LANE_PENDING and time.monotonic() < deadline:
        time.sleep(0.0005)
    return seg
result = {}
huge = connect(0, 2 << 40)  # 2 TiB, sparse: no page of it taken
result["huge_refused"] = huge.disconnected()
huge.close()
huge.unlink()
held = [connect(k, 4096) for k in range(1, args["count"] + 1)]
result["held_refused"] = sum(seg.disconnected() for seg in held)
result["with_lane"] = sum(seg.lane < 256 for seg in held)
try:
    Client(sid)
    result["one_more"] = "connected"
except ServerUnavailable as e:
    result["one_more"] = str(e)
"""


def test_a_named_users_clients_are_bounded_in_number_and_size(users_server):
    """A user named by --local-client-users may connect as many clients as it likes, each with a
    segment as large as it likes (sparse, it costs no page): each costs the broker descriptors
    and address space, which one user could take from everyone. Its clients are bounded (1,024
    connections, 1 TiB of segments): one past either is refused at once with a clear error and
    the broker's log names the bound, while clients of the server's user are served; once the
    user's clients are gone, it connects again. They hold at most half the lanes (one user
    named), so a client of the server's user still has one: before, they took every lane."""
    from shmserve.server.broker.clients import MAX_CLIENTS_PER_USER
    from shmserve.shm.channel import LANES

    got = run_as_nobody(BOUNDED, {"server": users_server.id, "count": MAX_CLIENTS_PER_USER}, timeout=300)
    assert got["huge_refused"] is True and got["held_refused"] == 0, got
    assert got["with_lane"] == LANES // 2, got
    assert got["one_more"] == f"the shmserve server '{users_server.id}' refused the connection (its log says why)"
    assert f"a user may hold at most {MAX_CLIENTS_PER_USER} and 1024 GiB" in users_server.log()
    with Client(users_server.id) as client:
        a = np.arange(16, dtype=np.int32)
        assert client.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
        assert client._conn.lane is not None  # noqa: SLF001
    wait_until(lambda: not _owned_by_nobody(shm_names(f"shmserve.{users_server.id}.client.")),
               "nobody's segments are removed")
    got = run_as_nobody(CLIENT, {"server": users_server.id})
    assert got["add"] == (2 * np.arange(16)).tolist()


def _owned_by_nobody(names: list[str]) -> list[str]:
    owned = []
    for name in names:
        try:
            if os.stat(f"/dev/shm/{name}").st_uid == NOBODY.pw_uid:
                owned.append(name)
        except FileNotFoundError:  # (removed meanwhile)
            pass
    return owned


# Keeps 3 MiB answers of `identity` until one is refused, asks for one larger than its user's
# share, says what it got, then (told to go on) lets them go and asks again.
HOARD = r"""
c = Client(args["server"])
x = np.full(3 << 18, 1.5, dtype=np.float32)  # a 3 MiB answer
kept, refused = [], None
for _ in range(40):
    try:
        kept.append(c.infer("identity", {"IN": x})["OUT"])
    except InferenceServerError as e:
        refused = [e.status, e.message]
        break
try:
    c.infer("identity", {"IN": np.ones(5 << 20, dtype=np.float32)})  # 20 MiB
    too_large = None
except InferenceServerError as e:
    too_large = [e.status, e.message]
print("HELD " + json.dumps({"kept": len(kept), "refused": refused, "too_large": too_large}), flush=True)
sys.stdin.readline()
kept.clear()
result = float(c.infer("identity", {"IN": x})["OUT"].sum())
c.close()
"""


def test_answers_a_named_user_keeps_leave_room_for_everyone_elses(server_factory):
    """A client keeps the memory of the answers it holds (its result arrays lie in the worker's
    arena), and the arena grows around them up to --worker-arena-mb. A named user's clients
    keeping answers could take the whole cap, after which every answer of anyone else that did not
    fit their first extent was a 503. A named user's answers now take at most an equal share of
    the cap (half, with one user named): past it that user alone is refused, an answer larger
    than the share could ever hold is a 500 naming it, and the server's user's clients still get
    answers larger than their first extent. Once the answers are let go, the user is served
    again."""
    server = _start(server_factory, "--local-client-users=nobody", "--worker-arena-mb=32")
    big = np.full(2 << 20, 2.5, dtype=np.float32)  # 8 MiB: larger than any first extent (4 MiB)
    with Client(server.id) as client:
        assert client.infer("identity", {"IN": big})["OUT"].size == big.size
    proc = start_as(NOBODY.pw_uid, NOBODY.pw_gid, HOARD, {"server": server.id})
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.startswith("HELD "), (line, proc.stderr.read() if proc.poll() is not None else "")
        held = json.loads(line[len("HELD "):])
        # Its share is 16 MiB: its first extent (4 MiB) and two grown (8 and 4) hold 4 answers.
        assert held["kept"] == 4, held
        assert held["refused"][0] == 503 and "retry" in held["refused"][1], held
        assert held["too_large"][0] == 500, held
        assert "one user's share of the instance's output arena" in held["too_large"][1], held
        assert "--worker-arena-mb=32 shared by 2 users" in held["too_large"][1], held
        with Client(server.id) as client:
            for _ in range(3):
                assert float(client.infer("identity", {"IN": big})["OUT"].sum()) == float(big.sum())
        with server.client() as http:
            inp = httpclient.InferInput("IN", [big.size], "FP32")
            inp.set_data_from_numpy(big, binary_data=True)
            out = http.infer("identity", [inp], outputs=[httpclient.InferRequestedOutput("OUT", binary_data=True)])
            assert out.as_numpy("OUT").size == big.size
        assert result_after(proc) == 1.5 * (3 << 18)
    finally:
        stop(proc)


# Sets both counters of the first lane of its lanes object beside every worker 1,000 past its
# tail, once: a ring that looks empty, with a thousand more records put than the worker took.
JUMP_COUNTERS = r"""
import mmap, struct
from shmserve.shm.channel import HEADER_BYTES
n = 0
for entry in sorted(os.listdir("/dev/shm")):
    if entry.startswith(f"shmserve.{args['server']}.worker.") and entry.endswith(f".lanes.u{os.getuid()}"):
        fd = os.open("/dev/shm/" + entry, os.O_RDWR)
        m = mmap.mmap(fd, 2 * HEADER_BYTES)
        os.close(fd)
        _, tail = struct.unpack_from("<QQ", m, HEADER_BYTES)
        struct.pack_into("<QQ", m, HEADER_BYTES, tail + 1000, tail + 1000)
        m.close()
        n += 1
result = n
"""


def test_a_named_users_lane_counters_hold_no_unload(server_factory):
    """What is left on a worker's lanes was counted from the lanes' counters, which a named user
    writes on its own lanes: one that moved them past what it put kept every unload, retirement
    and stop of that worker waiting for --exit-timeout-secs. The broker counts from the worker's
    own counts now (records taken, records finished), and what waits on other users' lanes is
    answered by the worker before it stops."""
    server = server_factory.start([PRODUCT_MODELS, SHM_MODELS],
                                  ["--model-control-mode", "explicit", "--load-model", "add_sub",
                                   "--local-client-users=nobody", "--exit-timeout-secs", "20"])
    assert run_as_nobody(JUMP_COUNTERS, {"server": server.id}) >= 1
    with server.client() as http:
        started = time.monotonic()
        http.unload_model("add_sub")
        wait_until(lambda: not server.worker_pids("add_sub"), "the worker stopped", DEADLINE_S)
        assert time.monotonic() - started < 5, "the unload waited for counters a client wrote"


# Writes 2 (no client's value: it sets 1) into a bell of its lanes object beside every worker.
ODD_BELL = r"""
import mmap
from shmserve.shm.channel import LANE_BELLS_OFFSET
n = 0
for entry in sorted(os.listdir("/dev/shm")):
    if entry.startswith(f"shmserve.{args['server']}.worker.") and entry.endswith(f".lanes.u{os.getuid()}"):
        fd = os.open("/dev/shm/" + entry, os.O_RDWR)
        m = mmap.mmap(fd, 4096)
        os.close(fd)
        m[LANE_BELLS_OFFSET + 3] = 2
        m.close()
        n += 1
result = n
"""


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_bell_a_named_user_set_to_another_value_keeps_no_worker_awake(users_server):
    """A worker finds work by its lanes' bells: any byte not 0 said work, but only bells of 1
    were cleared, so a named user that wrote 2 in one of its own kept the worker from ever
    sleeping (a core spun for good). Every bell found set is cleared now."""
    workers = users_server.worker_pids("add_sub")
    assert workers and run_as_nobody(ODD_BELL, {"server": users_server.id}) >= 1
    time.sleep(0.5)  # (the worker wakes for it, clears it and sleeps again)
    before = {pid: _cpu_seconds(pid) for pid in workers}
    time.sleep(2.0)
    spent = {pid: _cpu_seconds(pid) - before[pid] for pid in workers}
    assert max(spent.values()) < 0.2, spent  # (idle: a wake-up each 50 ms; spinning: 0.4 s and more)
    a = np.arange(16, dtype=np.int32)
    assert run_as_nobody(CLIENT, {"server": users_server.id})["add"] == (2 * a).tolist()


# Truncates each lanes object of its own beside a worker as soon as it appears (after
# args["delay"] seconds), again every millisecond for args["loop"] seconds.
TRUNCATE_NEW_LANES = r"""
import time
seen, cut = set(), 0
print("watching", flush=True)
end = time.monotonic() + args["seconds"]
while time.monotonic() < end:
    for entry in os.listdir("/dev/shm"):
        if entry in seen or not (entry.startswith(f"shmserve.{args['server']}.worker.")
                                 and entry.endswith(f".lanes.u{os.getuid()}")):
            continue
        seen.add(entry)
        time.sleep(args["delay"])
        try:
            fd = os.open("/dev/shm/" + entry, os.O_RDWR)
        except OSError:
            seen.discard(entry)  # (not openable yet: its ACL entry comes once its pages are taken)
            continue
        until = time.monotonic() + args["loop"]
        os.ftruncate(fd, 0)
        cut += 1
        while time.monotonic() < until:
            os.ftruncate(fd, 0)
            time.sleep(0.001)
        os.close(fd)
    time.sleep(0.0005)
result = cut
"""


@pytest.mark.parametrize("delay,loop", [(0.0, 0.0), (0.05, 4.0)])
def test_a_named_user_truncating_its_new_lanes_objects_stops_no_load(server_factory, delay, loop):
    """A named user may truncate its lanes object beside a worker: done while the broker took its
    pages, the load failed as if /dev/shm were full; done until the worker mapped it, the worker
    died mapping it and the load failed. Its pages are taken before its user may open it, and
    the worker maps it at the size the broker made, grown back, so the load succeeds."""
    server = server_factory.start([PRODUCT_MODELS, SHM_MODELS],
                                  ["--model-control-mode", "explicit", "--local-client-users=nobody"])
    proc = start_as(NOBODY.pw_uid, NOBODY.pw_gid, TRUNCATE_NEW_LANES,
                    {"server": server.id, "seconds": 8, "delay": delay, "loop": loop})
    try:
        assert proc.stdout.readline().startswith("watching"), proc.stderr.read()
        with server.client() as http:
            http.load_model("add_sub")
            assert http.is_model_ready("add_sub")
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1][len("RESULT "):]) >= 1, "it truncated the object"
    # Its own clients lost their lanes on that worker (its header is gone): they go through the broker.
    got = run_as_nobody(ADD, {"server": server.id})
    assert got == (2 * np.arange(16)).tolist()


ADD = r"""
with Client(args["server"]) as c:
    a = np.arange(16, dtype=np.int32)
    result = c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist()
"""


EDGE_REPORT = r"""
from shmserve.shm.control_messages import EdgeReport
c = Client(args["server"])
try:
    c._control(EdgeReport("http", 1000, {"head": 7}))
    result = "taken"
except InferenceServerError as e:
    result = [e.status, e.message]
c.close()
"""


def test_the_edge_metrics_are_the_server_users_word_only(users_server):
    """The frontends report their edges (open connections, refusals) to the broker for the metrics
    page. A client of another user that sends such a report is refused, and a report of the
    server's own user that is malformed is refused by name: neither reaches the page."""
    said = run_as_nobody(EDGE_REPORT, {"server": users_server.id})
    assert said == [403, "edge reports come from the server's own frontends only"]
    from shmserve.shm.client import InferenceServerError
    from shmserve.shm.control_messages import EdgeReport

    with Client(users_server.id) as own, pytest.raises(InferenceServerError) as refused:
        own._control(EdgeReport("http", 0, {'bad"} 1\nfake_metric': 1}))
    assert refused.value.status == 400 and "a reason must be" in refused.value.message
    assert edge_refusals(users_server) == {} and http_connections(users_server) < 1000


# Holds a lock on every byte of broker.0's file that no live process holds (the tickets, shm/liveness.py),
# found with F_OFD_GETLK, until it is told to stop.
TICKET_LOCKER = r"""
import fcntl, select, struct
F = struct.Struct("@hhqqi4x")
fd = os.open(f"/dev/shm/shmserve.{args['server']}.broker.0", os.O_RDWR)


def first_held(start, end):
    # the lowest lock another holds in [start, end): (at, length), or None (F_OFD_GETLK reports
    # one conflicting lock, not the lowest)
    found = None
    while end > start:
        kind, _, at, length, _ = F.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, F.pack(fcntl.F_WRLCK, 0, start, end - start, 0)))
        if kind == fcntl.F_UNLCK:
            return found
        found, end = (at, length), at
    return found


def lock_gaps():
    start, end_all = 1, 1 << 31
    while start < end_all:
        held = first_held(start, end_all)
        free_to = end_all if held is None else held[0]
        if free_to > start:
            try:
                fcntl.fcntl(fd, fcntl.F_OFD_SETLK, F.pack(fcntl.F_WRLCK, 0, start, free_to - start, 0))
            except (BlockingIOError, PermissionError):  # a client took a byte there meanwhile: look again
                continue
        start = end_all if held is None else held[0] + held[1]


lock_gaps()
print("LOCKED", flush=True)
while not select.select([sys.stdin], [], [], 0.05)[0]:
    lock_gaps()  # (and the bytes of clients that died since)
"""

CONNECT_ONCE = r"""
import sys
from shmserve.shm.client import Client, ServerUnavailable
try:
    Client(sys.argv[1]).close()
    print("connected")
except ServerUnavailable as e:
    print("refused: " + str(e))
"""


def test_a_named_user_locking_every_free_ticket_gets_no_client_stuck(users_server):
    """A named user may open broker.0 for writing (its clients take their tickets there), so it may
    also lock every byte no live client holds: a client that connected next tried random tickets
    for ever, spinning, whoever its user (the server's own too). It tries a bounded number and is
    refused with an error saying why; once the locks go, clients connect again."""
    import subprocess
    import sys

    proc = start_as(NOBODY.pw_uid, NOBODY.pw_gid, TICKET_LOCKER, {"server": users_server.id})
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("LOCKED"), proc.stderr.read()
        got = subprocess.run([sys.executable, "-c", CONNECT_ONCE, users_server.id], capture_output=True, text=True,
                             timeout=DEADLINE_S)  # (it spun for ever)
        assert "refused: " in got.stdout and "no liveness ticket could be taken" in got.stdout, (got.stdout, got.stderr)
    finally:
        stop(proc)
    with Client(users_server.id) as client:  # the locks went with their process
        assert client.is_server_ready()
