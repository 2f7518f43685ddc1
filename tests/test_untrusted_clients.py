"""Local clients that write garbage into shared memory, and clients that die with work queued.

A local client (same user) owns its segment and writes its request ring, its lanes on every worker
and the broker's connect ring. Here a client writes what the library never would, through the raw
layouts: a record with an offset of 2**40 or a slot of 0xFFFFFFFF, a ring tail of 2**62, a
descriptor whose length prefix runs past its block, a connect record whose name is not text or
names another process's segment, sequence fields the broker's batcher cannot use. Each time the broker and the workers live on (same pids, no
ballooning memory), another client's requests sent meanwhile all succeed, and the bad client is
disconnected: a warning naming it, its segment unlinked, its queued request failed. A client
killed by SIGKILL with many requests queued behind a slow model has none of them run after it is
gone, and the ones running see ``is_cancelled()``.
"""
from __future__ import annotations

import os
import select
import threading
import signal
import struct
import subprocess
import time

import numpy as np
import orjson
import pytest

from conftest import (DEADLINE_S, PRODUCT_MODELS, PYTHON, ROOT, SHM_MODELS, TESTS, pending_requests, wait_pending,
                      wait_until)
from gates import Gate
from shmserve.shm.answer import AnswerDescriptor
from shmserve.shm.client import Client, InferenceServerError, ServerUnavailable
from shmserve.shm.control_messages import ControlMessage
from shmserve.shm.names import object_name
from shmserve.shm.descriptor import InferRequest, InputTensor
from shmserve.shm.protocol import REQ_BYE, REQ_INFER, SLOT_PENDING, write_manifest

A = np.arange(16, dtype=np.int32)
B = np.full(16, 3, dtype=np.int32)
X = {"X": np.array([7], np.int32)}
RSS_GROWTH_LIMIT_KB = 64 << 10  # the broken drain grew by about 500 MB a second


@pytest.fixture(scope="module")
def server(module_factory):
    return module_factory.start(
        [PRODUCT_MODELS, SHM_MODELS, TESTS / "models" / "cancel"],
        ["--model-control-mode", "explicit", "--load-model", "add_sub", "--load-model", "held",
         "--load-model", "held_pair", "--load-model", "running_sum"])


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def server_processes(server) -> dict[int, str]:
    """The broker's and the workers' pids, with their titles."""
    return {pid: t for pid, t in server.titles().items() if t.startswith(("shmserve broker", "shmserve worker"))}


class Traffic:
    """A well-behaved client sending add_sub requests on its own thread, counting failures."""

    def __init__(self, server_id: str) -> None:
        self.client = Client(server_id)
        self.done = 0
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            try:
                r = self.client.infer("add_sub", {"INPUT0": A + k, "INPUT1": B})
                assert r["OUTPUT0"].tolist() == (A + k + B).tolist(), f"wrong answer for request {k}"
                self.done += 1
            except BaseException as e:  # noqa: BLE001 - the test reports it
                self.failures.append(e)
            time.sleep(0.002)

    def wait_more(self, n: int) -> None:
        target = self.done + n
        wait_until(lambda: self.done >= target or bool(self.failures), f"{n} more answers to the good client")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self.client.close()


# -- what a bad client writes ------------------------------------------------------------------------


GOOD = InferRequest("add_sub", "", [InputTensor("INPUT0", "INT32", [16], 64, 0)]).encode()


def patched(**fields: int) -> bytes:
    """A valid descriptor's bytes with header words overwritten, as a broken client writes them:
    ``n_inputs`` (offset 12), ``model_len`` (64), ``text_len`` (84: all its strings)."""
    raw = bytearray(GOOD)
    at = {"n_inputs": 12, "model_len": 64, "text_len": 84}
    for name, value in fields.items():
        struct.pack_into("<I", raw, at[name], value)
    return bytes(raw)


def bad_text() -> bytes:
    """A descriptor whose model name is not UTF-8 (same length as 'add_sub')."""
    return GOOD.replace(b"add_sub", b"add\xff\xfeub")


