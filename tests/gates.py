"""Gates: a test holds a model's execution until it has arranged what must happen meanwhile.

Test models that take the request parameter ``gate`` (a folder) mark the start of each execution
there with a file ``started-<pid>-<ns>`` and then wait until the file ``open`` appears. The test
waits for the marks, does its part (queues more requests, kills a process, unregisters a region)
and opens the gate. What the test checks then follows from the order of events, not from how
fast the host runs the test's threads or the server's processes. A gate opened before the
requests are sent only marks their starts (which process ran them, and how many ran at once).

A test that fails before it opens a gate must not leave a worker blocked: the models stop
waiting after their own GATE_LIMIT_S, well past any deadline here (slow_reader then fails the
request; crasher has none: its execution timeout ends the wait).
"""
from __future__ import annotations

import time
from pathlib import Path

import gevent

START_TIMEOUT_S = 60.0


def pause(seconds: float) -> None:
    """Sleep while a test waits for something a request it sent must cause. ``tritonclient.http``
    sends an ``async_infer`` from a gevent greenlet and gives it only 10 ms (``gevent.sleep(0.01)``)
    before returning; on a loaded host the greenlet may not have written its request by then, and a
    plain ``time.sleep`` never lets it run again: the request stays unsent for as long as the test
    waits. ``gevent.sleep`` runs the greenlets that are ready meanwhile (and is a plain sleep when
    there are none)."""
    gevent.sleep(seconds)


class Gate:
    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder

    @property
    def param(self) -> str:
        """The value of the request parameter ``gate``."""
        return str(self.folder)

    def started(self) -> list[int]:
        """The pids of the processes that started an execution, one entry per execution, in order."""
        marks = [p.name.split("-") for p in self.folder.glob("started-*")]
        return [int(pid) for _, pid, _ in sorted(marks, key=lambda m: int(m[2]))]

    def wait_started(self, count: int = 1, timeout: float = START_TIMEOUT_S) -> list[int]:
        """Wait until ``count`` executions have started; their pids."""
        deadline = time.monotonic() + timeout
        while len(found := self.started()) < count:
            assert time.monotonic() < deadline, f"{len(found)} of {count} executions started within {timeout} s"
            pause(0.01)
        return found

    def open(self) -> None:
        (self.folder / "open").touch()
