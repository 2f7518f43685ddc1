"""A model's own readiness check (a Python model's ``is_ready()``, as Triton's Python backend
allows), run on a thread of its own so that it never delays an execution.

The broker asks (W_CHECK_READY on the inbox, when a client asks whether the model is ready); the
worker's loop only wakes this thread, which calls the check once for every ask that came while it
was busy and writes the verdict into the worker's header (``WorkerSegment.readiness``). As in
Triton: ``False``, an exception or an answer that is not a bool means not ready, one check runs at
a time, and one that takes longer than READINESS_TIMEOUT_S counts as not ready (the broker judges
that, server/broker/readiness.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from shmserve.shm.channel import R_ANSWERED, R_ASKED, R_HAS, R_VERDICT, READY_NO, READY_YES, WorkerSegment

log = logging.getLogger("shmserve.worker")


class ReadinessCheck:
    def __init__(self, seg: WorkerSegment, check: Callable[[], bool], name: str) -> None:
        self.seg = seg
        self.check = check
        self.name = name
        self.asked = threading.Event()
        self.last_problem = ""
        seg.set_readiness_word(R_HAS, 1)
        self.asked.set()  # a first verdict right after the load
        threading.Thread(target=self._run, name="is_ready", daemon=True).start()

    def ask(self) -> None:
        self.asked.set()

    def _run(self) -> None:
        while True:
            self.asked.wait()
            self.asked.clear()
            asks = self.seg.readiness()[R_ASKED]
            ready, problem = self._call()
            if problem != self.last_problem and problem:
                log.warning("instance '%s' is not ready: %s", self.name, problem)
            self.last_problem = problem
            self.seg.set_readiness_word(R_VERDICT, READY_YES if ready else READY_NO)
            self.seg.set_readiness_word(R_ANSWERED, asks)  # after the verdict: the broker reads in that order

    def _call(self) -> tuple[bool, str]:
        try:
            answer = self.check()
        except Exception as e:  # noqa: BLE001 - the model's code: its failure is a "not ready"
            return False, f"is_ready() raised {e!r}"
        if not isinstance(answer, bool):
            return False, f"is_ready() must return a boolean value, not {type(answer).__name__}"
        return answer, "" if answer else "is_ready() returned False"
