"""The install compiles the request path (setup.py, compiled-modules.txt) unless told not to."""
from __future__ import annotations

import importlib
import os

from conftest import ROOT, compiled_modules


def test_the_request_path_runs_compiled():
    modules = [".".join(src.relative_to(ROOT).with_suffix("").parts) for src in compiled_modules()]
    assert "shm.connection" in modules and "workers.worker" in modules, modules
    pure = os.environ.get("SHMSERVE_PURE_PYTHON") == "1"
    for name in modules:
        path = importlib.import_module(name).__file__ or ""
        assert path.endswith(".py") if pure else path.endswith(".so"), (name, path)
