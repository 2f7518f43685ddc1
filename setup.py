"""shmserve's build: the modules on the request path (compiled-modules.txt) are compiled with mypyc.

The same source runs as plain Python; compiled, the shm channel, the frontend's request path and
the worker's loop take about 14% less CPU per request (tools/README.md, session 16). mypyc checks
the declared types at run time, so what those modules declare must be true.

The list holds C sources too: hand-written helpers for what Python cannot do in one call, each
built as the module its path names (``shm/_peer_send.c``: ``shm._peer_send``), whose callers fall
back to plain Python without it.

SHMSERVE_PURE_PYTHON=1 installs them uncompiled (no C compiler needed).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup

HERE = Path(__file__).parent


def compiled_modules() -> list[str]:
    return [line.strip() for line in (HERE / "compiled-modules.txt").read_text().splitlines() if line.strip()]


PACKAGES = ("server", "shm", "workers", "tools")


def remove_extensions(keep: list[str]) -> None:
    """Drop the extensions an earlier build left beside sources that are not (or no longer) to be
    compiled, and the earlier builds' shared libraries: Python would import a stale extension
    before its source, and it would bring its own copies of the modules it was built with."""
    kept = {HERE / Path(source).with_suffix("") for source in keep}
    for package in PACKAGES:
        for ext in (HERE / package).rglob("*.so"):
            if ext.parent / ext.name.split(".")[0] not in kept:
                ext.unlink()
    for shared in HERE.glob("*__mypyc.*.so"):
        shared.unlink()


def ext_modules() -> list:
    # pip runs this file for the metadata too; only a build needs the (slow) translation to C.
    metadata_only = any(cmd in sys.argv for cmd in ("egg_info", "dist_info")) and \
        not any(cmd in sys.argv for cmd in ("build_ext", "editable_wheel", "bdist_wheel", "build"))
    if os.environ.get("SHMSERVE_PURE_PYTHON") == "1":
        remove_extensions([])
        return []
    if metadata_only:
        return []
    remove_extensions(compiled_modules())
    from mypyc.build import mypycify

    # Third-party packages without type information count as Any (checked where they meet ours).
    sources = compiled_modules()
    helpers = [Extension(s[:-2].replace("/", "."), [s]) for s in sources if s.endswith(".c")]
    python = [s for s in sources if s.endswith(".py")]
    return mypycify(["--ignore-missing-imports", "--follow-imports=silent", *python], opt_level="3") + helpers


setup(ext_modules=ext_modules())
