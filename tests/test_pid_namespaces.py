"""Local clients in PID namespaces of their own, as an application container beside the server in
one Kubernetes pod: they share /dev/shm with the server and nothing else, so their pids mean
nothing to it (each is pid 1 in its namespace). The server judges their liveness by the tickets
of shm/liveness.py, never by pid; names and regions keyed on pids would collide.
The podman test of the same (two containers) is tests/test_pod.py.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import DEADLINE_S, ROOT, shm_names, start_shm_server, wait_until
from gates import Gate

from as_nobody import NOBODY, run_as_nobody
from shmserve.shm.channel import LANE_PENDING, ClientSegment
from shmserve.shm.client import Client

# A client that is pid 1 of its own PID namespace: it says its pid and ticket, serves one request
# by copy and one from a region of its own, then sends one to slow_reader held at the gate and
# says so; then it waits for stdin to close (or to be killed).
NAMESPACED = r"""
import os, sys
import numpy as np
from shmserve.shm.channel import LANE_PENDING, ClientSegment
from shmserve.shm.client import Client
server_id, gate = sys.argv[1], sys.argv[2]
c = Client(server_id)
a = np.arange(16, dtype=np.int32)
assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
region = c.create_region(f"mine_{c._conn.ticket}", 4096)  # region names are server-wide
x = region.array(np.int32, (16,))
x[:] = 5
assert c.infer("add_sub", {"INPUT0": x, "INPUT1": a})["OUTPUT0"].tolist() == (5 + a).tolist()
held = c.infer_async("slow_reader", {"X": a[:8]}, parameters={"sleep_s": 0, "gate": gate})
print(os.getpid(), c._conn.ticket, region.key, c._conn.name, flush=True)
sys.stdin.read()
assert held.result(60)["SUM"].tolist() == [int(a[:8].sum())]
c.close()
print("closed", flush=True)
"""


class Namespaced:
    """A client process in a new PID namespace (``unshare --pid --fork --mount-proc``)."""

    def __init__(self, server_id: str, gate: Gate) -> None:
        self.proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", NAMESPACED,
                                      server_id, gate.param], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], DEADLINE_S)
        line = self.proc.stdout.readline().split() if ready else []
        if len(line) != 4:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
            pytest.fail(f"the namespaced client did not start: {line} {err}")
        self.pid, self.ticket, self.key, self.segment = int(line[0]), int(line[1]), line[2], line[3]

    def client_pid(self) -> int:
        """The client's pid as this namespace sees it (unshare's child)."""
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        return int(children[0])

    def finish(self) -> str:
        """Let it collect its held answer and close; what it printed last."""
        out, err = self.proc.communicate("", timeout=DEADLINE_S)
        assert self.proc.returncode == 0, err
        return out.strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)
        if os.path.exists("/dev/shm" + getattr(self, "key", "/-")):
            os.unlink("/dev/shm" + self.key)  # a failed test: the server did not reclaim it


@pytest.fixture(scope="module")
def ns_server(module_factory):
    return start_shm_server(module_factory)


def test_clients_in_other_pid_namespaces_are_served_and_a_killed_one_is_reclaimed(ns_server, tmp_path):
    gate = Gate(tmp_path / "gate")
    first = Namespaced(ns_server.id, gate)
    try:
        second = Namespaced(ns_server.id, gate)
        try:
            # Both are pid 1 where they live: a pid names neither, tickets tell them apart.
            assert first.pid == second.pid == 1
            assert first.ticket != second.ticket and first.segment != second.segment
            gate.wait_started(1)
            killed = first.client_pid()
            os.kill(killed, signal.SIGKILL)  # mid-request: its slow_reader request is in the model
            first.proc.wait(DEADLINE_S)
            wait_until(lambda: shm_names(first.segment.lstrip("/")) == [], "the killed client's segment goes")
            wait_until(lambda: not os.path.exists("/dev/shm" + first.key),
                       "the server unlinks the region the killed client created")
            assert "died; reclaiming its channel" in ns_server.log()
            # The survivor's objects stay, and its held request is answered once the gate opens.
            assert shm_names(second.segment.lstrip("/")) and os.path.exists("/dev/shm" + second.key)
            gate.open()
            assert second.finish() == "closed"
            assert not os.path.exists("/dev/shm" + second.key)
            assert shm_names(second.segment.lstrip("/")) == []
        finally:
            second.stop()
    finally:
        gate.open()
        first.stop()
    with Client(ns_server.id) as c:  # served on, as ever
        a = np.arange(16, dtype=np.int32)
        assert c.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()


def test_a_client_of_another_user_is_refused_in_one_clear_line(ns_server):
    """The server's objects are its user's (0600): a client of another uid may not attach, and
    says why instead of "no server is running"."""
    got = run_as_nobody("""
from shmserve.shm.client import ServerUnavailable
try:
    Client(args)
    result = "connected"
except ServerUnavailable as e:
    result = str(e)
""", ns_server.id)
    assert "runs as another user" in got and f"uid {NOBODY.pw_uid}" in got, got


def test_a_connect_record_whose_ticket_no_process_holds_is_refused(ns_server):
    """A segment announced under a ticket no live process holds (its maker is gone, or never held
    it) is not attached: liveness is the kernel's lock, not what the record or header says."""
    with Client(ns_server.id) as good:
        conn = good._conn  # noqa: SLF001
        free = next(t for t in range(conn.ticket + 1, conn.ticket + 1000) if not conn._tickets.held(t))  # noqa: SLF001
        name = f"/shmserve.{ns_server.id}.client.{free}-0"
        seg = ClientSegment.create(name, 1 << 20, free)
        try:
            conn.broker.announce(free, name)
            wait_until(lambda: f"ticket {free} is held by no live process" in ns_server.log(),
                       "the broker refuses a ticket nobody holds")
            assert seg.lane == LANE_PENDING, "the broker attached it"
        finally:
            seg.close()
            seg.unlink()
        a = np.arange(16, dtype=np.int32)
        assert good.infer("add_sub", {"INPUT0": a, "INPUT1": a})["OUTPUT0"].tolist() == (2 * a).tolist()
