"""Borrowing a socket from another process (shm/peer_fds.py): the socket itself when allowed,
nothing when the descriptor now names another socket, and a refusal the caller can tell apart."""
from __future__ import annotations

import os
import socket

import pytest

import shm.peer_fds
from shm.peer_fds import PeerSockets


@pytest.fixture(autouse=True, params=["c", "ctypes"])
def path(request, monkeypatch):
    """Each test on both paths: the C helper (shm/_peer_send.c, when built) and ctypes."""
    if request.param == "ctypes":
        monkeypatch.setattr(shm.peer_fds, "send_borrowed", None)
    elif shm.peer_fds.send_borrowed is None:
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
