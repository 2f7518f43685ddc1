"""The reference Triton as a server process of the tools' own (tools.harness.ServerProcess): an
unpacked nvidia-pytriton tree (``tools/gpu_triton.py``'s parts, unpacked on the GPU machine, or the
site-packages of ../shared/tools/reference-triton's venv here) on free ports, ready when
constructed, its tritonserver and Python-backend stub pids for CPU time and GPU memory, a clean stop.

The stub embeds the Python of ``python`` (default: this interpreter): it needs that version's
``libpython3.X.so.1.0``, looked up in the interpreter's LIBDIR, its base prefix's ``lib``, the
system's library folders and last the tree's ``triton-lib`` (tools/gpu_triton.py's fallback), then
put on LD_LIBRARY_PATH. Without it the server cannot run a Python model: ``TritonUnavailable`` says
so before anything starts. The embedded interpreter ignores
PYTHONPATH and takes its prefix from the first ``python3`` on PATH, so the server gets a venv of its
own on PATH: over ``python``'s base interpreter, its site-packages holding ``triton-site`` first (the
tree's numpy 1.26: see tools/gpu_triton.py) and then ``python``'s own (torch, torchvision, numpy).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shmserve.tools.harness import ServerProcess, cmdline, descendants, free_port

SERVER = "pytriton/tritonserver"
STUB = "triton_python_backend_stub"
SYSTEM_LIBS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/lib")


class TritonUnavailable(RuntimeError):
    """The tree or the Python its stub needs is missing: the Triton paths are skipped, not the rest."""


def python_facts(python: str) -> dict[str, str]:
    """Version, LIBDIR, base prefix and site-packages of ``python`` (another interpreter, asked)."""
    code = ("import sys, sysconfig; v = sys.version_info; p = sysconfig.get_paths(); "
            "print(f'{v[0]}.{v[1]}'); print(sysconfig.get_config_var('LIBDIR') or ''); print(sys.base_prefix); "
            "print(p['purelib']); print(p['platlib']); print(getattr(sys, '_base_executable', sys.executable))")
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    version, libdir, base, purelib, platlib, base_executable = out.strip().split("\n")
    return {"version": version, "libdir": libdir, "base_prefix": base, "purelib": purelib, "platlib": platlib,
            "base_executable": base_executable}


def libpython_dir(facts: dict[str, str], fallback: Path | None = None) -> Path | None:
    """The folder holding ``libpython<version>.so.1.0``: the interpreter's LIBDIR first,
    ``fallback`` (a tree's ``triton-lib``) last."""
    name = f"libpython{facts['version']}.so.1.0"
    for folder in (facts["libdir"], f"{facts['base_prefix']}/lib", *SYSTEM_LIBS, str(fallback or "")):
        if folder and (Path(folder) / name).exists():
            return Path(folder)
    return None


def stub_version(root: Path) -> str | None:
    """The Python version the tree's stub links (``libpython3.X.so``), from its dynamic section."""
    stub = root / SERVER / "backends" / "python" / STUB
    if not stub.exists():
        return None
    out = subprocess.run(["readelf", "-d", str(stub)], capture_output=True, text=True, timeout=30).stdout
    for word in out.split():
        if word.startswith("[libpython"):
            return word[len("[libpython"):].split(".so")[0]
    return None


def place_stub(root: Path, version: str) -> None:
    """A wheel's tree (reference-triton's venv) keeps one stub per version; the backend runs the one
    in ``backends/python`` (as ../shared/tools/reference-triton places it)."""
    target = root / SERVER / "backends" / "python" / STUB
    source = root / SERVER / "python_backend_stubs" / version / STUB
    if not target.exists() and source.exists():
        shutil.copy2(source, target)


def stub_venv(dest: Path, facts: dict[str, str], first: Path | None) -> Path:
    """A venv at ``dest`` over the base interpreter of ``facts``: ``first`` (if any), then the
    interpreter's own site-packages, through .pth files (``site.addsitedir``, so theirs are read
    too). Returns its bin folder, for PATH."""
    site = dest / "lib" / f"python{facts['version']}" / "site-packages"
    site.mkdir(parents=True)
    (dest / "bin").mkdir()
    (dest / "bin" / "python3").symlink_to(facts["base_executable"])
    (dest / "pyvenv.cfg").write_text(f"home = {Path(facts['base_executable']).parent}\n"
                                     "include-system-site-packages = false\n"
                                     f"version = {facts['version']}\n")
    dirs = [str(first)] if first else []
    dirs += dict.fromkeys((facts["purelib"], facts["platlib"]))
    for i, folder in enumerate(dirs):
        (site / f"{i}_triton_stub.pth").write_text(f"import site; site.addsitedir({folder!r})\n")
    return dest / "bin"


class TritonProcess(ServerProcess):
    """``tritonserver`` of the tree at ``root`` (holding ``pytriton/tritonserver`` and
    ``nvidia_pytriton.libs``) on free HTTP, gRPC and metrics ports with ``repos``."""

    def __init__(self, root: Path | str, repos: list[Path | str], *flags: str, python: str = sys.executable,
                 log: Path | None = None) -> None:
        self.root = Path(root)
        self.binary = self.root / SERVER / "bin" / "tritonserver"
        if not self.binary.exists():
            raise TritonUnavailable(f"no tritonserver at {self.binary}")
        facts = python_facts(python)
        place_stub(self.root, facts["version"])
        linked = stub_version(self.root)
        if linked != facts["version"]:
            raise TritonUnavailable(f"the Python backend stub in {self.root} links Python {linked}, "
                                    f"{python} is {facts['version']}")
        libdir = libpython_dir(facts, self.root / "triton-lib")
        if libdir is None:
            raise TritonUnavailable(
                f"libpython{facts['version']}.so.1.0 is not in {facts['libdir']} (LIBDIR of {python}) nor in "
                f"{', '.join(SYSTEM_LIBS)}: Triton's Python backend stub cannot start here")
        site = self.root / "triton-site"
        self._venv = tempfile.TemporaryDirectory(prefix="triton-stub-venv-")
        bin_dir = stub_venv(Path(self._venv.name), facts, site if site.is_dir() else None)
        self._env = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME", "PYTHONPATH", "VIRTUAL_ENV")}
        self._env["PATH"] = os.pathsep.join((str(bin_dir), os.environ.get("PATH", "")))
        self._env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(libdir), os.environ.get("LD_LIBRARY_PATH", "")) if p)
        self.grpc_port = free_port()
        try:
            super().__init__(repos, *flags, server_id=f"triton{os.getpid()}", log=log)
        except BaseException:
            self._venv.cleanup()
            raise

    def command(self, repos: list[Path | str], flags: tuple[str, ...]) -> list[str]:
        backends = self.root / SERVER / "backends"
        return [str(self.binary), *[f"--model-repository={r}" for r in repos], f"--backend-directory={backends}",
                f"--cache-directory={self.root / SERVER / 'caches'}", "--http-address=127.0.0.1",
                f"--http-port={self.port}", "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
                f"--metrics-port={self.metrics_port}", "--exit-timeout-secs=10", *flags]

    def environment(self) -> dict[str, str]:
        return self._env

    def stop(self, timeout: float = 60) -> int:
        try:
            return super().stop(timeout)
        finally:
            self._venv.cleanup()

    def worker_pids(self, model: str) -> list[int]:
        """The model's Python-backend stubs (one per instance)."""
        return [p for p in descendants(self.proc.pid)
                if STUB in cmdline(p) and f"/{model}/" in cmdline(p)]


