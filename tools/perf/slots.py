"""A client process: callers to every target, kept across the sweep, and for each job of the
parent's (``pool.Pool``) the loops that put load on one target: closed loops, each one request
after the other, or threads that send on an open-loop schedule. Each request becomes a
``windows.Record``, handed to the parent in batches every ``FLUSH_S``."""
from __future__ import annotations

import os
import queue
import random
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from shmserve.tools import proc_cpu
from shmserve.tools.perf.http_caller import Seq
from shmserve.tools.perf.plan import Requests, Target
from shmserve.tools.perf.windows import Record

FLUSH_S = 0.05


@dataclass(frozen=True)
class Job:
    """One process's part of a level on one target: ``slots`` loops (closed loops, or threads of
    an open loop at ``rate`` requests per second in all); slots are numbered from ``first_slot``
    of ``total_slots`` over all processes (sequence ids stay apart)."""

    target: int
    slots: int
    rate: float
    distribution: str
    first_slot: int
    total_slots: int


def open_caller(target: Target, req: Requests, tag: str) -> Any:
    """The caller for ``target``'s protocol (the only place that picks one)."""
    if target.protocol == "http":
        from shmserve.tools.perf.http_caller import HttpCaller

        return HttpCaller(target, req, tag)
    if target.protocol == "grpc":
        from shmserve.tools.perf.grpc_caller import GrpcCaller

        return GrpcCaller(target, req, tag)
    from shmserve.tools.perf.local_caller import LocalCaller

    return LocalCaller(target, req, tag)


class Sequencer:
    """Which data entry a slot sends next and, for a sequence model, with which sequence id and
    flags: sequences of ``sequence_length`` (give or take the variation) over one data stream
    each, round robin over the streams."""

    def __init__(self, req: Requests, slot: int, total: int) -> None:
        self.req, self.slot, self.total = req, slot, total
        self.rng = random.Random(slot)
        self.offsets = [sum(len(s) for s in req.data[:i]) for i in range(len(req.data))]
        self.count = self.left = self.step = self.stream = 0
        self.entry = slot  # round robin without sequences, each slot from its own place

    @property
    def open(self) -> bool:
        return self.left > 0

    def next(self) -> tuple[int, Seq]:
        if not self.req.sequence:
            self.entry = (self.entry + 1) % len(self.req.entries())
            return self.entry, (0, False, False)
        start = not self.open
        if start:
            self.stream = (self.slot + self.count * self.total) % len(self.req.data)
            base = self.req.sequence_length or len(self.req.data[self.stream])
            spread = self.req.sequence_variation_pct / 100 if self.req.sequence_length else 0.0
            self.left = max(1, round(base * self.rng.uniform(1 - spread, 1 + spread)))
            self.step = 0
            self.count += 1
        steps = self.req.data[self.stream]
        entry = self.offsets[self.stream] + self.step % len(steps)
        self.step += 1
        self.left -= 1
        seq_id = self.req.sequence_id_start + (self.count - 1) * self.total + self.slot
        return entry, (seq_id, start, self.left == 0)

    def closing(self) -> tuple[int, Seq]:
        """The request that ends a sequence left open when the load stops."""
        self.left = 1
        return self.next()


class Schedule:
    """Open-loop send times for one process: ``rate`` per second, evenly spaced or Poisson."""

    def __init__(self, rate: float, distribution: str, seed: int) -> None:
        self.rate, self.poisson = rate, distribution == "poisson"
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.next_ns = time.monotonic_ns()

    def take(self) -> int:
        with self.lock:
            due = self.next_ns
            gap = self.rng.expovariate(self.rate) if self.poisson else 1.0 / self.rate
            self.next_ns += int(gap * 1e9)
            return due


def run_slot(caller: Any, seqs: Sequencer, schedule: Schedule | None, stop: threading.Event,
             out: list[Record]) -> None:
    """One loop until ``stop``: back to back, or at the schedule's times; then the request that
    ends an open sequence, so that none is left to time out on the server."""
    while not stop.is_set():
        due = None
        if schedule is not None:
            due = schedule.take()
            while (wait := due - time.monotonic_ns()) > 0:
                if stop.wait(wait / 1e9):
                    break
            if stop.is_set():
                break
        out.append(_send(caller, seqs.next(), due))
    if seqs.open:
        out.append(_send(caller, seqs.closing(), None))


