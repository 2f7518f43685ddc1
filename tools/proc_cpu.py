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

Run as a module, it splits a server's cost per request by process while a load runs elsewhere
(the per-process table of docs/performance.md, "Where the time goes, target by target")::

    python -m shmserve.tools.proc_cpu --port 18600 --model add_sub --seconds 8

The requests are counted from the model's statistics (``/v2/models/<model>/stats``, Triton's
and shmserve's alike; ``--stats`` names the HTTP address when the load goes to the gRPC port).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
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


def successes(address: str, model: str) -> int:
    """The model's successful requests so far, every version, from its statistics over HTTP."""
    with urllib.request.urlopen(f"http://{address}/v2/models/{model}/stats", timeout=10) as r:
        doc = json.load(r)
    return sum(int(m["inference_stats"]["success"]["count"]) for m in doc["model_stats"])


def per_process(port: int, stats: str, model: str, seconds: float) -> tuple[int, list[tuple[str, Usage]]]:
    """(requests served, [(command line, usage)]) of each process of the server on ``port``
    that ran at all during ``seconds``."""
    pids = server_tree(port)
    if not pids:
        raise SystemExit(f"no server of ours listens on port {port}")
    before, count = {p: usage([p]) for p in pids}, successes(stats, model)
    time.sleep(seconds)
    after, served = {p: usage([p]) for p in pids}, successes(stats, model) - count
    rows = [(cmdline(p) or str(p), after[p] - before[p]) for p in pids]
    return served, [(name, u) for name, u in rows if u.cpu_us > 0 or u.voluntary or u.involuntary]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A server's CPU per request, process by process, while a load runs.")
    p.add_argument("--port", type=int, required=True, help="a port the server listens on (HTTP or gRPC)")
    p.add_argument("--stats", help="HOST:PORT of its HTTP endpoint, for the statistics (default: 127.0.0.1:PORT)")
    p.add_argument("--model", required=True, help="the model the load calls (its requests are counted)")
    p.add_argument("--seconds", type=float, default=8.0)
    args = p.parse_args(argv)
    served, rows = per_process(args.port, args.stats or f"127.0.0.1:{args.port}", args.model, args.seconds)
    if served <= 0:
        raise SystemExit(f"{args.model} served no request in {args.seconds} s: run a load beside this")
    print(f"{served} requests in {args.seconds:g} s ({served / args.seconds:.0f}/s); per request:")
    print(f"{'process':<48} {'CPU µs':>8} {'user':>8} {'system':>8} {'sleeps':>7} {'preempted':>9}")
    total = Usage()
    for name, u in rows:
        total += u
        print(f"{name[:48]:<48} {u.cpu_us / served:8.1f} {u.user_us / served:8.1f} {u.system_us / served:8.1f} "
              f"{u.voluntary / served:7.2f} {u.involuntary / served:9.2f}")
    print(f"{'whole server':<48} {total.cpu_us / served:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
