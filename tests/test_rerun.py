"""``Connection.rerun``: the HTTP frontend's next request on a keep-alive connection goes in the
slot and block of the last one, once the worker wrote that one's answer to the HTTP client whole.
Here the test process plays the frontend: a real server, a loop-driven connection, and a socket
pair whose end the worker borrows (``pidfd_getfd``) to write the answers to."""
from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from shmserve.server.frontend.codec import build_request, split_body
from shmserve.shm.connection import Completion, Connection
from shmserve.shm.peer_fds import allow_tracing_by
from shmserve.shm.protocol import DIRECT_TRAILER, SENT_ALL, SLOT_DONE, read_manifest_raw

from test_direct_answers import _wait_for
from test_repeated_heads import _add_sub, _pairs

HEAD = b"HTTP/1.1 200 OK\r\n\r\n"  # what the worker writes before the outputs (any bytes will do)
ROUTE = ("add_sub", "")


class Frontend:
    """The test's side: a connection whose answers are looked for by polling, as the loop does."""

    def __init__(self, server) -> None:
        self.conn = Connection(server.id, loop_driven=True)
        allow_tracing_by(self.conn.broker_pid)  # the worker may borrow our socket
        self.completions: list[tuple[str, Completion]] = []
        request = _add_sub(*_pairs(1, 1)[0])
        body = request[request.index(b"\r\n\r\n") + 4:]
        n = int(request.split(b"Inference-Header-Content-Length: ")[1].split(b"\r\n")[0])
        doc, tail = split_body(body, str(n))
        req, _ = build_request("add_sub", "", doc, tail, 1 << 20)
        self.prefix = Connection.prepared_prefix(req)

    def on(self, name: str):
        return lambda completion: self.completions.append((name, completion))

    def send(self, a: np.ndarray, b: np.ndarray, name: str, trailer: bytes = b"", sent_ns: int = 0) -> int:
        return self.conn.submit_prepared(self.prefix, ROUTE, [a.tobytes(), b.tobytes()], 128, self.on(name),
                                         sent_ns or time.monotonic_ns(), False, trailer)

    def rerun(self, slot: int, a: np.ndarray, b: np.ndarray, name: str, sent_ns: int = 0) -> int:
        return self.conn.rerun(slot, a.tobytes() + b.tobytes(), len(self.prefix), sent_ns or time.monotonic_ns(),
                               self.on(name), ROUTE)

    def completed(self, name: str) -> Completion:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.conn.complete_ready()
            for n, c in self.completions:
                if n == name:
                    return c
            time.sleep(0.001)
        raise AssertionError(f"no completion for {name}")

    def answered(self, slot: int) -> None:
        """Until the slot is answered (the worker completes it right after its send)."""
        _wait_for(lambda: self.conn.seg.slot_states[slot] == SLOT_DONE, "the slot was not answered")

    def close(self) -> None:
        self.conn.close()


@pytest.fixture
def frontend(server):
    fe = Frontend(server)
    yield fe
    fe.close()


def _expected_answer(fe: Frontend, name: str = "learn") -> bytes:
    """The answer descriptor the worker writes for add_sub, from one request answered the usual way."""
    a, b = _pairs(2, 1)[0]
    fe.send(a, b, name)
    completion = fe.completed(name)
    assert completion.status == 200
    raw, _ = read_manifest_raw(completion.buf, completion.offset)
    completion.release()
    return raw


def _trailer(raw: bytes, sock: socket.socket) -> bytes:
    return raw + HEAD + DIRECT_TRAILER.pack(sock.fileno(), len(raw), len(HEAD), 0, os.fstat(sock.fileno()).st_ino)


def _read_answer(sock: socket.socket) -> tuple[np.ndarray, np.ndarray]:
    want = len(HEAD) + 128
    data = b""
    sock.settimeout(10)
    while len(data) < want:
        data += sock.recv(want - len(data))
    assert data[:len(HEAD)] == HEAD
    out = np.frombuffer(data[len(HEAD):], dtype=np.int32)
    return out[:16], out[16:]


