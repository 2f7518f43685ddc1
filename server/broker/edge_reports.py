"""The frontends' network edges, as their reports say (``EdgeReport``, server/edge/edge_counts.py):
served as ``shmserve_http_connections`` and ``shmserve_edge_refusals`` beside the other metrics.

Each frontend counts from its own start and reports its totals, kept by its process's liveness
ticket (one per process, kept until it exits: shm/liveness.py); a frontend that stops (or is
restarted after a crash) leaves its last totals here, so a refusal counter never goes down while
the broker runs, and one that reconnects (the broker disconnected it) replaces its own totals
rather than adding them again. The scrape runs on the metrics thread, hence the lock.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

from shmserve.shm.control_messages import EdgeReport

from .metrics import Family

PROTOCOLS = ("http", "grpc")
MAX_REASONS = 32  # more than the frontends have
MAX_REASON_CHARS = 40


def problem(report: EdgeReport) -> str | None:
    """What is wrong with a report, or None (it comes from the server's own user, but it is read
    from shared memory: a wrong one must not reach the metrics page)."""
    if report.protocol not in PROTOCOLS:
        return f"edge_report: 'protocol' must be one of {', '.join(PROTOCOLS)}"
    if len(report.refusals) > MAX_REASONS:
        return f"edge_report: more than {MAX_REASONS} reasons"
    for reason in report.refusals:
        if not (0 < len(reason) <= MAX_REASON_CHARS and reason.replace("-", "").isalnum() and reason.isascii()):
            return f"edge_report: a reason must be up to {MAX_REASON_CHARS} letters, digits and dashes"
    return None


class EdgeReports:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        # By the frontend's liveness ticket, departed ones too (their connections closed): a
        # process that reconnects keeps its ticket, and its totals count once.
        self._latest: dict[int, EdgeReport] = {}

    def take(self, ticket: int, report: EdgeReport) -> None:
        with self._lock:
            self._latest[ticket] = report

    def forget(self, ticket: int) -> None:
        """The frontend left (or died): its connections are closed, its refusals stay counted."""
        with self._lock:
            report = self._latest.get(ticket)
            if report is not None:
                self._latest[ticket] = dataclasses.replace(report, connections=0)

    def families(self) -> list[Family]:
        with self._lock:
            refusals: collections.Counter[tuple[str, str]] = collections.Counter()
            connections = 0
            for report in self._latest.values():
                connections += report.connections if report.protocol == "http" else 0
                for reason, count in report.refusals.items():
                    refusals[(report.protocol, reason)] += count
        return [
            ("shmserve_http_connections", "Connections open to the HTTP frontends", "gauge", [({}, connections)]),
            ("shmserve_edge_refusals", "Requests and connections the frontends' limits refused or cut, by reason "
             "(serving.md, The network edge)", "counter",
             [({"protocol": protocol, "reason": reason}, n) for (protocol, reason), n in sorted(refusals.items())]),
        ]
