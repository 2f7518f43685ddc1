"""Ensembles (``platform: "ensemble"``): a DAG of model steps run by the broker.

The broker is itself a client of the step models: it owns a client segment whose slots workers
complete, and it is woken through its own doorbell. A step is submitted as soon as every tensor
it maps in exists, so independent steps run in parallel on their own workers. Intermediate
tensors stay where the producing worker wrote them (its output arena) and the next step's worker
reads them there: they never pass through a frontend, and no byte is copied between steps. The
final outputs are copied once into the broker's answer (or into the client's regions).
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Step:
    index: int
    model: str
    version: str
    input_map: dict[str, str]  # model input -> ensemble tensor
    output_map: dict[str, str]  # model output -> ensemble tensor


class EnsemblePlan:
    def __init__(self, config: Any) -> None:
        self.name = config.name
        self.steps = [Step(i, s.model_name, str(s.model_version) if s.model_version > 0 else "",
                           dict(s.input_map), dict(s.output_map))
                      for i, s in enumerate(config.ensemble_scheduling.step)]
        self.inputs = [t.name for t in config.input]
        self.outputs = [t.name for t in config.output]

    def dependencies(self) -> list[str]:
        return sorted({s.model for s in self.steps})


def check_plan(config: Any) -> str | None:
    """Why an ensemble's steps cannot run (a tensor nobody produces, an output never made)."""
    steps = config.ensemble_scheduling.step
    if not steps:
        return "ensemble_scheduling must have at least one step"
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
    return None


class EnsembleRun:
    """One request through an ensemble."""

    def __init__(self, plan: EnsemblePlan, client: Any, slot: int, entry: dict) -> None:
        self.plan = plan
        self.client = client
        self.slot = slot
        self.entry = entry
        self.tensors: dict[str, dict] = {t["name"]: t for t in entry["inputs"]}
        self.started: set[int] = set()
        self.running = 0
        self.blocks: list[tuple[memoryview, int]] = []  # step responses to free when the run ends
        self.failed = False

    def ready_steps(self) -> list[Step]:
        out = []
        for step in self.plan.steps:
            if step.index not in self.started and set(step.input_map.values()) <= self.tensors.keys():
                out.append(step)
        return out

    def step_request(self, step: Step) -> dict:
        """The request a step's model gets: its inputs are ensemble tensors, wherever they live."""
        inputs = []
        for model_input, tensor in step.input_map.items():
            t = self.tensors[tensor]
            inputs.append({**t, "name": model_input})
        return {"id": self.entry.get("id", ""), "params": self.entry.get("params"),
                "corr": self.entry.get("corr", 0), "flags": self.entry.get("flags", 0), "inputs": inputs,
                "outputs": [{"name": n} for n in step.output_map]}

    def complete(self) -> bool:
        return all(name in self.tensors for name in self.wanted()) and not self.running

    def wanted(self) -> list[str]:
        outs = self.entry.get("outputs")
        return [o["name"] for o in outs] if outs else list(self.plan.outputs)
