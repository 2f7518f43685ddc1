"""Packs the reference Triton (tritonserver with its Python backend) for the lent GPU machine, which
has no package index and takes at most 64 MiB per call.

The nvidia-pytriton wheel (0.7.0: Triton 2.51) holds tritonserver, its Python backend, a stub per
Python version and, in ``nvidia_pytriton.libs/``, the libraries they link (RPATH ``$ORIGIN/..``, so
the wheel's layout is kept and nothing goes on LD_LIBRARY_PATH for them). Only what tritonserver
with the Python backend needs is kept: the server, ``backends/python`` with the stub of one Python
version placed where the backend looks for it, the local cache, and the libraries ``ldd`` names for
them (not the bundled libpython3.13: the stub links the machine's own libpython). And numpy 1.26
in ``triton-site/``: Triton 2.51's stub is built with a pybind11 that reads numpy's dtype records in
their 1.x layout, so under numpy 2 (the GPU machine has 2.5) every output a model hands over as a
numpy array has a byte size of 0 ("output tensor shape does not match size of output");
tools/triton_process.py puts that folder ahead of the machine's packages for the stub. The result
goes into an xz tarball in parts of at most 50 MB. The stub also needs the machine's
``libpython3.12.so.1.0``, which a Python without its shared library lacks: the tarball carries one
in ``triton-lib/``, from nvidia-pytriton 0.5.5 (whose wheel bundles a 3.12 build), used only when
the machine has none:

    python -m shmserve.tools.gpu_triton                   # -> .trt/part1 (...): the 3.12 stub
    python -m shmserve.tools.gpu_triton --python 3.11 --out /tmp/trt311 --check   # a CPU rehearsal here

``--check`` unpacks the parts into a temporary folder and starts that tritonserver on a one-model
repository (the stub must be able to run here: the host's Python version). ``tools/gpu_run.sh``
joins the parts (those stashed in /tmp/trt-parts by an earlier call) into /tmp/triton;
``tools/triton_process.py`` starts it.
"""
from __future__ import annotations

import argparse
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.7.0"  # Triton 2.51, as ../shared/tools/reference-triton
NUMPY = "1.26.4"  # the last numpy whose dtype layout the stub's pybind11 reads right
SITE = "triton-site"
LIBPYTHON_FROM = "0.5.5"  # an nvidia-pytriton whose wheel bundles libpython3.12 (0.6 and 0.7: 3.13)
FALLBACK_LIB = "triton-lib"
PART_BYTES = 50 * 1024 * 1024
SERVER = "pytriton/tritonserver"
LIBS = "nvidia_pytriton.libs"
KEPT = (f"{SERVER}/bin/tritonserver", f"{SERVER}/backends/python/libtriton_python.so",
        f"{SERVER}/backends/python/triton_python_backend_utils.py", f"{SERVER}/caches/local/libtritoncache_local.so")
STUB = f"{SERVER}/backends/python/triton_python_backend_stub"


def download(dest: Path, requirement: str, python: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", "--platform", "manylinux_2_35_x86_64",
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                    "-d", str(dest), requirement], check=True)
    return next(dest.glob(requirement.split("==")[0].replace("-", "_") + "-*.whl"))


def needed_libraries(tree: Path, binaries: list[str]) -> set[str]:
    """The file names in ``nvidia_pytriton.libs`` that ``ldd`` resolves for ``binaries`` (through
    their RPATH, so only the wheel's own copies count)."""
    names: set[str] = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(tree / binary)], capture_output=True, text=True, check=True).stdout
        names.update(m.group(1) for m in re.finditer(rf"=> \S*/{re.escape(LIBS)}/(\S+)", out))
    return names


def bundled_libpython(wheel: Path, python: str) -> bytes | None:
    """The libpython of ``python``'s version that an nvidia-pytriton wheel bundles (renamed by
    auditwheel: ``libpython3-<hash>.12.so.1.0``), if it has one."""
    minor = python.split(".")[1]
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if re.fullmatch(rf"{re.escape(LIBS)}/libpython3-[0-9a-f]+\.{minor}\.so\.1\.0", name):
                return z.read(name)
    return None


