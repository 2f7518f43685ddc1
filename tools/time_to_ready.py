"""Measure how long a KServe v2 server takes from launch until N models are ready.

    python -m shmserve.tools.time_to_ready --models 7 [--url 127.0.0.1:8000] -- <server command with {repo}>

Builds a temporary repository of N renamed copies of the small Python-backend model
add_sub, starts the command with ``{repo}`` replaced by that path, polls the health and
per-model ready endpoints every 20 ms, prints the seconds, reports the RSS of the server's
process tree, then stops the server (SIGTERM, SIGKILL after 10 s) and removes the repository.
The same command line works for shmserve and the real Triton, so start-up cost compares directly.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SOURCE = PROJECT_ROOT.parent / "shared" / "bench-models" / "add_sub"
POLL_INTERVAL_S = 0.020
STOP_GRACE_S = 10.0
PLACEHOLDER = "{repo}"


@dataclass(frozen=True)
class ProcInfo:
    """One process of the server's tree, with its resident memory."""

    pid: int
    name: str
    rss_bytes: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """CLI: options before `--`, the server command after it."""
    p = argparse.ArgumentParser(prog="python -m shmserve.tools.time_to_ready", description=__doc__.splitlines()[0],
                                usage="%(prog)s [options] -- SERVER_COMMAND ... {repo} ...")
    p.add_argument("--models", type=int, default=7, help="number of add_sub copies in the repository")
    p.add_argument("--url", default="127.0.0.1:8000", help="host:port of the server's HTTP endpoint (loopback only)")
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="model directory to copy")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    p.add_argument("--log", type=Path, help="server stdout/stderr go here (default: a temp file, tail shown on failure)")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    args.command = argv[split + 1:]
    if not any(PLACEHOLDER in c for c in args.command):
        p.error(f"give the server command after `--`, with {PLACEHOLDER} where the repository path goes")
    if args.models < 1:
        p.error("--models must be >= 1")
    return args


def require_loopback(url: str) -> None:
    """Only poll servers on this machine."""
    host = url.rsplit(":", 1)[0].strip("[]")
    for info in socket.getaddrinfo(host, None):
        if not ipaddress.ip_address(info[4][0]).is_loopback:
            raise SystemExit(f"refusing non-loopback url {url!r}")


# ---------------------------------------------------------------- repository


def make_repository(source: Path, count: int) -> tuple[Path, list[str]]:
    """Temp repo with add_sub_0..N-1; each config's name field rewritten to match its folder."""
    repo = Path(tempfile.mkdtemp(prefix="ttr-repo-"))
    base = source.name
    names = [f"{base}_{i}" for i in range(count)]
    for name in names:
        dest = repo / name
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        rename_config(dest / "config.pbtxt", name)
    return repo, names


def rename_config(config: Path, name: str) -> None:
    """Rewrite (or add) the top-level `name:` so the server accepts the copy."""
    text = config.read_text()
    new, n = re.subn(r'^name:\s*"[^"]*"', f'name: "{name}"', text, count=1, flags=re.MULTILINE)
    config.write_text(new if n else f'name: "{name}"\n{text}')


# ---------------------------------------------------------------- polling


def http_ok(url: str) -> bool:
    """True when GET returns 200; connection errors just mean 'not yet'."""
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return resp.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def wait_ready(base: str, models: list[str], proc: subprocess.Popen[bytes], timeout: float, t0: float) -> tuple[float, float]:
    """Poll every 20 ms; returns (server-ready seconds, all-models-ready seconds)."""
    server_ready: float | None = None
    pending = list(models)
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        if server_ready is None and http_ok(f"{base}/v2/health/ready"):
            server_ready = time.monotonic() - t0
        if server_ready is not None:
            pending = [m for m in pending if not http_ok(f"{base}/v2/models/{m}/ready")]
            if not pending:
                return server_ready, time.monotonic() - t0
        time.sleep(POLL_INTERVAL_S)
    raise TimeoutError(f"not ready after {timeout:.0f} s; still waiting for {pending or 'server health'}")


