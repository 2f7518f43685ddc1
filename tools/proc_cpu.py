"""What a server's processes spend, read from /proc, so a benchmark can say where the CPU went.

On a machine where the clients share the cores with the server, throughput is bounded by the CPU
that one request costs everybody: the clients' part, the server's part and the cores left idle.
``shmserve-perf`` (tools/perf/measure.py, compare.py) reads the server's part here, for the
whole process tree that listens on the server's port (shmserve's launcher, broker, workers and
frontends, whether the port is the HTTP or the gRPC one; tritonserver and its Python stubs), and
the idle share of the machine, around each window.

It also reads how long the processes were runnable but waited for a core (``run_delay`` of
``/proc/<pid>/task/<tid>/schedstat``). That tells two regimes apart that the CPU figures alone do
not: clients that wait for their answers, and clients that wait for a core while the server's
processes hold the other (then the rate is the clients' own cost on one core, and a cheaper
server changes nothing).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from shmserve.tools.harness import cmdline, descendants, stat_fields

_TICK_US = 1e6 / os.sysconf("SC_CLK_TCK")
_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp
# A kernel without CONFIG_SCHED_INFO keeps no schedstat: waits for a core are then unknown, not 0.
WAITS_KNOWN = os.path.exists("/proc/self/schedstat")


@dataclass(frozen=True)
class Usage:
    """CPU time and time spent waiting for a core (microseconds) and context switches of a set
    of processes, summed."""

    user_us: float = 0.0
    system_us: float = 0.0
    voluntary: int = 0
    involuntary: int = 0
    waited_us: float = 0.0  # runnable, but on a run queue behind other tasks

    def __sub__(self, other: "Usage") -> "Usage":
        return Usage(self.user_us - other.user_us, self.system_us - other.system_us,
                     self.voluntary - other.voluntary, self.involuntary - other.involuntary,
                     self.waited_us - other.waited_us)

    def __add__(self, other: "Usage") -> "Usage":
        return Usage(self.user_us + other.user_us, self.system_us + other.system_us,
                     self.voluntary + other.voluntary, self.involuntary + other.involuntary,
                     self.waited_us + other.waited_us)

    @property
    def cpu_us(self) -> float:
        return self.user_us + self.system_us


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] == _LISTEN and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes


def server_tree(port: int) -> list[int]:
    """The processes of the server listening on ``port``: the topmost holder of the listening
    socket (or the shmserve launcher above it) and all its descendants; empty if none can be seen
    (another user's, or no listener)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return []
    holders = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
            if any(os.readlink(f"/proc/{entry}/fd/{fd}") in wanted for fd in fds):
                holders.add(int(entry))
        except OSError:
            continue
    roots = []
    for pid in holders:
        fields = stat_fields(pid)
        if fields is not None and int(fields[1]) not in holders:
            roots.append(_server_root(pid, int(fields[1])))
    return sorted({p for root in roots for p in (root, *descendants(root))})


def _server_root(holder: int, parent: int) -> int:
    """shmserve's gRPC process binds its own port (grpcio takes no inherited socket), one level
    below the launcher that holds the HTTP socket: its server is the launcher's whole tree."""
    return parent if cmdline(parent).startswith("shmserve launcher ") else holder


def usage(pids: list[int]) -> Usage:
    """Summed CPU time, waits for a core and context switches (of every thread) of the live
    ``pids``."""
    total = Usage()
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None:
            continue  # gone meanwhile
        try:
            voluntary = involuntary = waited_ns = 0
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/status") as f:
                    for line in f:
                        if line.startswith("voluntary_ctxt_switches:"):
                            voluntary += int(line.split()[1])
                        elif line.startswith("nonvoluntary_ctxt_switches:"):
                            involuntary += int(line.split()[1])
                if WAITS_KNOWN:
                    with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                        waited_ns += int(f.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        total += Usage(int(fields[11]) * _TICK_US, int(fields[12]) * _TICK_US, voluntary, involuntary,
                       waited_ns / 1e3)
    return total


def machine_ticks() -> tuple[int, int]:
    """(idle, all) clock ticks of the whole machine since boot; iowait counts as idle."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)
