"""The install: one public import name, plain Python (no C compiler needed), and no generic
top-level names left in site-packages."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import ROOT


def test_the_wheel_installs_one_import_name_and_one_compiled_library(tmp_path: Path):
    """A wheel of the repository holds ``shmserve`` only (the folders server/, workers/, shm/ and
    tools/ go under it), every module as source; the one compiled file is the truncation guard,
    a plain shared object built from shm/truncation_guard.c (no Python module), beside its source."""
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (wheel,) = tmp_path.glob("shmserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"shmserve"}, tops
    sources = [path for folder in ("shmserve", "server", "workers", "shm", "tools")
               for path in (ROOT / folder).rglob("*.py")]
    expected = {"shmserve/" + str(p.relative_to(ROOT)).removeprefix("shmserve/") for p in sources}
    assert expected - set(names) == set(), "modules of the repository missing from the wheel (pyproject's packages)"
    compiled = [n for n in names if n.endswith((".so", ".c"))]
    assert len(compiled) == 2 and "shmserve/shm/truncation_guard.c" in compiled, compiled  # (and its source)
    assert [n for n in compiled if n.startswith("shmserve/shm/_truncation_guard.") and n.endswith(".so")], compiled
    assert "shmserve.tools" not in "".join(n for n in names if n.endswith("entry_points.txt"))


def test_the_public_import_name_gives_the_local_client():
    run = subprocess.run([sys.executable, "-c", "import sys, shmserve; print('numpy' in sys.modules); "
                          "from shmserve import Client; print(Client.__module__)"],
                         capture_output=True, text=True, cwd="/", timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["False", "shmserve.shm.client"]


def test_python_dash_m_shmserve_is_the_shmserve_command():
    run = subprocess.run([sys.executable, "-m", "shmserve", "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "--model-repository" in run.stdout, run.stderr


# What only the tests (and the optional extras) bring: `make serve` must install none of them.
TEST_ONLY = ("pytest", "moto", "schemathesis", "hypothesis", "onnx", "openai", "s3fs", "gcsfs", "matplotlib",
             "plotly", "opentelemetry-sdk", "kubernetes-validate", "gcp-storage-emulator")


def make_dry_run(target: str) -> str:
    """The commands ``make TARGET`` would run on a fresh clone (-B: as if nothing were installed)."""
    run = subprocess.run(["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def installed_closure(name: str, extras: set[str]) -> set[str]:
    """The distributions a requirement pulls in, transitively, by the installed metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen: set[tuple[str, frozenset[str]]] = set()
    stack = [(name, frozenset(extras))]
    while stack:
        dist, wanted = stack.pop()
        if (canonicalize_name(dist), wanted) in seen:
            continue
        seen.add((canonicalize_name(dist), wanted))
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue  # (not for this platform or Python)
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in wanted | {""}):
                stack.append((req.name, frozenset(req.extras)))
    return {d for d, _ in seen}


def test_make_serve_installs_what_serving_needs_and_make_test_the_test_extra():
    """`make serve` installs the package with the extras that serve model_repository/ and run the
    README's clients, each step announced (pip's own lines show its progress); `make test` adds
    the test extra. What the serving install pulls in holds nothing the tests alone need."""
    serve = make_dry_run("serve")
    installs = [line for line in serve.splitlines() if " -m pip install " in line]
    assert any("torch==" in line for line in installs), installs
    [package] = [line for line in installs if " -e " in line]
    extras = set(package.split("'.[")[1].split("]")[0].split(","))
    assert extras == {"onnx", "examples"}, package
    assert serve.count('echo "make: [') == 3, serve  # each install step says what it does
    assert "--model-repository=model_repository" in serve
    assert "'.[test]'" not in serve
    assert "'.[test]'" in make_dry_run("test")
    served = installed_closure("shmserve", extras)
    assert {"onnxruntime", "scikit-learn", "torch", "tritonclient"} <= served, served
    assert not served & set(TEST_ONLY), served & set(TEST_ONLY)
    assert set(TEST_ONLY) <= installed_closure("shmserve", {"test"})


BLOCKER = '''import sys

class TestOnlyBlocker:
    """As if the test extra were not installed: its modules cannot be imported."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not installed by make serve)")
        return None

sys.meta_path.insert(0, TestOnlyBlocker())
'''


def test_the_repository_serves_without_the_test_extra(server_factory, tmp_path, monkeypatch):
    """model_repository/, every model loaded and answering, with the test-only modules unimportable in
    every process of the server: serving needs nothing `make serve` leaves out."""
    import numpy as np
    import tritonclient.http as httpclient

    modules = {"pytest", "moto", "schemathesis", "hypothesis", "onnx", "openai", "s3fs", "gcsfs", "matplotlib",
               "plotly", "opentelemetry", "kubernetes_validate", "gcp_storage_emulator", "sklearn"}
    (tmp_path / "sitecustomize.py").write_text(BLOCKER.format(blocked=modules))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    check = subprocess.run([sys.executable, "-c", "import onnx"], capture_output=True, text=True, timeout=60)
    assert "blocked: not installed by make serve" in check.stderr, check.stderr
    server = server_factory.start([ROOT / "model_repository"])
    client = server.client()
    assert len(client.get_model_repository_index()) == len(list((ROOT / "model_repository").glob("*/config.pbtxt")))
    answers = []
    for model in ("digits", "digits_onnx"):  # the PyTorch and ONNX Runtime backends
        pixels = httpclient.InferInput("INPUT__0", [1, 1, 8, 8], "FP32")
        pixels.set_data_from_numpy(np.ones((1, 1, 8, 8), np.float32))
        answers.append(client.infer(model, [pixels]).as_numpy("OUTPUT__0"))
    np.testing.assert_allclose(answers[0], answers[1], rtol=1e-4, atol=1e-4)
    client.close()
    assert "blocked" not in server.log()