def _send(caller: Any, what: tuple[int, Seq], due: int | None) -> Record:
    entry, seq = what
    start = time.monotonic_ns()
    try:
        responses, error = tuple(caller.call(entry, seq)), ""
    except Exception as exc:  # noqa: BLE001 - counted in the window, reported by the parent
        responses, error = (), f"{type(exc).__name__}: {exc}"
    return Record(start if due is None else due, start, time.monotonic_ns(), responses, error, seq[0])


class SlotThread:
    """A thread that owns one caller for the whole run and runs a slot's loop per job:
    tritonclient's HTTP client belongs to the thread that made it (gevent's hub is per thread)."""

    def __init__(self, target: Target, req: Requests, tag: str) -> None:
        self.work: queue.Queue = queue.Queue()
        self.done: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._main, args=(target, req, tag), daemon=True)
        self.thread.start()
        failure = self.done.get()
        if failure is not None:
            raise failure

    def _main(self, target: Target, req: Requests, tag: str) -> None:
        try:
            caller = open_caller(target, req, tag)
        except Exception as exc:  # noqa: BLE001 - raised in the constructor's thread
            self.done.put(exc)
            return
        self.done.put(None)
        try:
            while (work := self.work.get()) is not None:
                run_slot(caller, *work)
                self.done.put(None)
        finally:
            try:
                caller.close()
            except Exception:  # noqa: BLE001 - the server may be gone; the process ends anyway
                pass
            self.done.put(None)

    def close(self) -> None:
        self.work.put(None)
        self.thread.join(30)


def client_main(index: int, targets: list[Target], req: Requests, run_id: str, commands: Any, results: Any) -> None:
    """The process's life: a job at a time until the parent sends None (or is gone)."""
    # Ctrl-C or `timeout -s INT` reach the whole process group: the parent, interrupted, stops the
    # job here as at a window's end; a client that died of it would leave the parent waiting for it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    slots: dict[tuple[int, int], SlotThread] = {}
    parent = os.getppid()
    try:
        while True:
            try:
                job = commands.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent:
                    return
                continue
            if job is None:
                return
            for s in range(job.slots):
                if (job.target, s) not in slots:
                    slots[job.target, s] = SlotThread(targets[job.target], req, f"{run_id}_{index}_{s}_{job.target}")
            results.put(("ready", index))
            if _run_job(index, job, [slots[job.target, s] for s in range(job.slots)], req, (commands, results)):
                return
    except Exception as exc:  # noqa: BLE001 - the parent stops the run with this message
        results.put(("error", index, f"{type(exc).__name__}: {exc}"))
    finally:
        for slot in slots.values():
            slot.close()


def _run_job(index: int, job: Job, slots: list[SlotThread], req: Requests, pipes: tuple[Any, Any]) -> bool:
    """Run the loops until the parent says "stop" (or None: the run ends, and so does the
    process); then the process's CPU time and waits for a core over the job, and its count of
    requests. True when the process is to end."""
    commands, results = pipes
    stop, out = threading.Event(), []
    share = job.rate / job.total_slots * job.slots if job.rate else 0.0
    schedule = Schedule(share, job.distribution, index) if job.rate else None
    usage0, cpu0 = proc_cpu.usage([os.getpid()]), time.process_time()
    for s, slot in enumerate(slots):
        slot.work.put((Sequencer(req, job.first_slot + s, job.total_slots), schedule, stop, out))
    sent, parent = 0, os.getppid()
    while True:
        try:
            command = commands.get(timeout=FLUSH_S)
        except queue.Empty:
            command = None if os.getppid() != parent else ""  # a parent gone (killed) ends the run
        sent += _flush(index, out, results)
        if command in ("stop", None):
            break
    stop.set()
    for slot in slots:
        slot.done.get(timeout=req.timeout_s + 10)
    sent += _flush(index, out, results)
    waited = proc_cpu.usage([os.getpid()]).waited_us - usage0.waited_us
    results.put(("stopped", index, (time.process_time() - cpu0) * 1e6, waited, sent))
    return command is None


def _flush(index: int, out: list[Record], results: Any) -> int:
    batch = out[:]
    del out[:len(batch)]
    if batch:
        results.put(("records", index, batch))
    return len(batch)
