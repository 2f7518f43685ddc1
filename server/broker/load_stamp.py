"""Whether a load without ``config`` reads a serving model's folder again, by Triton 2.51's rule
(``ModelTimestamp`` in its model_repository_manager.cc): only when something in the folder (the
folder itself, its files and subfolders, followed through links, nothing ignored) has a
modification time later than the stamp of the load that serves. Otherwise that load changes
nothing and the model serves on as it was loaded, a ``config`` override included.

A load's stamp is the newest time in its folder when it read it. An override's is the time of the
override (Triton stamps the config file "now"), so a plain load after it keeps the override until a
file is written after it. Bytecode counts: Triton's Python backend writes ``<version>/__pycache__``
when it first imports a version (shmserve's does too, whatever PYTHONDONTWRITEBYTECODE says), so a
plain load after an override that loaded a version never imported before reads config.pbtxt again,
and one after an override of versions already imported keeps it.
"""
from __future__ import annotations

import os
import time

from .repository_scan import walk_once


def newest_mtime(folder: str) -> int:
    """The latest modification time (ns) of ``folder`` and everything under it; 0 if unreadable."""
    newest = 0
    for root, st, _, files in walk_once(folder):
        newest = max(newest, st.st_mtime_ns)
        for f in files:
            try:
                newest = max(newest, os.stat(os.path.join(root, f)).st_mtime_ns)
            except OSError:
                continue  # removed meanwhile, or a dangling link
    return newest


def load_stamp(folder: str, override: bool) -> int:
    """The stamp of a load of ``folder`` starting now (``override``: with a ``config`` parameter)."""
    newest = newest_mtime(folder)
    return max(newest, time.time_ns()) if override else newest


def written_since(folder: str, stamp: int | None) -> bool:
    """Whether something in ``folder`` was written after ``stamp`` (None: unknown, so yes)."""
    return stamp is None or newest_mtime(folder) > stamp
