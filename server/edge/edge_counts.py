"""What a frontend's network edge does, counted for the operator: its open connections and what
its limits refused or cut, by reason (an oversized head, a stalled body, an answer nobody reads, a
gRPC message that took too long...). Each refusal is also a log line, but those are kept to one a
minute per reason; the counts are exact.

The frontend reports them to the broker on its tick when they changed, and every
``RESEND_S`` regardless, so that a broker restarted after a crash has them again (``EdgeReport``,
shm/control_messages.py); the broker serves them on its metrics port
(server/broker/edge_reports.py). One control message a tick (0.5 s) at most, off the request path.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import time

from shmserve.shm.control_messages import EdgeReport

from .link import BrokerError, BrokerLink

log = logging.getLogger("shmserve.frontend")

RESEND_S = 10.0


class EdgeCounts:
    """One frontend process's counts (its event loop's), and their report to the broker."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol  # "http" or "grpc": the metrics' label
        self.connections = 0  # open now (HTTP: the protocol counts them; grpc does not tell)
        self.refusals: collections.Counter[str] = collections.Counter()
        self._reported: tuple = (0, ())  # what the broker was last told (nothing to tell at first)
        self._reported_at = 0.0
        self._sending: asyncio.Task | None = None

    def refused(self, reason: str) -> None:
        self.refusals[reason] += 1

    def report(self, link: BrokerLink) -> None:
        """On the frontend's tick: tell the broker what changed since it was last told. One
        report at a time; one that fails (the broker restarting) is sent again on a later tick."""
        if link.spill.ended:  # streams read too slowly, ended for the bound on what waits for them
            self.refusals["slow-reader"] = link.spill.ended
        now = (self.connections, tuple(sorted(self.refusals.items())))
        if self._sending is not None and not self._sending.done():
            return
        if now == self._reported and (now == (0, ()) or time.monotonic() - self._reported_at < RESEND_S):
            return
        self._sending = asyncio.get_running_loop().create_task(self._send(link, now))

    async def _send(self, link: BrokerLink, now: tuple) -> None:
        try:
            status, _ = await link.control(EdgeReport(self.protocol, now[0], dict(now[1])))
        except BrokerError:
            return  # (the broker is away: its restart's report carries the counts again)
        if status == 200:
            self._reported, self._reported_at = now, time.monotonic()
        else:
            log.debug("the broker refused this frontend's edge report (%d)", status)