def test_a_slot_answered_whole_takes_the_next_requests(frontend):
    """Three requests in one slot: each answer, written by the worker, holds its own sums; the
    earlier ones are over without a completion, and the last completes as a direct answer. The
    block is the same throughout, and is freed with the last."""
    fe = frontend
    raw = _expected_answer(fe)
    idle = fe.conn.arena.bytes_in_use
    ours, theirs = socket.socketpair()
    with ours, theirs:
        trailer = _trailer(raw, ours)
        pairs = _pairs(3, 3)
        sent_ns = time.monotonic_ns()
        slot = fe.send(*pairs[0], "first", trailer, sent_ns)
        used = fe.conn.arena.bytes_in_use
        for i, (a, b) in enumerate(pairs):
            s, d = _read_answer(theirs)
            np.testing.assert_array_equal(s, a + b)
            np.testing.assert_array_equal(d, a - b)
            fe.answered(slot)
            if i + 1 < len(pairs):
                last, sent_ns = sent_ns, time.monotonic_ns()
                answered_at = fe.rerun(slot, *pairs[i + 1], f"rerun{i}", sent_ns)
                assert last < answered_at <= sent_ns  # when the worker wrote the last answer
                assert fe.conn.arena.bytes_in_use == used  # the same block: nothing taken or freed
        completion = fe.completed("rerun1")
        assert completion.sent == SENT_ALL and completion.status == 200
        completion.release()
        assert [n for n, _ in fe.completions] == ["learn", "rerun1"]  # the first two ended in reruns
        assert fe.conn.in_flight == 0
    _expected_answer(fe, "again")  # (the arena reclaims freed blocks when it next allocates)
    assert fe.conn.arena.bytes_in_use == idle


def test_a_slot_answered_otherwise_is_not_taken(frontend):
    """An answer the worker did not write itself (it expected another descriptor, so the answer
    lies in a block), a send time of fewer digits, and a slot completed already: no rerun,
    nothing changed, and the request completes as usual."""
    fe = frontend
    raw = _expected_answer(fe)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        a, b = _pairs(4, 1)[0]
        slot = fe.send(a, b, "other", _trailer(raw + b" ", ours))  # a descriptor the worker never writes
        fe.answered(slot)
        assert fe.rerun(slot, a, b, "no") == -1
        completion = fe.completed("other")
        assert completion.sent == 0 and completion.status == 200 and completion.offset != 0
        completion.release()

        slot = fe.send(a, b, "short", _trailer(raw, ours))
        _read_answer(theirs)
        fe.answered(slot)
        assert fe.rerun(slot, a, b, "no", sent_ns=10**12) == -1  # 13 digits: the document would shrink
        completion = fe.completed("short")
        assert completion.sent == SENT_ALL
        completion.release()
    assert fe.rerun(slot, a, b, "no") == -1  # completed: not ours any more
    assert "no" not in [n for n, _ in fe.completions] and fe.conn.in_flight == 0


def test_a_block_changed_under_a_kept_request_is_read_again(frontend):
    """The worker keeps what it derived from a direct request by its client and slot, and knows a
    rerun by the block's bytes. A block whose descriptor changed (here its inputs swapped names:
    the difference turns over) or whose trailer changed (another socket) is read again, and the
    answer is the new one's, on the new socket."""
    fe = frontend
    raw = _expected_answer(fe)
    ours, theirs = socket.socketpair()
    other, other_peer = socket.socketpair()
    with ours, theirs, other, other_peer:
        pairs = _pairs(5, 4)
        slot = fe.send(*pairs[0], "first", _trailer(raw, ours))
        _read_answer(theirs)
        fe.answered(slot)
        assert fe.rerun(slot, *pairs[1], "kept") > 0  # the kept way
        s, d = _read_answer(theirs)
        np.testing.assert_array_equal(d, pairs[1][0] - pairs[1][1])
        fe.answered(slot)

        off = fe.conn._callbacks[slot][1]
        buf = fe.conn.seg.seg.buf
        (n,) = np.frombuffer(buf[off:off + 4], dtype="<u4")
        doc = bytes(buf[off + 4:off + 4 + n])
        assert doc.count(b'"INPUT0"') == 1 and doc.count(b'"INPUT1"') == 1
        buf[off + 4:off + 4 + n] = doc.replace(b'"INPUT0"', b'"INPUTX"').replace(b'"INPUT1"', b'"INPUT0"') \
            .replace(b'"INPUTX"', b'"INPUT1"')
        a, b = pairs[2]
        assert fe.rerun(slot, a, b, "swapped") > 0
        s, d = _read_answer(theirs)
        np.testing.assert_array_equal(s, a + b)
        np.testing.assert_array_equal(d, b - a)  # the block's names, not the kept ones
        fe.answered(slot)

        total = fe.conn._totals[slot]
        at = off + total - DIRECT_TRAILER.size
        buf[at:at + DIRECT_TRAILER.size] = DIRECT_TRAILER.pack(
            other.fileno(), len(raw), len(HEAD), 0, os.fstat(other.fileno()).st_ino)
        a, b = pairs[3]
        assert fe.rerun(slot, a, b, "moved") > 0
        s, d = _read_answer(other_peer)
        np.testing.assert_array_equal(s, a + b)
        fe.answered(slot)
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)  # nothing more on the old socket
        completion = fe.completed("moved")
        assert completion.sent == SENT_ALL
        completion.release()