# ---------------------------------------------------------------- memory


def process_tree(root: int) -> list[ProcInfo]:
    """The root and all its descendants with RSS; psutil when present, else /proc."""
    try:
        import psutil
    except ImportError:
        return proc_tree_from_procfs(root)
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        try:
            out.append(ProcInfo(p.pid, p.name(), p.memory_info().rss))
        except psutil.NoSuchProcess:
            continue
    return out


def proc_tree_from_procfs(root: int) -> list[ProcInfo]:
    """Fallback without psutil: parent links and VmRSS from /proc/<pid>/status."""
    status = {pid: read_status(pid) for pid in (int(d) for d in os.listdir("/proc") if d.isdigit())}
    children: dict[int, list[int]] = {}
    for pid, st in status.items():
        if st:
            children.setdefault(int(st.get("PPid", "0")), []).append(pid)
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        info = status.get(pid)
        if info:
            rss_kb = int(info.get("VmRSS", "0 kB").split()[0])
            out.append(ProcInfo(pid, info.get("Name", "?"), rss_kb * 1024))
            stack.extend(children.get(pid, []))
    return out


def read_status(pid: int) -> dict[str, str]:
    """/proc/<pid>/status as a dict; empty when the process is gone."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: v.strip() for k, _, v in (line.partition(":") for line in lines)}


def print_rss(procs: list[ProcInfo]) -> None:
    """Total first (the comparable number), then one line per process."""
    total = sum(p.rss_bytes for p in procs)
    print(f"rss total: {total / 2**20:.1f} MiB in {len(procs)} processes")
    for p in sorted(procs, key=lambda p: -p.rss_bytes):
        print(f"  pid {p.pid:>7}  {p.rss_bytes / 2**20:8.1f} MiB  {p.name}")


# ---------------------------------------------------------------- server lifecycle


def start_server(command: list[str], repo: Path, log: Path) -> subprocess.Popen[bytes]:
    """Launch in its own session so the whole tree can be signalled at once."""
    argv = [c.replace(PLACEHOLDER, str(repo)) for c in command]
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def stop_server(proc: subprocess.Popen[bytes]) -> int | None:
    """SIGTERM the process group, SIGKILL it after 10 s; returns the exit code."""
    for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait)
            # The leader is gone; make sure its group (stubs, workers) follows.
            wait_group_gone(proc.pid, wait)
            break
        except subprocess.TimeoutExpired:
            print(f"server did not stop on {sig.name}", file=sys.stderr)
    return proc.poll()


def wait_group_gone(pgid: int, timeout: float) -> None:
    """Bounded wait for the rest of the process group; kills stragglers at the end."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def tail(path: Path, lines: int = 20) -> str:
    """Last lines of the server log, to explain a failure."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    """Build the repo, time the start-up, report memory, always clean up."""
    args = parse_args(argv)
    require_loopback(args.url)
    base = f"http://{args.url}"
    if http_ok(f"{base}/v2/health/live") or http_ok(f"{base}/v2/health/ready"):
        raise SystemExit(f"something already answers at {args.url}; stop it first")
    repo, models = make_repository(args.source, args.models)
    log = args.log or repo.with_name(repo.name + ".log")
    proc = None
    try:
        t0 = time.monotonic()
        proc = start_server(args.command, repo, log)
        server_s, models_s = wait_ready(base, models, proc, args.timeout, t0)
        print(f"server ready: {server_s:.2f} s")
        print(f"time to ready ({len(models)} models): {models_s:.2f} s")
        print_rss(process_tree(proc.pid))
        return 0
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}\n--- server log tail ({log}) ---\n{tail(log)}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(repo, ignore_errors=True)
        if args.log is None and log.exists():
            log.unlink()


if __name__ == "__main__":
    sys.exit(main())
