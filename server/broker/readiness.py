"""Whether a model version is ready, as its ready endpoints (HTTP, gRPC ModelReady) report it.

Ready: at least one instance serves (not every one dead or restarting), and each serving instance
whose model defines ``is_ready()`` said yes at its last check (workers/readiness.py). A check asks
every such instance again without waiting for it: the broker's loop never waits on a model's code,
and the answer given is the last verdict. A check unanswered for READINESS_TIMEOUT_S (Triton's
five seconds) means not ready, as does one whose verdict is no.

An ensemble has no instances: it is ready while every step's version is (nested ensembles
followed down, each once: the loader refuses cycles, and the walk would end on one anyway). A
step unloaded, failed or with no live instance makes it not ready; the index names the step.
Triton gets there by unloading an ensemble whose step went (its index then says UNAVAILABLE);
here the ensemble stays loaded and is ready again as soon as its steps are.
"""
from __future__ import annotations

import time
from typing import Callable

from shmserve.shm.channel import R_ASKED, READY_YES
from shmserve.shm.protocol import W_CHECK_READY

from shmserve.signature import InvalidRequest

from .catalog import Catalog
from .models import Instance, ModelVersion

READINESS_TIMEOUT_S = 5.0


def version_ready(mv: ModelVersion, catalog: Catalog) -> bool:
    """What the model's ready endpoints say: it serves, its models' ``is_ready()`` said yes, and
    for an ensemble, the same of every step."""
    if mv.ensemble is not None:
        return blocked_step(mv, catalog, instances_ready) is None
    return instances_ready(mv)


def instances_ready(mv: ModelVersion) -> bool:
    if not mv.live():
        return False
    now = time.monotonic()
    verdicts = [instance_ready(inst, now) for inst in mv.instances if inst.ready]
    return all(verdicts)


def blocked_step(mv: ModelVersion, catalog: Catalog,
                 serves: Callable[[ModelVersion], bool] = ModelVersion.live) -> str | None:
    """Why the ensemble ``mv`` cannot serve now (None: every step, nested ones included, has a
    version that ``serves``), in the words of Triton's ensemble checks where it has them."""
    seen = {(mv.name, mv.version)}
    todo = [mv]
    while todo:
        ensemble = todo.pop()
        for step in ensemble.ensemble.steps:
            try:
                step_mv = catalog.find_version(step.model, step.version)
            except InvalidRequest:
                if step.version:
                    return (f"ensemble '{ensemble.name}' depends on '{step.model}' whose required version "
                            f"{step.version} is not loaded")
                return f"ensemble '{ensemble.name}' depends on '{step.model}' which has no loaded version"
            if step_mv.ensemble is None:
                if not serves(step_mv):
                    return f"ensemble '{ensemble.name}' depends on '{step.model}' which is not ready"
            elif (step_mv.name, step_mv.version) not in seen:
                seen.add((step_mv.name, step_mv.version))
                todo.append(step_mv)
    return None


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
