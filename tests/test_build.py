"""The install compiles the request path (setup.py, compiled-modules.txt) unless told not to, and
the server's processes run what it built."""
from __future__ import annotations

import importlib
import os
import re

import numpy as np
import pytest
import tritonclient.http as httpclient

from conftest import ROOT, compiled_modules

PURE = os.environ.get("SHMSERVE_PURE_PYTHON") == "1"


def _module_names() -> list[str]:
    return [".".join(src.relative_to(ROOT).with_suffix("").parts) for src in compiled_modules()]


def test_the_request_path_runs_compiled():
    modules = _module_names()
    assert "shm.connection" in modules and "workers.worker" in modules and "shm._peer_send" in modules, modules
    for src, name in zip(compiled_modules(), modules):
        if src.suffix == ".c" and PURE:  # a C helper is not built: its caller takes the Python path
            with pytest.raises(ImportError):
                importlib.import_module(name)
            continue
        path = importlib.import_module(name).__file__ or ""
        assert path.endswith(".py") if PURE else path.endswith(".so"), (name, path)


def test_a_served_request_goes_through_the_compiled_modules(server):
    """The frontend and the worker that answer a request have the extensions mapped (or, for a
    plain-Python install, none of them): the library mypyc built the modules into, and the
    module the process's interpreted start imports (a module that only compiled ones import is
    set up from that library without loading its own file)."""
    client = server.client()
    inputs = [httpclient.InferInput(name, [16], "INT32") for name in ("INPUT0", "INPUT1")]
    for t in inputs:
        t.set_data_from_numpy(np.arange(16, dtype=np.int32))
    assert client.infer("add_sub", inputs).as_numpy("OUTPUT0").tolist() == list(range(0, 32, 2))
    client.close()
    roles = {pid: title for pid, title in server.titles().items()
             if title.startswith(("shmserve frontend", "shmserve worker add_sub "))}
    assert len(roles) == 2, server.titles()
    for pid, title in roles.items():
        with open(f"/proc/{pid}/maps") as f:
            mapped = f.read()
        module = "workers/worker" if "worker" in title else "server/frontend/inference"
        assert (f"{ROOT}/{module}.cpython-" in mapped) is not PURE, (title, module)
        assert (re.search(rf"{re.escape(str(ROOT))}/\w+__mypyc\.cpython-", mapped) is not None) is not PURE, title
