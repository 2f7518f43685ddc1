"""Run a client program as the unprivileged user ``nobody``, for tests of what one user may do
to another's shared memory. The interpreter and packages live under /root (not readable by
nobody), so the child imports what the program needs first and then drops to nobody's uid and
groups; every socket and object it then makes is nobody's. The program gets ``args`` (JSON) and
sets ``result``, which comes back decoded."""
from __future__ import annotations

import json
import pwd
import subprocess
import sys
from typing import Any, Sequence

NOBODY = pwd.getpwnam("nobody")

_PRELUDE = """
import encodings.idna, json, os, sys
import numpy as np
import grpc
import posix_ipc
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException
from shmserve.shm.client import Client, InferenceServerError
from multiprocessing import resource_tracker
resource_tracker.ensure_running()  # tritonclient's regions are tracked by it; nobody could not start it
for _make in (httpclient.InferenceServerClient, grpcclient.InferenceServerClient):
    try:  # once as root: the modules the clients import when first used are loaded now
        _make("localhost:1").is_server_live()
    except Exception:
        pass
os.setgroups([])
os.setgid({gid})
os.setuid({uid})
args = json.loads(sys.argv[1])
result = None
"""
_EPILOGUE = "\nprint('RESULT ' + json.dumps(result))\n"


def run_as_nobody(program: str, args: Any = None, timeout: float = 120.0) -> Any:
    """Run ``program`` (Python source) as nobody; its ``result``. Fails the test if it raised."""
    return run_as(NOBODY.pw_uid, NOBODY.pw_gid, program, args, timeout)


def run_as(uid: int, gid: int, program: str, args: Any = None, timeout: float = 120.0) -> Any:
    """``run_as_nobody`` for any user and group (one the user database need not know)."""
    proc = start_as(uid, gid, program, args)
    out, err = proc.communicate(timeout=timeout)
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"as uid {uid}: rc {proc.returncode}\n{out}\n{err}"
    return json.loads(lines[-1][len("RESULT "):])


def result_after(proc: subprocess.Popen, say: str = "go\n", timeout: float = 120.0) -> Any:
    """The ``result`` of a program ``start_as`` started and that waits for a line (``say``) to
    go on; it is killed if it does not end in time. Fails the test if it raised."""
    try:
        out, err = proc.communicate(say, timeout=timeout)
    finally:
        stop(proc)
    assert proc.returncode == 0, err
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[len("RESULT "):])


def stop(proc: subprocess.Popen) -> None:
    """Kill a program ``start_as`` started, if it still runs (a test's ``finally``)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def start_as(uid: int, gid: int, program: str, args: Any = None, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """``program`` started as ``uid``:``gid``, its stdin, stdout and stderr pipes (text);
    ``prefix``: a command that runs it (``nsenter`` into a server's mount namespace)."""
    source = _PRELUDE.format(uid=uid, gid=gid) + program + _EPILOGUE
    return subprocess.Popen([*prefix, sys.executable, "-c", source, json.dumps(args)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
