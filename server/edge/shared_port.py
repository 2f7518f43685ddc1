"""A port shared with other servers (Triton's ``--reuse-http-port``, ``--reuse-grpc-port``) is
listened on only once this server's initial loads are over.

``SO_REUSEPORT`` spreads new connections over every socket that listens on the port. A server
that listened while its models loaded would take its share of them and answer "not ready" or
"unknown model" where the server it replaces or helps would have served them: the rolling restart
the flag is for would fail requests. A socket that is bound but does not listen gets no
connection, so the launcher only binds a shared port, and a frontend listens (uvicorn's
``startup``, grpcio's ``add_insecure_port``) after ``wait_for_initial_loads``. Triton, too, starts
its endpoints after its initial loads.
"""
from __future__ import annotations

import asyncio
from typing import Callable

from shmserve.shm import control_messages as control

from .link import BrokerError, BrokerLink

POLL_S = 0.1  # how often the broker is asked while it loads
ASK_TIMEOUT_S = 3.0  # a broker that does not answer is asked again


async def initial_loads_over(link: BrokerLink) -> bool:
    """The broker's word that its initial loads are over (whatever their outcome: a model that
    failed is readiness's matter, as in Triton with ``--exit-on-error=false``)."""
    try:
        _, answer = await asyncio.wait_for(link.control(control.ServerReady()), ASK_TIMEOUT_S)
    except (BrokerError, asyncio.TimeoutError):
        return False  # the broker not up yet, or restarting
    return bool(answer.get("started"))


async def wait_for_initial_loads(link: BrokerLink, stopping: Callable[[], bool]) -> bool:
    """Until the initial loads are over (True), or ``stopping`` says the process is asked to stop
    (False: it never listened). The launcher says once that the server waits."""
    while not stopping():
        if await initial_loads_over(link):
            return True
        await asyncio.sleep(POLL_S)
    return False
