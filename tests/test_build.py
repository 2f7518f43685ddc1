"""The install: one public import name, plain Python (no C compiler needed), and no generic
top-level names left in site-packages."""
from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import ROOT


def test_the_wheel_installs_one_import_name_and_no_extension(tmp_path: Path):
    """A wheel of the repository holds ``shmserve`` only (the folders server/, workers/, shm/ and
    tools/ go under it), every module as source: nothing to compile, nothing to go stale."""
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
    assert not [n for n in names if n.endswith((".so", ".c"))], names
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
