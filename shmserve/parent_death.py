"""A child that must not outlive its parent asks the kernel for a signal when the parent dies
(Linux's ``PR_SET_PDEATHSIG``): no process of a server is left serving, or holding its ports and
shared memory, once the process that supervised it is gone, and none has to poll for that."""
from __future__ import annotations

import os
import signal

PR_SET_PDEATHSIG = 1
# What a broker gets when its launcher dies: not SIGTERM, which asks for a drain that no frontend is
# left to see, but a signal whose handler stops at once and removes every object of the server.
ORPHANED = signal.SIGHUP


def die_with_parent(signum: int, parent: int) -> None:
    """Have ``signum`` sent to this process when ``parent`` dies; exit now if it already has
    (it died before the request, so the signal would never come). Safe between fork and exec:
    the setting survives ``exec``."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signum))
    except (OSError, AttributeError):  # not Linux: nothing to ask for
        return
    if os.getppid() != parent:
        os._exit(1)
