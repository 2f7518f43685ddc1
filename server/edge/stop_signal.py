"""How a frontend tells its launcher's stop from a signal sent to the whole server.

Ctrl-C in a terminal, ``kill -- -PGID`` and systemd's default ``KillMode=control-group`` signal
every process of the server at once. A frontend that stopped then would leave the requests that
arrive during the broker's drain in its accept queue, where they hang until the drain ends,
instead of answering them with a 503 and Retry-After. So while its launcher lives, a frontend
passes over SIGTERM and SIGINT (the launcher got them too, and drains), and the launcher stops
it with ``STOP`` once the broker is done.
"""
from __future__ import annotations

import os
import signal

STOP = signal.SIGUSR1  # the launcher's word to a frontend: stop now, finishing what it sends
FROM_OUTSIDE = (signal.SIGTERM, signal.SIGINT)


def launcher_stops_us(launcher: int) -> bool:
    """Whether ``launcher`` (our parent when we started) still lives to stop us with ``STOP``."""
    return os.getppid() == launcher
