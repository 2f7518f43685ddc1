"""How a process hands a child it starts its spec (a JSON document): as the child's stdin, an
anonymous file (``memfd_create``; an unlinked temporary file where that is missing). A
command-line argument has a limit (128 KiB on Linux: a larger config override would fail the
start with "Argument list too long") and is readable by every user in /proc/<pid>/cmdline; the
file has no size limit, needs no writable folder (a read-only root file system), and has no
name, so nothing is left behind whatever happens to either process.
"""
from __future__ import annotations

import os
import sys
import tempfile
from typing import IO, Any

import orjson


def spec_file(spec: Any) -> IO[bytes]:
    """``spec`` as a file to start a child with (``Popen(..., stdin=spec_file(spec))``); the
    parent closes it once the child is started."""
    f: IO[bytes]
    try:
        f = os.fdopen(os.memfd_create("shmserve-spec", os.MFD_CLOEXEC), "w+b")
    except (AttributeError, OSError):  # not Linux, or a kernel without memfd
        f = tempfile.TemporaryFile()
    f.write(orjson.dumps(spec))
    f.seek(0)
    return f


def read_spec() -> Any:
    """In the child: the spec its parent gave it (``spec_file``). Stdin is /dev/null afterwards,
    as for a child started without one (a model that reads stdin sees its end)."""
    data = sys.stdin.buffer.read()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    return orjson.loads(data)