def main(argv: list[str] | None = None) -> int:
    """For shell scripts (tools/gpu_run.sh): serve until SIGTERM or SIGINT, the addresses written
    to ``--ready-file`` as ``<http> <grpc>`` once ready; exit 3 with the reason when it cannot run."""
    import argparse
    import signal

    p = argparse.ArgumentParser(prog="python -m shmserve.tools.triton_process", description=main.__doc__)
    p.add_argument("--root", type=Path, required=True, help="folder holding pytriton/tritonserver")
    p.add_argument("--python", default=sys.executable, help="the Python the stub embeds")
    p.add_argument("--ready-file", type=Path, required=True)
    p.add_argument("--log", type=Path)
    p.add_argument("repository")
    p.add_argument("flags", nargs="*", help="tritonserver flags (after --)")
    args = p.parse_args(argv)
    stop = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.append(1))
    try:
        server = TritonProcess(args.root, [args.repository], *args.flags, python=args.python, log=args.log)
    except (TritonUnavailable, RuntimeError) as exc:
        print(f"Triton cannot run: {exc}", file=sys.stderr)
        return 3
    try:
        args.ready_file.write_text(f"{server.url} 127.0.0.1:{server.grpc_port}\n")
        while not stop and server.proc.poll() is None:
            time.sleep(0.2)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
