"""Triton's load-time check of an ensemble's steps: no batching step allows smaller batches than
the ensemble (a non-batching one may sit in a batching ensemble), every step input and output it
maps exists, every required input is mapped, and an ensemble tensor has one data type and one
shape wherever it is used. Shapes agree when their dims match (-1 matching anything), or when
their full shapes do (a batching model's [-1, 16] and a non-batching one's [-1, 16] dims), as
the scheduler converts between batching and non-batching steps at run time (ensemble_shapes.py).
Refused with Triton's texts.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

from shmserve.signature import dims_text

from .ensemble_shapes import dims_match


@dataclasses.dataclass
class TensorUse:
    """An ensemble tensor as one model declares it."""

    model: str
    data_type: str
    dims: list[int]
    full_dims: list[int]  # with the batch dimension (-1) first for a batching model


def _use(model: str, batching: bool, data_type: str, dims: list[int]) -> TensorUse:
    return TensorUse(model, data_type, dims, [-1, *dims] if batching else list(dims))


def _inconsistency(known: TensorUse, new: TensorUse) -> str | None:
    if known.data_type != new.data_type:
        return (f"inconsistent data type: {known.data_type} is inferred from model {known.model} while "
                f"{new.data_type} is inferred from model {new.model}")
    if not dims_match(known.dims, new.dims) and not dims_match(known.full_dims, new.full_dims):
        return (f"inconsistent shape: {dims_text(known.full_dims)} is inferred from model {known.model} while "
                f"{dims_text(new.full_dims)} is inferred from model {new.model}")
    return None


def steps_refusal(config: Any, steps: dict[str, Any]) -> str | None:
    """Why the ensemble ``config`` cannot run its steps as mapped, step by step in Triton's order:
    a batching step allowing smaller batches than the ensemble (a non-batching step is allowed),
    then the step's inputs and outputs. ``steps`` maps step model names to their configs (a step
    without one is not judged here, nor the tensors of one whose config declares none yet
    because its backend completes it)."""
    name = config.name
    type_name = mc.DataType.Name
    batching = config.max_batch_size > 0
    tensors: dict[str, TensorUse] = {}
    for t in [*config.input, *config.output]:
        dims = list(t.reshape.shape) if t.HasField("reshape") else list(t.dims)
        tensors.setdefault(t.name, _use(name, batching, type_name(t.data_type), dims))

    def clash(tensor: str, use: TensorUse) -> str | None:
        known = tensors.setdefault(tensor, use)
        why = _inconsistency(known, use) if known is not use else None
        return f"in ensemble {name}, ensemble tensor {tensor}: {why}" if why else None

    for step in config.ensemble_scheduling.step:
        model = step.model_name
        dep = steps.get(model)
        if dep is None:
            continue
        if dep.max_batch_size != 0 and dep.max_batch_size < config.max_batch_size:
            return (f"ensemble {name} allows maximum batch size {config.max_batch_size}, but it contains model "
                    f"{model} which only allows maximum batch size to be {dep.max_batch_size}")
        if not (dep.input or dep.output):
            continue
        dep_batching = dep.max_batch_size > 0
        inputs = {i.name: i for i in dep.input}
        for key, tensor in step.input_map.items():
            if key not in inputs:
                return (f"in ensemble {name}, ensemble tensor {tensor} is mapping to non-existing input {key} "
                        f"in model {model}")
        for i in dep.input:
            if i.name not in step.input_map:
                if i.optional:
                    continue
                return f"in ensemble {name}, input {i.name} in model {model} is not mapped to any ensemble tensors"
            why = clash(step.input_map[i.name], _use(model, dep_batching, type_name(i.data_type), list(i.dims)))
            if why:
                return why
        outputs = {o.name: o for o in dep.output}
        for key, tensor in step.output_map.items():
            if key not in outputs:
                return (f"in ensemble {name}, ensemble tensor {tensor} is mapped from non-existing output {key} "
                        f"in model {model}")
            o = outputs[key]
            why = clash(tensor, _use(model, dep_batching, type_name(o.data_type), list(o.dims)))
            if why:
                return why
    return None


@dataclasses.dataclass(eq=False)
class FlowNode:
    """An ensemble tensor in Triton's walk of the data flow (or the ensemble's outputs together,
    its sink): which decoupled step's responses it descends from (``label``, 0: none)."""

    model: str  # the model it was first seen with: the name Triton's refusal gives
    decoupled: bool = False  # made by a decoupled step
    label: int = 0
    visited: bool = False
    prev: list["FlowNode"] = dataclasses.field(default_factory=list)
    next: list["FlowNode"] = dataclasses.field(default_factory=list)
    sibling: "FlowNode | None" = None  # shared by the outputs of one step: they descend alike


def step_decoupled(config: Any, configs: dict[str, Any], seen: frozenset[str] = frozenset()) -> bool:
    """Whether a step model answers as a decoupled one: its policy, or for a nested ensemble
    whether its own steps make it decoupled (as Triton fills its config in)."""
    if config.platform != "ensemble":
        return bool(config.model_transaction_policy.decoupled)
    if config.name in seen:
        return False  # a loop: refused at load by find_cycle
    return decoupled_flow(config, configs, seen | {config.name})[0]


def decoupled_flow(config: Any, configs: dict[str, Any], seen: frozenset[str] = frozenset()) -> tuple[bool, str | None]:
    """Triton's walk of an ensemble's data flow (``ValidateEnsembleConfig``): the ensemble is
    decoupled when a decoupled step's responses reach any tensor, and a step (or the ensemble's
    outputs) may not take tensors that descend from different decoupled steps. ``configs`` maps
    step model names to their configs. Returns (decoupled, the refusal or None)."""
    name = config.name
    nodes: dict[str, FlowNode] = {}

    def node(tensor: str, model: str) -> FlowNode:
        return nodes.setdefault(tensor, FlowNode(model))

    for t in config.input:
        node(t.name, name)
    sink = FlowNode(name)
    for t in config.output:
        out = node(t.name, name)
        sink.prev.append(out)
        out.next.append(sink)
    for step in config.ensemble_scheduling.step:
        dep = configs.get(step.model_name)
        if dep is None:
            continue
        inputs = [node(step.input_map[i.name], step.model_name) for i in dep.input if i.name in step.input_map]
        decoupled = step_decoupled(dep, configs, seen)
        sibling = FlowNode(step.model_name)
        for tensor in step.output_map.values():
            out = node(tensor, step.model_name)
            out.decoupled, out.sibling = decoupled, sibling
            for prev in inputs:
                out.prev.append(prev)
                prev.next.append(out)
    label = 0
    todo = collections.deque(nodes[t.name] for t in config.input)
    for n in todo:
        n.visited = True
    while todo:
        current = todo[0]
        for n in current.next:
            if n.visited or not all(p.visited for p in n.prev):
                continue
            first = n.prev[0].label
            if any(p.label != first for p in n.prev):
                return label != 0, (f"in ensemble {name}, step of model '{n.model}' receives inputs originated "
                                    f"from different decoupled models")
            if n.sibling is not None and n.sibling.visited:
                n.label = n.sibling.label
            else:
                if n.decoupled:
                    label += 1
                n.label = label if n.decoupled else first
                if n.sibling is not None:
                    n.sibling.label, n.sibling.visited = n.label, True
            n.visited = True
            todo.append(n)
        todo.popleft()
    return label != 0, None
