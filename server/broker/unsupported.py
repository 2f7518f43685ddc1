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
    "sequence_batching.state.use_same_buffer_for_input_output": (WARN, "state tensors are copied"),
    "sequence_batching.state.use_growable_memory": (WARN, "state tensors are copied"),
    "sequence_batching.oldest.preserve_ordering": (WARN, "batches of several instances may answer out of order"),
    "ensemble_scheduling.step.model_namespace": (WARN, "model namespacing is not supported: the step runs the "
                                                       "model of that name"),
}

# Parameters (the config's ``parameters`` map) that a Triton backend reads and shmserve's does not
# act on, by backend: warned about by name at load, as the fields above.
PARAMETERS: dict[str, dict[str, str]] = {
    "python": {
        "EXECUTION_ENV_PATH": "the model runs in the server's own Python environment, not in the packed "
                              "one: install what it imports there (docs/python_backend.md)",
    },
    "pytorch": {
        "ENABLE_NVFUSER": "Triton's PyTorch backend no longer reads it (nor does 2.51's); ENABLE_TENSOR_FUSER "
                          "sets TorchScript's fuser",
    },
}

# Every other field of Triton's ModelConfig is implemented: read by the loader, the schedulers, the
# backends or the API that shows the config. tests/unit/test_config.py walks the schema so that a
# field Triton adds is either listed here, once implemented, or in FIELDS above: never ignored.
IMPLEMENTED: frozenset[str] = frozenset({
    "name", "platform", "backend", "max_batch_size", "default_model_filename", "parameters",
    "version_policy", "version_policy.latest", "version_policy.latest.num_versions", "version_policy.all",
    "version_policy.specific", "version_policy.specific.versions",
    "input", "input.name", "input.data_type", "input.dims", "input.reshape", "input.reshape.shape",
    "input.allow_ragged_batch", "input.optional",
    "input.format",  # kept and shown in the model's config: Triton too uses it only to describe the input
    "output", "output.name", "output.data_type", "output.dims", "output.reshape", "output.reshape.shape",
    "output.label_filename",
    "batch_input", "batch_input.kind", "batch_input.target_name", "batch_input.data_type",
    "batch_input.source_input", "batch_output", "batch_output.target_name", "batch_output.kind",
    "batch_output.source_input",
    "optimization",  # a message of settings, each listed in FIELDS
    "dynamic_batching", "dynamic_batching.preferred_batch_size", "dynamic_batching.max_queue_delay_microseconds",
    "dynamic_batching.preserve_ordering", "dynamic_batching.priority_levels",
    "dynamic_batching.default_priority_level", "dynamic_batching.default_queue_policy",
    "dynamic_batching.default_queue_policy.timeout_action",
    "dynamic_batching.default_queue_policy.default_timeout_microseconds",
    "dynamic_batching.default_queue_policy.allow_timeout_override",
    "dynamic_batching.default_queue_policy.max_queue_size", "dynamic_batching.priority_queue_policy",
    "sequence_batching", "sequence_batching.direct", "sequence_batching.direct.max_queue_delay_microseconds",
    "sequence_batching.direct.minimum_slot_utilization", "sequence_batching.oldest",
    "sequence_batching.oldest.max_candidate_sequences", "sequence_batching.oldest.preferred_batch_size",
    "sequence_batching.oldest.max_queue_delay_microseconds", "sequence_batching.max_sequence_idle_microseconds",
    "sequence_batching.control_input", "sequence_batching.control_input.name",
    "sequence_batching.control_input.control", "sequence_batching.control_input.control.kind",
    "sequence_batching.control_input.control.int32_false_true",
    "sequence_batching.control_input.control.fp32_false_true",
    "sequence_batching.control_input.control.bool_false_true",
    "sequence_batching.control_input.control.data_type",
    "sequence_batching.state", "sequence_batching.state.input_name", "sequence_batching.state.output_name",
    "sequence_batching.state.data_type", "sequence_batching.state.dims", "sequence_batching.state.initial_state",
    "sequence_batching.state.initial_state.data_type", "sequence_batching.state.initial_state.dims",
    "sequence_batching.state.initial_state.zero_data", "sequence_batching.state.initial_state.data_file",
    "sequence_batching.state.initial_state.name",
    "ensemble_scheduling", "ensemble_scheduling.step", "ensemble_scheduling.step.model_name",
    "ensemble_scheduling.step.model_version", "ensemble_scheduling.step.input_map",
    "ensemble_scheduling.step.output_map", "ensemble_scheduling.max_inflight_requests",
    "instance_group", "instance_group.name", "instance_group.kind", "instance_group.count",
    "instance_group.gpus", "instance_group.rate_limiter", "instance_group.rate_limiter.resources",
    "instance_group.rate_limiter.resources.name", "instance_group.rate_limiter.resources.global",
    "instance_group.rate_limiter.resources.count", "instance_group.rate_limiter.priority",
    "model_warmup", "model_warmup.name", "model_warmup.batch_size", "model_warmup.inputs", "model_warmup.count",
    "model_transaction_policy", "model_transaction_policy.decoupled", "response_cache", "response_cache.enable",
    "model_metrics", "model_metrics.metric_control", "model_metrics.metric_control.metric_identifier",
    "model_metrics.metric_control.metric_identifier.family", "model_metrics.metric_control.histogram_options",
    "model_metrics.metric_control.histogram_options.buckets",  # shm/latency_histograms.py
})
# Fields of the table above that a backend implements itself: not warned about for its models.
HONOURED: dict[str, set[str]] = {
    "onnxruntime": {"optimization.graph", "optimization.execution_accelerators"},
    "pytorch": {"runtime"},  # "model.py": the PyTorch 2 runtime; another is refused by the backend
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


def warnings(config: Any, backend: str = "") -> list[str]:
    """One line per unimplemented field that only loses a feature, and per parameter ``backend``
    (the model's, as its config names or implies it) does not act on, naming the model and the
    field or parameter."""
    fields = [f"model '{config.name}': config field '{path}' is not supported yet and has no effect ({instead})"
              for path, action, instead in findings(config) if action == WARN]
    ignored = PARAMETERS.get(backend or config.backend, {})
    return fields + [f"model '{config.name}': parameter '{key}' is not supported: {ignored[key]}"
                     for key in config.parameters if key in ignored]
