"""What the operator tools share: a server process of their own on free ports, its process tree and
memory, and a clean stop (the tools must leave nothing behind)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from shmserve.shm.names import title_of

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after "pid (comm)" (the name may hold spaces and
    parentheses): [0] state, [1] ppid, [11] utime, [12] stime in clock ticks; None when gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) > 12 else None


def descendants(root: int) -> list[int]:
    """All live descendants of ``root`` (not ``root`` itself), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat_fields(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cmdline(pid: int) -> str:
    """A process's command line as ``ps`` shows it (setproctitle rewrites it); '' when gone."""
    return title_of(pid)


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of ``pids``, shared pages counted in each (what ``ps`` adds up)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def memory_kb(pid: int) -> dict[str, int]:
    """Pss and private kB of one process (smaps_rollup)."""
    out = {"pss": 0, "private": 0, "rss": 0}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            value = int(rest.split()[0]) if rest.strip() else 0
            if key == "Pss":
                out["pss"] = value
            elif key == "Rss":
                out["rss"] = value
            elif key in ("Private_Clean", "Private_Dirty"):
                out["private"] += value
    return out


def gpu_memory_mib(pids: list[int]) -> dict[int, int] | None:
    """GPU memory (MiB) nvidia-smi sees each of ``pids`` hold; None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    wanted, found = set(pids), {}
    for line in out.strip().splitlines():
        pid, _, mib = (part.strip() for part in line.partition(","))
        if pid.isdigit() and int(pid) in wanted and mib.isdigit():
            found[int(pid)] = found.get(int(pid), 0) + int(mib)
    return found


LASTING_ROLES = ("launcher", "broker", "frontend", "grpc")


def lasting(launcher: int) -> dict[int, str]:
    """The server's processes that live as long as it does, by the role in their title.

    Named, not "all but the workers": a worker just started has not set its title yet, and one
    that has exited but is not yet reaped has an empty command line; both would pass for lasting.
    """
    titles = {p: cmdline(p) for p in [launcher, *descendants(launcher)]}
    return {p: t for p, t in titles.items() if t.startswith(tuple(f"shmserve {r} " for r in LASTING_ROLES))}


def report_growth(titles: dict[int, str], before: dict[int, int], after: dict[int, int], limit_mb: float) -> int:
    """Print each lasting process's RSS before and after (``lasting``'s titles); how many grew by
    more than ``limit_mb``."""
    grown = 0
    for pid, title in titles.items():
        delta = (after[pid] - before[pid]) / (1 << 20)
        grown += delta > limit_mb
        print(f"  {title:40s} RSS {before[pid] / (1 << 20):7.1f} MiB -> {after[pid] / (1 << 20):7.1f} MiB "
              f"({delta:+.1f})")
    return grown


class ServerProcess:
    """``python -m shmserve`` on free loopback ports with a unique id, ready when constructed."""

    def __init__(self, repos: list[Path | str], *flags: str, server_id: str | None = None,
                 log: Path | None = None) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.url = f"127.0.0.1:{self.port}"
        self.id = server_id or f"tool{os.getpid()}"
        # (absolute: the server runs in ROOT, which is not the caller's folder when installed)
        cmd = self.command([Path(r).resolve() for r in repos], flags)
        out = open(log, "ab") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if log else out,
                                     stdin=subprocess.DEVNULL, start_new_session=True, env=self.environment())
        import tritonclient.http as h

        client = h.InferenceServerClient(self.url)
        deadline = time.monotonic() + 120
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.proc.returncode} while starting")
                try:
                    if client.is_server_ready():
                        return
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                time.sleep(0.05)
            raise RuntimeError("the server did not become ready within 120 s")
        except BaseException:  # (a KeyboardInterrupt too: the server is in a session of its own)
            self.stop()
            raise
        finally:
            client.close()

    def command(self, repos: list[Path | str], flags: tuple[str, ...]) -> list[str]:
        """The server's command line (another server's, in a subclass)."""
        return [sys.executable, "-m", "shmserve", *[f"--model-repository={r}" for r in repos],
                "--http-address=127.0.0.1", f"--http-port={self.port}", f"--metrics-port={self.metrics_port}",
                f"--id={self.id}", *flags]

    def environment(self) -> dict[str, str] | None:
        """The server's environment (None: this process's; another server's, in a subclass)."""
        return None

    def tree(self) -> list[int]:
        return [self.proc.pid, *descendants(self.proc.pid)]

    def worker_pids(self, model: str) -> list[int]:
        return [p for p in descendants(self.proc.pid) if cmdline(p).startswith(f"shmserve worker {model} ")]

    def shm_objects(self) -> list[str]:
        stem = f"shmserve.{self.id}."
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(stem) or n.startswith("sem." + stem))

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode
