"""The client processes, seen from the parent: started once for the whole sweep (spawned, so that
each measures with its own interpreter and no GIL is shared), given a job per level and target,
and read for their records. Stopped with the run, even when it fails or is killed."""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from shmserve.tools.perf.plan import Load, Requests, Target
from shmserve.tools.perf.shm_regions import remove_leftovers
from shmserve.tools.perf.slots import Job, client_main
from shmserve.tools.perf.windows import Record

SETUP_TIMEOUT_S = 120.0  # a spawned interpreter, its imports and its connections, on a loaded host


@dataclass(frozen=True)
class ClientUsage:
    """What one client process spent on a job: CPU and waits for a core (µs), requests done."""

    cpu_us: float
    waited_us: float
    requests: int


def process_count(load: Load, wanted: int) -> int:
    """How many client processes: ``wanted``, or by default one per concurrent request (at most
    16) for closed loops, and one per core (at most the threads) for an open loop."""
    if wanted > 0:
        return wanted
    if load.mode == "concurrency":
        return int(min(max(load.levels), 16))
    return max(1, min(load.threads, os.cpu_count() or 1))


def jobs(load: Load, level: float, target: int, processes: int) -> list[Job]:
    """The level spread over the processes: closed loops (concurrency ``level``) or the open
    loop's threads with the rate shared in proportion."""
    slots = int(level) if load.mode == "concurrency" else load.threads
    rate = 0.0 if load.mode == "concurrency" else float(level)
    used = min(slots, processes)
    out, first = [], 0
    for i in range(used):
        n = slots // used + (1 if i < slots % used else 0)
        out.append(Job(target, n, rate, load.distribution, first, slots))
        first += n
    return out


class Pool:
    """``processes`` client processes holding callers to every target. A thread of the parent
    reads what they send as it comes (a pipe left unread would hold their records back)."""

    def __init__(self, targets: list[Target], req: Requests, processes: int) -> None:
        ctx = mp.get_context("spawn")
        self.run_id = uuid.uuid4().hex[:8]
        self.results: Any = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(processes)]
        self.active: list[int] = []
        self.procs = [ctx.Process(target=client_main, daemon=True,
                                  args=(i, targets, req, self.run_id, self.commands[i], self.results))
                      for i in range(processes)]
        for p in self.procs:
            p.start()
        self.lock = threading.Lock()
        self.inbox: list[Record] = []
        self.events: queue.Queue = queue.Queue()  # ("ready" | "stopped" | "error", process, ...)
        self.failure: str | None = None
        self.usage: dict[int, ClientUsage] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            message = self.results.get()
            if message[0] == "closed":
                return
            if message[0] == "records":
                with self.lock:
                    self.inbox.extend(Record(*r) for r in message[2])
                continue
            if message[0] == "error":
                self.failure = message[2]
            elif message[0] == "stopped":
                self.usage[message[1]] = ClientUsage(*message[2:])
            self.events.put(message)

    def start(self, work: list[Job]) -> None:
        """Hand out a job each, and wait until every process given one is sending."""
        self.active = list(range(len(work)))
        for i, job in enumerate(work):
            self.commands[i].put(job)
        self._wait_for("ready", set(self.active), SETUP_TIMEOUT_S)

    def collect(self) -> list[Record]:
        """The records that arrived since the last call."""
        if self.failure is not None:
            raise RuntimeError(f"a client failed: {self.failure}")
        with self.lock:
            got, self.inbox = self.inbox, []
        return got

    def stop(self, timeout_s: float) -> list[ClientUsage]:
        """Stop the job everywhere; every process's usage once its last requests are in."""
        for i in self.active:
            self.commands[i].put("stop")
        self.usage = {}
        self._wait_for("stopped", set(self.active), timeout_s + 30)
        return [self.usage[i] for i in self.active]

    def _wait_for(self, kind: str, pending: set[int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"client process(es) {sorted(pending)} stopped answering (did they die?)")
            try:
                message = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                if not all(p.is_alive() for p in self.procs):
                    time.sleep(1.0)  # its last words (an error) come before its exit
                    if self.failure is None:
                        raise RuntimeError("a client process died") from None
                message = ("",)
            if self.failure is not None:
                raise RuntimeError(f"a client failed: {self.failure}")
            if message[0] == kind:
                pending.discard(message[1])

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        self.results.put(("closed",))
        self.reader.join(10)
        remove_leftovers(self.run_id)
