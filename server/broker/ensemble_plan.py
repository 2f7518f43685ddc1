"""An ensemble's plan: the DAG its config describes, checked at load, and what its runs share
(the limit on each step's calls in flight, ``ensemble_scheduling.max_inflight_requests``)."""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from shmserve.shm.answer import DECOUPLED_REFUSAL
from shmserve.signature import InvalidRequest


NEEDLESS_KEPT = 64  # sets of wanted outputs whose needless steps are kept (see EnsemblePlan.needless)


class DecoupledOnly(InvalidRequest):
    """A single-answer request to a decoupled ensemble: Triton's UNSUPPORTED (501), in the words
    its HTTP frontend uses (the gRPC frontend says it in its own, server/grpc/infer.py)."""

    status = 501

    def __init__(self) -> None:
        super().__init__(DECOUPLED_REFUSAL)


@dataclasses.dataclass
class Step:
    index: int
    model: str
    version: str
    input_map: dict[str, str]  # model input -> ensemble tensor
    output_map: dict[str, str]  # model output -> ensemble tensor


class EnsemblePlan:
    def __init__(self, config: Any, labels: dict[str, list[str]] | None = None) -> None:
        self.name = config.name
        self.batching = config.max_batch_size > 0
        self.labels = labels or {}  # output -> its label_filename's lines, for classification
        self.steps = [Step(i, s.model_name, str(s.model_version) if s.model_version > 0 else "",
                           dict(s.input_map), dict(s.output_map))
                      for i, s in enumerate(config.ensemble_scheduling.step)]
        self.inputs = [t.name for t in config.input]
        # A request may leave these out: Triton then runs the steps that read them without them.
        self.optional_inputs = [t.name for t in config.input if t.optional]
        self.outputs = [t.name for t in config.output]
        # Filled in at load (load_plan.py) as Triton does: a decoupled step's responses reach it.
        self.decoupled = bool(config.model_transaction_policy.decoupled)
        # Triton's limit on each step's calls in flight, shared by every request to this
        # ensemble (0: none); a call past it waits, in order, for one to end.
        self.limit = int(config.ensemble_scheduling.max_inflight_requests)
        self.inflight = [0] * len(self.steps)
        self.waiting: list[collections.deque[Any]] = [collections.deque() for _ in self.steps]  # StepCalls
        self._needless: dict[frozenset[str], frozenset[int]] = {}  # wanted outputs -> the steps not run for them

    def needless(self, wanted: list[str]) -> frozenset[int]:
        """The steps a request wanting only ``wanted`` outputs need not run: those whose outputs
        reach none of them through any later step. Triton prunes them too (so their cost and
        their errors stay out of such a request), but its 2.51 count also prunes a step whose
        output is both an ensemble output and a later step's input; here only a step that feeds
        nothing wanted is left out."""
        key = frozenset(wanted)
        known = self._needless.get(key)
        if known is not None:
            return known
        needed_tensors, needed = set(key), set()
        grew = True
        while grew:
            grew = False
            for step in self.steps:
                if step.index not in needed and not needed_tensors.isdisjoint(step.output_map.values()):
                    needed.add(step.index)
                    needed_tensors.update(step.input_map.values())
                    grew = True
        if len(self._needless) >= NEEDLESS_KEPT:
            self._needless.clear()
        known = self._needless[key] = frozenset(s.index for s in self.steps if s.index not in needed)
        return known

    def dependencies(self) -> list[str]:
        return sorted({s.model for s in self.steps})


def step_models(config: Any) -> list[str]:
    """The models an ensemble's config names as steps."""
    return sorted({s.model_name for s in config.ensemble_scheduling.step})


def find_cycle(start: str, graph: dict[str, list[str]]) -> str | None:
    """Triton's refusal of ensembles that reach themselves through their steps (a run of one
    would start runs of itself without end). ``graph`` maps each ensemble reachable from
    ``start`` to its step models; the answer names the ensemble whose step closes the loop."""
    reached, todo = {start}, [start]
    while todo:
        name = todo.pop()
        for model in graph.get(name, ()):
            if model == start:
                return f"circular dependency between ensembles: {start} -> ... -> {name} -> {start}"
            if model in graph and model not in reached:
                reached.add(model)
                todo.append(model)
    return None


def check_plan(config: Any) -> str | None:
    """Why an ensemble's steps cannot run (a tensor nobody produces, an output never made), or
    why Triton refuses its data flow (a tensor two steps write, whose value would depend on which
    finished last; an ensemble input or a step's output that nothing reads), in Triton's words."""
    steps = config.ensemble_scheduling.step
    if not steps:
        return "ensemble_scheduling must have at least one step"
    written: set[str] = set()
    for index, s in enumerate(steps):
        for tensor in s.output_map.values():
            if tensor in written:
                return (f"ensemble tensor '{tensor}' can appear in an output map only once for ensemble "
                        f"'{config.name}' step {index}")
            written.add(tensor)
    available = {t.name for t in config.input}
    remaining = list(steps)
    while remaining:
        runnable = [s for s in remaining if set(s.input_map.values()) <= available]
        if not runnable:
            missing = sorted(set(remaining[0].input_map.values()) - available)
            return (f"step '{remaining[0].model_name}' needs tensor(s) {missing} that no ensemble input or "
                    f"earlier step provides")
        for s in runnable:
            if not s.model_name:
                return "every step must name a model_name"
            available |= set(s.output_map.values())
            remaining.remove(s)
    unmade = [t.name for t in config.output if t.name not in available]
    if unmade:
        return f"ensemble output(s) {unmade} are not produced by any step"
    read = {tensor for s in steps for tensor in s.input_map.values()}
    for t in config.input:
        if t.name not in read | written:
            return f"ensemble input '{t.name}' for ensemble {config.name}' is not used"  # (Triton's quotes)
    outputs = {t.name for t in config.output}
    for tensor in sorted(written - outputs - read):
        return f"ensemble tensor '{tensor}' is unused in ensemble '{config.name}'"
    return None


