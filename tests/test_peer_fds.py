"""Borrowing a socket from another process (shm/peer_fds.py): the socket itself when allowed,
nothing when the descriptor now names another socket, and a refusal the caller can tell apart."""
from __future__ import annotations

import math
import os
import socket
import time

import pytest

import shmserve.shm.peer_fds
from shmserve.shm.peer_fds import PeerSockets


@pytest.fixture(autouse=True, params=["c", "ctypes"])
def path(request, monkeypatch):
    """Each test on both paths: the C helper (shm/_peer_send.c, when built) and ctypes."""
    if request.param == "ctypes":
        monkeypatch.setattr(shm.peer_fds, "c_borrow", None)
        monkeypatch.setattr(shm.peer_fds, "c_send_now", None)
    elif shm.peer_fds.c_borrow is None:
        assert os.environ.get("SHMSERVE_PURE_PYTHON") == "1", "the C helper was not built"
    return request.param


def test_a_borrowed_socket_is_written_to_and_a_reused_number_is_not():
    a, b = socket.socketpair()
    peers = PeerSockets()
    try:
        ino = os.fstat(a.fileno()).st_ino
        assert peers.write(os.getpid(), a.fileno(), ino, b"hello") == 5
        assert b.recv(10) == b"hello"
        assert peers.write(os.getpid(), a.fileno(), ino + 1, b"other") == 0  # not that socket any more
        b.setblocking(False)
        assert not _has_data(b)
    finally:
        peers.close()
        a.close()
        b.close()


def test_a_borrowed_socket_is_kept_for_a_while_then_given_back():
    """The holder closes its socket: ours keeps it open (its peer sees no end) until the hold is
    over, and answers written meanwhile still arrive."""
    a, b = socket.socketpair()
    peers = PeerSockets()
    try:
        fd, ino = a.fileno(), os.fstat(a.fileno()).st_ino
        assert peers.write(os.getpid(), fd, ino, b"one") == 3
        started = time.monotonic()
        a.close()  # the frontend lets the connection go
        assert peers.write(os.getpid(), fd, ino, b"two") == 3  # the kept duplicate: no borrow
        assert _read(b, 6) == b"onetwo"
        b.setblocking(False)
        assert not _has_data(b)  # no end yet: the duplicate holds it open
        assert 0 < peers.release_due(started) <= shm.peer_fds.HOLD_S
        assert not _has_data(b)
        assert peers.release_due(started + shm.peer_fds.HOLD_S) == math.inf  # given back
        b.setblocking(True)
        assert b.recv(10) == b""  # the end, now
        assert peers.release_due(time.monotonic()) == math.inf  # nothing held
    finally:
        peers.close()
        b.close()


def test_a_kept_socket_whose_number_names_a_later_one_is_given_back_at_once():
    """The holder's descriptor number names another socket now (a later connection): the write
    goes to that one, and the earlier socket is given back at once (its peer sees the end)."""
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    peers = PeerSockets()
    try:
        fd = a.fileno()
        assert peers.write(os.getpid(), fd, os.fstat(fd).st_ino, b"old") == 3
        assert b.recv(10) == b"old"
        os.dup2(c.fileno(), fd)  # the number now names c's socket (and a's is closed for us)
        assert peers.write(os.getpid(), fd, os.fstat(c.fileno()).st_ino, b"new") == 3
        assert d.recv(10) == b"new"
        b.settimeout(5)
        assert b.recv(10) == b""  # a's socket went with our duplicate
    finally:
        peers.close()
        for s in (a, b, c, d):
            s.close()


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        data += sock.recv(n - len(data))
    return data


def _has_data(sock: socket.socket) -> bool:
    try:
        sock.recv(10, socket.MSG_PEEK)
        return True
    except BlockingIOError:
        return False


def test_borrowing_from_a_process_we_may_not_trace_is_refused():
    """A process of another user (as root: a child that became nobody borrows from us; as
    anyone else: we borrow from init) is refused: -1, remembered for that process."""
    a, b = socket.socketpair()
    try:
        if os.getuid() == 0:
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: another user, borrowing from its root parent
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    result = PeerSockets().write(os.getppid(), a.fileno(), os.fstat(a.fileno()).st_ino, b"x")
                    os.write(w, str(result).encode())
                finally:
                    os._exit(0)
            os.close(w)
            os.waitpid(pid, 0)
            result = int(os.read(r, 10))
            os.close(r)
        else:
            peers = PeerSockets()
            result = peers.write(1, 0, 0, b"x")
            assert peers.write(1, 0, 0, b"x") == -1  # remembered
        assert result == -1
    finally:
        a.close()
        b.close()