def block(bad: Client, length_prefix: int | None = None, descriptor: bytes = GOOD) -> tuple[int, int]:
    """A real block in the bad client's arena holding ``descriptor`` (or just a length prefix of
    ``length_prefix``): (offset, length)."""
    conn = bad._conn  # noqa: SLF001 - the attack writes the raw layouts
    off = conn.arena.alloc(256)
    if length_prefix is None:
        write_manifest(conn.seg.seg.buf, off, descriptor)
    else:
        struct.pack_into("<I", conn.seg.seg.buf, off, length_prefix)
    return off, 256


FREE_SLOT = 1000  # a slot the bad client's few requests never take


def on_ring(bad: Client, kind: int, slot: int, off: int, length: int) -> None:
    conn = bad._conn  # noqa: SLF001
    assert conn.seg.requests.put(kind, slot, off, length, 0)
    conn.broker.waker.notify()


def on_lane(bad: Client, kind: int, slot: int, off: int, length: int) -> None:
    """A record on the bad client's lane, its slot (a real one) bound to the block as the library
    binds it: the worker then reads the block (a record no slot binds runs nothing: it could be
    another user's, test_client_users.py)."""
    conn = bad._conn  # noqa: SLF001
    num, worker = conn._router.pick(InferRequest("add_sub"))  # noqa: SLF001
    if slot < conn.seg.nslots:
        conn.seg.bind(slot, off, length)
        conn.seg.set_target(slot, num + 1)
        conn.seg.set_slot_state(slot, SLOT_PENDING)
    assert worker.lanes[conn.lane].put(kind, slot, off, length, conn._cookie)  # noqa: SLF001
    worker.ring_bell(conn.lane)
    worker.waker.notify()


def ring_tail(bad: Client) -> None:
    conn = bad._conn  # noqa: SLF001
    conn.seg.requests._ctr[1] = 1 << 62  # noqa: SLF001 - the client's own counter
    conn.broker.waker.notify()


def lane_tail(bad: Client) -> None:
    conn = bad._conn  # noqa: SLF001
    _, worker = conn._router.pick(InferRequest("add_sub"))  # noqa: SLF001
    worker.lanes[conn.lane]._ctr[1] = 1 << 62  # noqa: SLF001 - the lane's producer counter is the client's
    worker.ring_bell(conn.lane)
    worker.waker.notify()


