"""Opt-in profiling of a server process: ``SHMSERVE_PROFILE=<dir>`` writes a cProfile dump per
process at exit (load it with ``python -m pstats``). For finding hot spots, not for production.
"""
from __future__ import annotations

import os
from typing import Callable


def run_profiled(name: str, fn: Callable[[], int]) -> int:
    target = os.environ.get("SHMSERVE_PROFILE")
    if not target:
        return fn()
    import cProfile

    os.makedirs(target, exist_ok=True)
    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        prof.dump_stats(os.path.join(target, f"{name}-{os.getpid()}.prof"))
