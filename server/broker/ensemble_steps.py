"""Triton's load-time check of an ensemble's steps: no batching step allows smaller batches than
the ensemble (a non-batching one may sit in a batching ensemble), every step input and output it
maps exists, every required input is mapped, and an ensemble tensor has one data type and one
shape wherever it is used. Shapes agree when their dims match (-1 matching anything), or when
their full shapes do (a batching model's [-1, 16] and a non-batching one's [-1, 16] dims), as
the scheduler converts between batching and non-batching steps at run time (ensemble_shapes.py).
Refused with Triton's texts.
"""
from __future__ import annotations

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