ATTACKS = {
    "ring_offset": lambda bad: on_ring(bad, REQ_INFER, FREE_SLOT, 1 << 40, 256),
    "ring_slot": lambda bad: on_ring(bad, REQ_INFER, 0xFFFFFFFF, *block(bad)),
    "ring_tail": ring_tail,
    "ring_descriptor_length": lambda bad: on_ring(bad, REQ_INFER, FREE_SLOT, *block(bad, 0x7FFFFFF0)),
    "ring_unknown_kind": lambda bad: on_ring(bad, 0x77, FREE_SLOT, *block(bad)),
    "lane_offset": lambda bad: on_lane(bad, REQ_INFER, FREE_SLOT, 1 << 40, 256),
    "lane_slot": lambda bad: on_lane(bad, REQ_INFER, 0xFFFFFFFF, *block(bad)),
    "lane_tail": lane_tail,
    "lane_descriptor_length": lambda bad: on_lane(bad, REQ_INFER, FREE_SLOT, *block(bad, 0x7FFFFFF0)),
    "lane_descriptor_short": lambda bad: on_lane(bad, REQ_INFER, FREE_SLOT, *block(bad, 3)),
    # The binary descriptor (shm/descriptor.py): counts and lengths past the block, bad text.
    "ring_string_past_block": lambda bad: on_ring(bad, REQ_INFER, FREE_SLOT,
                                                  *block(bad, descriptor=patched(model_len=1 << 20, text_len=1 << 20))),
    "lane_tensor_count": lambda bad: on_lane(bad, REQ_INFER, FREE_SLOT,
                                             *block(bad, descriptor=patched(n_inputs=1 << 31))),
    "lane_bad_utf8": lambda bad: on_lane(bad, REQ_INFER, FREE_SLOT, *block(bad, descriptor=bad_text())),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_client_writing_garbage_is_disconnected_and_nothing_else_breaks(server, tmp_path, attack):
    processes = server_processes(server)
    rss = {pid: rss_kb(pid) for pid in processes}
    gate = Gate(tmp_path / "gate")
    traffic = Traffic(server.id)
    bad = Client(server.id)
    name = bad._conn.name  # noqa: SLF001
    try:
        running = bad.infer_async("held", X, request_id="running", parameters={"gate": gate.param})
        gate.wait_started(1)
        queued = bad.infer_async("held", X, request_id="queued", parameters={"gate": gate.param})
        wait_pending(server, "held", 2)
        traffic.wait_more(3)
        ATTACKS[attack](bad)
        line = f"disconnected client {name} (pid {os.getpid()})"
        wait_until(lambda: line in server.log(), "the broker logs the bad client's disconnection")
        wait_until(lambda: not os.path.exists("/dev/shm" + name), "the bad client's segment is unlinked")
        # Its running request is cancelled (the model sees it); its queued one never runs and fails.
        wait_until(lambda: (gate.folder / "saw-cancel-running").exists(), "the running model saw is_cancelled()")
        with pytest.raises(InferenceServerError) as failed:
            queued.result(DEADLINE_S)
        assert "disconnected this client" in failed.value.message, failed.value.message
        running.exception(DEADLINE_S)  # answered or failed, not left hanging
        with pytest.raises((ServerUnavailable, InferenceServerError)):
            bad.infer("add_sub", {"INPUT0": A, "INPUT1": B})
        traffic.wait_more(5)  # the good client was served all along, and still is
        wait_until(lambda: pending_requests(server, "held") == 0, "the queued request dropped")
        assert len(gate.started()) == 1, "the disconnected client's queued request ran"
    finally:
        gate.open()
        traffic.stop()
        bad.close()
    assert traffic.failures == [], traffic.failures[:3]
    assert server_processes(server) == processes, "a server process died or was restarted"
    # Skipped lane records count as finished: nothing stays pending, and add_sub could still drain.
    wait_until(lambda: pending_requests(server, "add_sub") == 0, "nothing pending for add_sub")
    for pid, before in rss.items():
        assert rss_kb(pid) - before < RSS_GROWTH_LIMIT_KB, (processes[pid], before, rss_kb(pid))
    with Client(server.id) as fresh:  # and the server serves on as before
        assert fresh.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()


def test_a_client_killed_holding_the_connect_lock_blocks_no_other(server):
    """A client killed while it puts its connect record (here: holding the lock, then SIGKILL)
    leaves the ring to the next: the kernel drops the lock with its process."""
    from shmserve.shm.channel import BrokerSegment

    holder = subprocess.Popen(
        [PYTHON, "-c", "import sys, time\n"
         "from shmserve.shm.channel import BrokerSegment\n"
         "broker = BrokerSegment.attach(sys.argv[1])\n"
         "with broker.connect_lock():\n"
         "    print('HELD', flush=True)\n"
         "    time.sleep(600)\n", server.id], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
        broker = BrokerSegment.attach(server.id)
        try:
            with pytest.raises(ConnectionError, match="connect ring is locked"):
                with broker.connect_lock(timeout=0.5):
                    pass
        finally:
            broker.close()
    finally:
        holder.kill()
        holder.wait(DEADLINE_S)
    with Client(server.id) as fresh:
        assert fresh.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()


def test_garbage_on_the_connect_ring_is_refused(server):
    processes = server_processes(server)
    pid = os.getpid()
    with Client(server.id) as good:
        broker = good._conn.broker  # noqa: SLF001
        [ring] = broker.connect_rings.values()  # (connect.0: this process is of the server's user)

        def announce(raw: bytes) -> None:
            with broker.connect_lock():
                assert ring.put(pid, raw)
            broker.waker.notify()

        announce(b"\xff\xfe\xfd not text")
        wait_until(lambda: f"client {pid} could not be attached: malformed connect record" in server.log(),
                   "the broker refuses a name that is not text")
        # A name of a segment that is not this process's own client segment: the broker's own.
        announce(object_name(server.id, "broker", 0).encode())
        wait_until(lambda: "is not a client segment of that process" in server.log(),
                   "the broker refuses to take its own segment for a client's")
        # Scribbled counters: the records are skipped, and the next client connects as usual.
        with broker.connect_lock():
            ring._ctr[1] = 1 << 62  # noqa: SLF001
        broker.waker.notify()
        wait_until(lambda: f"the connect ring of uid {os.geteuid()}'s ring counters corrupt" in server.log(),
                   "the broker resyncs the ring")
        with Client(server.id) as fresh:
            assert fresh.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()
        assert good.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT1"].tolist() == (A - B).tolist()
    assert server_processes(server) == processes


def test_sequence_fields_a_program_writes_are_typed(server):
    """The descriptor holds only a correlation ID the broker's sequence batcher can key (an
    unsigned 64-bit integer or a string) and flags it can test (a list as correlation ID once
    took the broker down): the library refuses to encode another, and the extremes are served."""
    processes = server_processes(server)
    value = np.array([[2.0]], np.float32)
    with Client(server.id) as client:
        conn = client._conn  # noqa: SLF001 - raw descriptors, to send what the library never would

        def send(fields: dict) -> tuple[int, AnswerDescriptor]:
            doc = InferRequest("running_sum", "", [InputTensor("VALUE", "FP32", [1, 1], 4, 0)], **fields)
            answers: list = []
            done = threading.Event()

            def answered(c) -> None:
                answers.append((c.status, c.answer))
                c.release()
                done.set()

            conn.infer(doc, [value], answered)
            assert done.wait(DEADLINE_S), f"no answer for {fields}"
            return answers[0]

        for bad in ({"sequence_id": [1], "sequence_flags": 1}, {"sequence_id": {"k": 1}, "sequence_flags": 1},
                    {"sequence_id": 9, "sequence_flags": "start"}, {"sequence_id": 9, "sequence_flags": -1},
                    {"sequence_id": -9, "sequence_flags": 1}, {"sequence_id": 1 << 64, "sequence_flags": 1}):
            with pytest.raises(ValueError, match="cannot be encoded"):
                send(bad)
        assert send({"sequence_id": 9, "sequence_flags": 1})[0] == 200
        assert send({"sequence_id": (1 << 64) - 1, "sequence_flags": 0xFFFFFFFF})[0] == 200
        r = client.infer("running_sum", {"VALUE": value}, sequence_id="s", sequence_start=True)
        assert r["SUM"].tolist() == [[2.0]]
    assert server_processes(server) == processes


KID = r"""
import sys
import numpy as np
from shmserve.shm.client import Client
server_id, gate, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
c = Client(server_id)
x = {"X": np.array([1], np.int32)}
lane = [c.infer_async("held", x, request_id=f"lane{i}", parameters={"gate": gate}) for i in range(n)]
pair = [c.infer_async("held_pair", {"X": np.array([[1]], np.int32)}, request_id=f"pair{i}",
                      parameters={"gate": gate}) for i in range(6)]
print("sent", flush=True)
import time
time.sleep(120)
"""


def test_a_killed_clients_queued_work_is_dropped_and_its_running_work_cancelled(server, tmp_path):
    processes = server_processes(server)
    gate = Gate(tmp_path / "gate")
    n = 20
    proc = subprocess.Popen([PYTHON, "-c", KID, server.id, gate.param, str(n)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], DEADLINE_S)
        assert ready and proc.stdout.readline().strip() == "sent", proc.stderr.read() if proc.poll() else ""
        gate.wait_started(3)  # one on held's lane, two on held_pair's instances
        wait_pending(server, "held", n)  # the rest queued on held's lane ...
        wait_pending(server, "held_pair", 6)  # ... and in the broker's queue
        proc.send_signal(signal.SIGKILL)
        proc.wait(DEADLINE_S)
        wait_until(lambda: (gate.folder / "saw-cancel-lane0").exists(), "the running lane request saw is_cancelled()")
        wait_until(lambda: len(list(gate.folder.glob("saw-cancel-pair*"))) == 2,
                   "the running broker-path requests saw is_cancelled()")
        wait_until(lambda: pending_requests(server, "held") == 0, "held's queued requests dropped")
        wait_until(lambda: pending_requests(server, "held_pair") == 0, "held_pair's queued requests dropped")
        assert len(gate.started()) == 3, "a dead client's queued request ran"
        gate.open()
        with Client(server.id) as good:  # the instances serve the next client at once
            assert int(good.infer("held", X, parameters={"gate": gate.param})["Y"][0]) == 7
            assert int(good.infer("held_pair", {"X": np.array([[7]], np.int32)},
                                  parameters={"gate": gate.param})["Y"][0][0]) == 7
        assert len(gate.started()) == 5
    finally:
        gate.open()
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
    assert server_processes(server) == processes


def test_a_closed_clients_work_in_flight_is_cancelled(server, tmp_path):
    """close() fails what is in flight on the client's side; on the server's, nobody waits for
    it any more: the running request sees is_cancelled() and the queued one never runs."""
    gate = Gate(tmp_path / "gate")
    client = Client(server.id)
    try:
        client.infer_async("held", X, request_id="running", parameters={"gate": gate.param})
        gate.wait_started(1)
        client.infer_async("held", X, request_id="queued", parameters={"gate": gate.param})
        wait_pending(server, "held", 2)
        client.close()
        wait_until(lambda: (gate.folder / "saw-cancel-running").exists(), "the running model saw is_cancelled()")
        wait_until(lambda: pending_requests(server, "held") == 0, "the queued request dropped")
        assert len(gate.started()) == 1, "the closed client's queued request ran"
    finally:
        gate.open()
        client.close()


def test_a_goodbye_without_unlinking_leaves_no_segment_behind(server):
    """The library unlinks its segment before it says goodbye (REQ_BYE); a client that says it
    and keeps its names, then dies, left them in /dev/shm until the server stopped: the broker
    unlinks them when it forgets the client."""
    client = Client(server.id)
    conn = client._conn  # noqa: SLF001 - a goodbye as the library never sends it
    path = "/dev/shm/" + conn.seg.name.lstrip("/")
    assert os.path.exists(path)
    conn.seg.requests.put(REQ_BYE, 0, 0, 0, 0)
    conn.broker.waker.notify()
    try:
        wait_until(lambda: not os.path.exists(path), "the broker unlinked the departed client's segment")
    finally:
        client.close()
    with Client(server.id) as again:
        assert again.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()


class CraftedControl(ControlMessage):
    """A control message as no sender builds it: the JSON a client may write in its block."""

    def __init__(self, doc: object) -> None:
        object.__setattr__(self, "doc", doc)

    def encode(self) -> bytes:
        return orjson.dumps(self.doc)


@pytest.mark.parametrize("doc, refusal", [
    ({"op": "model_ready", "model": ["add_sub"]}, "model_ready: 'model' must be a string"),
    ({"op": "shm_register", "name": "r", "key": "/k", "byte_size": -8},
     "shm_register: 'byte_size' must be a non-negative"),
    ({"op": "load", "model": "add_sub", "parameters": "config"}, "load: 'parameters' must be a JSON object"),
    ({"op": "model_config"}, "model_config: 'model' is missing"),
    ({"op": "no_such_thing"}, "unknown control operation 'no_such_thing'"),
])
def test_a_control_message_no_sender_builds_is_a_400_and_the_client_goes_on(server, doc, refusal):
    """The broker decodes each control message against its type (shm/control_messages.py): a
    malformed one is answered 400 naming the field, and the client's next calls work."""
    with Client(server.id) as client:
        with pytest.raises(InferenceServerError) as e:
            client._control(CraftedControl(doc))  # noqa: SLF001
        assert e.value.status == 400 and f"malformed control request: {refusal}" in e.value.message, e.value
        assert client.is_model_ready("add_sub")
        assert client.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()


# A client of the server's own user holds a request in ``held`` at the gate, then truncates its own
# segment to nothing and waits (it would die of SIGBUS itself at its next touch: it touches nothing).
TRUNCATE_OWN = r"""
import os, sys
import numpy as np
from shmserve.shm.client import Client
c = Client(sys.argv[1])
held = c.infer_async("held", {"X": np.array([7], np.int32)}, request_id="cut", parameters={"gate": sys.argv[2]})
sys.stdin.readline()
fd = os.open("/dev/shm" + c._conn.name, os.O_RDWR)
os.ftruncate(fd, 0)
print("cut", flush=True)
sys.stdin.readline()
os._exit(0)
"""


def test_a_client_of_the_servers_user_truncating_its_segment_kills_no_server_process(server, tmp_path):
    """The server's own user's client segment was not guarded (only objects another user may write
    were): a client that truncated it while its request ran killed the worker that then wrote its
    answer, and the broker that next read its ring, with SIGBUS. Its segment is guarded as another
    user's is (shm/truncation_guard.py): the client is disconnected and every process lives on."""
    processes = server_processes(server)
    gate = Gate(tmp_path / "gate")
    traffic = Traffic(server.id)
    proc = subprocess.Popen([PYTHON, "-c", TRUNCATE_OWN, server.id, gate.param], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        gate.wait_started(1)
        traffic.wait_more(3)
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "cut", proc.stderr.read() if proc.poll() is not None else ""
        gate.open()  # the worker answers into the truncated segment
        wait_until(lambda: f"(pid {proc.pid}), which wrote garbage" in server.log() or
                   "it truncated its segment" in server.log(), "the truncating client is disconnected")
        traffic.wait_more(5)
    finally:
        gate.open()
        traffic.stop()
        if proc.poll() is None:
            proc.kill()
        proc.wait(DEADLINE_S)
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()  # type: ignore[union-attr]
    assert traffic.failures == [], traffic.failures[:3]
    assert server_processes(server) == processes, "a server process died or was restarted"
    with Client(server.id) as fresh:
        assert fresh.infer("add_sub", {"INPUT0": A, "INPUT1": B})["OUTPUT0"].tolist() == (A + B).tolist()


HOSTILE = TESTS / "hostile_client.py"
FUZZ_MODES = ["header", "ring", "slots", "block", "lanes", "truncate", "descriptor"]


@pytest.mark.parametrize("mode", FUZZ_MODES)
def test_a_client_corrupting_its_shared_memory_while_the_server_reads_it(server, mode):
    """Fuzz with races (tests/hostile_client.py, a fixed seed): a client of the server's user sends
    requests for 1.5 s while a thread of its own writes boundary and random values into what
    ``mode`` names (its header, ring, slots, request blocks, lane records, its segment's size, or
    the descriptor's values), concurrently with the server reading them. The broker and workers
    live on, another client is served right all along, the hostile client gets answers or errors,
    and none of its segments outlives it."""
    processes = server_processes(server)
    traffic = Traffic(server.id)
    try:
        traffic.wait_more(2)
        done = subprocess.run([PYTHON, str(HOSTILE), server.id, mode, "7", "1.5"], cwd=ROOT, capture_output=True,
                              text=True, timeout=DEADLINE_S)
        # (truncating its own segment, it may die of SIGBUS itself at its next touch)
        assert done.returncode == 0 or (mode == "truncate" and done.returncode == -signal.SIGBUS), done.stderr[-2000:]
        if done.returncode == 0:
            outcomes = orjson.loads(done.stdout.split("OUTCOMES ", 1)[1])
            # (a client that scribbles its own sleeping flag or slot states may miss its own answers)
            assert outcomes and ("HANG" not in outcomes or mode in ("header", "slots")), outcomes
        segments = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("SEGMENT ")]
        assert segments, done.stdout
        wait_until(lambda: not any(os.path.exists("/dev/shm" + name) for name in segments),
                   "the broker unlinked the dead hostile client's segments")
        traffic.wait_more(3)
    finally:
        traffic.stop()
    assert traffic.failures == [], traffic.failures[:3]
    assert server_processes(server) == processes, "a server process died or was restarted"
