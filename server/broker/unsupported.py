"""The ``config.pbtxt`` fields shmserve does not implement, and what a load does when it meets one.

A Triton user brings Triton's configs: a field that is silently ignored looks like it works. So
each unimplemented field here is either WARNED about by name at load (the model still serves the
same answers, only without the feature) or REFUSED (the model would receive or return something
else than under Triton: the load fails, UNAVAILABLE, with the field named). The table is data;
docs/compatibility.md shows the same table to users. Paths are dotted field names of Triton's
``ModelConfig``; a path through a repeated field (``input``, ``instance_group``) matches when any
element sets it.
"""
from __future__ import annotations

from typing import Any, Iterator

from google.protobuf.descriptor import FieldDescriptor

WARN = "warn"
REFUSE = "refuse"

# field path -> (action, what happens instead)
FIELDS: dict[str, tuple[str, str]] = {
    "runtime": (WARN, "the backend named by 'backend' runs the model"),
    "cc_model_filenames": (WARN, "the default model file is loaded whatever the GPU"),
    "metric_tags": (WARN, "metrics carry only the model and version labels"),
    "model_operations": (WARN, "no custom operation library is loaded"),
    "model_repository_agents": (WARN, "no repository agent runs on the model's files"),
    "input.is_shape_tensor": (REFUSE, "a shape tensor would be batched as a data tensor"),
    "output.is_shape_tensor": (REFUSE, "a shape tensor would be batched as a data tensor"),
    "input.is_non_linear_format_io": (WARN, "TensorRT-only; tensors are passed as they come"),
    "output.is_non_linear_format_io": (WARN, "TensorRT-only; tensors are passed as they come"),
    "optimization.graph": (WARN, "no graph optimisation level is set"),
    "optimization.priority": (WARN, "instances run at the default priority"),
    "optimization.cuda": (WARN, "no CUDA graphs or CUDA options are applied"),
    "optimization.execution_accelerators": (WARN, "no execution accelerator (TensorRT, OpenVINO) is used"),
    "optimization.input_pinned_memory": (WARN, "inputs are not staged in pinned memory"),
    "optimization.output_pinned_memory": (WARN, "outputs are not staged in pinned memory"),
    "optimization.gather_kernel_buffer_threshold": (WARN, "no gather kernel is used"),
    "optimization.eager_batching": (WARN, "batches form as the dynamic batcher decides"),
    "instance_group.host_policy": (WARN, "no host policy (NUMA placement) is applied"),
    "instance_group.passive": (WARN, "the instances receive requests like any other"),
    "instance_group.secondary_devices": (WARN, "no secondary device is given to the instance"),
    "instance_group.profile": (WARN, "no TensorRT optimisation profile is selected"),
    "sequence_batching.iterative_sequence": (WARN, "requests of a sequence are not rescheduled iteratively"),
    "sequence_batching.direct.max_queue_delay_microseconds": (WARN, "sequence batches form without delay"),
    "sequence_batching.direct.minimum_slot_utilization": (WARN, "sequence batches form without delay"),
    "sequence_batching.state.use_same_buffer_for_input_output": (WARN, "state tensors are copied"),
    "sequence_batching.state.use_growable_memory": (WARN, "state tensors are copied"),
}
# Fields of the table above that a backend implements itself: not warned about for its models.
HONOURED: dict[str, set[str]] = {
    "onnxruntime": {"optimization.graph", "optimization.execution_accelerators"},
}


def _set_fields(message: Any) -> dict[str, tuple[FieldDescriptor, Any]]:
    """The fields ``message`` sets (non-default scalars, present messages, non-empty lists)."""
    return {f.name: (f, v) for f, v in message.ListFields()}


def _repeated(field: FieldDescriptor) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 6; older ones have only label
    return bool(is_repeated) if is_repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _present(message: Any, path: list[str]) -> bool:
    found = _set_fields(message).get(path[0])
    if found is None:
        return False
    if len(path) == 1:
        return True
    field, value = found
    if field.type != FieldDescriptor.TYPE_MESSAGE:
        return False
    items = value if _repeated(field) else [value]
    return any(_present(item, path[1:]) for item in items)


def findings(config: Any) -> Iterator[tuple[str, str, str]]:
    """(field path, action, what happens instead) for every unimplemented field ``config`` sets
    (those its backend implements left out)."""
    honoured = HONOURED.get(config.backend, set())
    for path, (action, instead) in FIELDS.items():
        if path not in honoured and _present(config, path.split(".")):
            yield path, action, instead


def refusal(config: Any) -> str | None:
    """Why ``config`` cannot load (the first field that would change answers), or None."""
    for path, action, instead in findings(config):
        if action == REFUSE:
            return f"config field '{path}' is not supported: {instead}"
    return None


def warnings(config: Any) -> list[str]:
    """One line per unimplemented field that only loses a feature, naming the model and field."""
    return [f"model '{config.name}': config field '{path}' is not supported yet and has no effect ({instead})"
            for path, action, instead in findings(config) if action == WARN]