def pack(wheel: Path, numpy_wheel: Path, python: str, libpython: bytes | None) -> tuple[bytes, list[str]]:
    """The xz tarball of the kept files (the wheel's layout, the stub of ``python`` in place, numpy
    1.x in ``triton-site``, its tests left out), and the names of the libraries kept."""
    stub_src = f"{SERVER}/python_backend_stubs/{python}/triton_python_backend_stub"
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as z:
        tree = Path(tmp)
        members = {n for n in z.namelist()
                   if (n in KEPT or n == stub_src or n.startswith(f"{LIBS}/")) and not n.endswith("/")}
        if stub_src not in members:
            sys.exit(f"no stub for Python {python} in {wheel.name}")
        for name in members:
            target = tree / (STUB if name == stub_src else name)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
            target.chmod(0o755)
        libs = sorted(needed_libraries(tree, [*KEPT[:2], KEPT[3], STUB]))
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
            for name in [*KEPT, STUB, *(f"{LIBS}/{lib}" for lib in libs)]:
                tar.add(tree / name, arcname=name)
            with zipfile.ZipFile(numpy_wheel) as npz:
                for info in npz.infolist():
                    if info.is_dir() or "/tests/" in info.filename:
                        continue
                    member = tarfile.TarInfo(f"{SITE}/{info.filename}")
                    data = npz.read(info)
                    member.size, member.mode = len(data), 0o755 if ".so" in info.filename else 0o644
                    tar.addfile(member, io.BytesIO(data))
            if libpython is not None:
                member = tarfile.TarInfo(f"{FALLBACK_LIB}/libpython{python}.so.1.0")
                member.size, member.mode = len(libpython), 0o755
                tar.addfile(member, io.BytesIO(libpython))
    return buffer.getvalue(), libs


def check(out: Path) -> None:
    """Unpacks the parts and serves a one-model repository with that tritonserver (the stub of this
    host's Python), through the launcher the benchmarks use."""
    from shmserve.tools.triton_process import TritonProcess

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "triton"
        data = b"".join(p.read_bytes() for p in sorted(out.glob("part*")))
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:xz") as tar:
            tar.extractall(root, filter="data")
        repo = Path(tmp) / "repo" / "echo" / "1"
        repo.mkdir(parents=True)
        (repo / "model.py").write_text(
            "import triton_python_backend_utils as pb\n\nclass TritonPythonModel:\n"
            "    def execute(self, requests):\n"
            "        return [pb.InferenceResponse([pb.Tensor('OUT', pb.get_input_tensor_by_name(r, 'IN').as_numpy().copy())])"
            " for r in requests]\n")
        (repo.parent / "config.pbtxt").write_text(
            'backend: "python"\nmax_batch_size: 0\ninput [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
            'instance_group [ { count: 1 kind: KIND_CPU } ]\n')
        server = TritonProcess(root, [repo.parent.parent])
        try:
            import numpy as np
            import tritonclient.http as httpclient

            with httpclient.InferenceServerClient(server.url) as client:
                x = np.arange(4, dtype=np.float32)
                inp = httpclient.InferInput("IN", [4], "FP32")
                inp.set_data_from_numpy(x)
                out = httpclient.InferRequestedOutput("OUT", binary_data=True)
                got = client.infer("echo", [inp], outputs=[out]).as_numpy("OUT")
                assert np.array_equal(got, x), got
            print(f"check: the unpacked tritonserver served 'echo' (pids {server.tree()})")
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".trt"))
    parser.add_argument("--python", default="3.12", help="the Python version of the stub kept (the GPU machine's)")
    parser.add_argument("--wheel", type=Path, help="a downloaded nvidia-pytriton wheel (else pip downloads it)")
    parser.add_argument("--check", action="store_true", help="then start the unpacked server here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wheel = args.wheel or download(Path(tmp), f"nvidia-pytriton=={VERSION}", "3.12")
        older = Path(tmp) / "older"
        libpython = bundled_libpython(download(older, f"nvidia-pytriton=={LIBPYTHON_FROM}", "3.12"), args.python)
        if libpython is None:
            print(f"(nvidia-pytriton {LIBPYTHON_FROM} bundles no libpython{args.python}: none carried)")
        packed, libs = pack(wheel, download(Path(tmp), f"numpy=={NUMPY}", args.python), args.python, libpython)
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    for i in range(0, len(packed), PART_BYTES):
        (args.out / f"part{i // PART_BYTES + 1}").write_bytes(packed[i:i + PART_BYTES])
    print(f"tritonserver (nvidia-pytriton {VERSION}), Python {args.python} stub, {len(libs)} libraries, "
          f"numpy {NUMPY}{', a fallback libpython' if libpython else ''}: "
          f"{len(packed) / 2**20:.1f} MiB in "
          f"{', '.join(f'{p} ({p.stat().st_size / 2**20:.1f} MiB)' for p in sorted(args.out.iterdir()))}")
    if args.check:
        check(args.out)


if __name__ == "__main__":
    main()
