"""Whether a model version is ready, as its ready endpoints (HTTP, gRPC ModelReady) report it.

Ready: at least one instance serves (not every one dead or restarting), and each serving instance
whose model defines ``is_ready()`` said yes at its last check (workers/readiness.py). A check asks
every such instance again without waiting for it: the broker's loop never waits on a model's code,
and the answer given is the last verdict. A check unanswered for READINESS_TIMEOUT_S (Triton's
five seconds) means not ready, as does one whose verdict is no.
"""
from __future__ import annotations

import time

from shmserve.shm.channel import R_ASKED, READY_YES
from shmserve.shm.protocol import W_CHECK_READY

from .models import Instance, ModelVersion

READINESS_TIMEOUT_S = 5.0


def version_ready(mv: ModelVersion) -> bool:
    if not mv.live():
        return False
    now = time.monotonic()
    verdicts = [instance_ready(inst, now) for inst in mv.instances if inst.ready]
    return all(verdicts)


def instance_ready(inst: Instance, now: float) -> bool:
    """The instance's last verdict; asks for a fresh one unless a check is still running."""
    has, asked, answered, verdict = inst.seg.readiness()
    if not has:
        return True
    if answered >= inst.readiness_asks:  # no check running: start one (one at a time, as Triton)
        asks = inst.readiness_asks + 1
        inst.seg.set_readiness_word(R_ASKED, asks)  # before the record: the worker reads it when woken
        if inst.seg.inbox.put(W_CHECK_READY, 0, 0, 0, 0):
            inst.readiness_asks = asks
            inst.readiness_asked_at = now
            inst.seg.waker.post()
        else:  # a full inbox: ask at the next check
            inst.seg.set_readiness_word(R_ASKED, inst.readiness_asks)
    elif now - inst.readiness_asked_at > READINESS_TIMEOUT_S:
        return False  # a check that hangs: not ready until it answers
    return verdict == READY_YES
