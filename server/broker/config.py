"""Model configuration: Triton's ``config.pbtxt`` parsed into Triton's own ``ModelConfig`` message.

Parsing uses protobuf text format with the schema tritonclient ships, so every field keeps the
meaning it has in Triton. Auto-completion and validation follow Triton's rules; every error names
the model and the field so an operator can fix the file without guessing.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2 as mc

from shmserve.shm import latency_histograms
from shmserve.workers.devices import cuda_device_count
from shmserve.workers.pytorch_runtime import PYTHON_RUNTIME as PYTORCH_PYTHON_RUNTIME

from . import batch_io_checks, response_cache, sequence_checks, unsupported

ModelConfig = mc.ModelConfig

# platform -> backend, as Triton maps them.
PLATFORM_BACKENDS = {
    "pytorch_libtorch": "pytorch",
    "onnxruntime_onnx": "onnxruntime",
    "ensemble": "",
}
# Every platform Triton knows (a backend it names may not be installed here); another is refused.
TRITON_PLATFORMS = {*PLATFORM_BACKENDS, "tensorrt_plan", "tensorflow_graphdef", "tensorflow_savedmodel"}
# backend -> the file each version folder must hold unless default_model_filename says otherwise.
DEFAULT_MODEL_FILES = {
    "python": "model.py",
    "pytorch": "model.pt",
    "onnxruntime": "model.onnx",
}
# Files that tell the backend of a model whose config names neither backend nor platform, in the
# order Triton's server-side completion tries them (which runs even with auto-complete disabled).
FILE_BACKENDS = [("model.onnx", "onnxruntime"), ("model.pt", "pytorch"), ("model.pt2", "pytorch"), ("model.py", "python")]


class ConfigError(Exception):
    """A configuration that cannot be served; the message names the model and the field."""


def parse_config_text(text: str, model: str) -> ModelConfig:
    try:
        return text_format.Parse(text, ModelConfig())
    except text_format.ParseError as e:
        raise ConfigError(f"model '{model}': config.pbtxt: {e}") from None


# Folders of a model Triton passes over in silence when it looks for versions.
NOT_VERSIONS = {"warmup", "initial_state", "configs"}


def _is_version(name: str) -> bool:
    """A version folder's name as Triton takes one: a number without leading zeros ('007' is
    passed over, with a warning)."""
    return name.isdigit() and (name == "0" or not name.startswith("0"))


def version_dirs(model_dir: Path) -> list[int]:
    out = []
    try:
        for entry in os.scandir(model_dir):
            if entry.is_dir() and _is_version(entry.name):
                out.append(int(entry.name))
    except FileNotFoundError:
        pass
    return sorted(out)


def non_version_dirs(model_dir: Path) -> list[str]:
    """The folders of a model that are not versions (not a number, or one with leading zeros),
    which a load passes over with a warning, as Triton's does; hidden ones and those Triton
    knows to be no version (``warmup``, ...) are passed over in silence."""
    try:
        return sorted(e.name for e in os.scandir(model_dir)
                      if e.is_dir() and not _is_version(e.name) and not e.name.startswith(".")
                      and e.name not in NOT_VERSIONS)
    except FileNotFoundError:
        return []


def _infer_backend(model_dir: Path, default_model_filename: str) -> str:
    """The backend Triton's AutoCompleteBackendFields gives a config that names none: the one
    ``default_model_filename`` names, else the one whose file a version folder holds, in
    Triton's order of files (the newest version first, where Triton looks in the first folder
    by name only)."""
    if default_model_filename:
        return dict((f, b) for f, b in FILE_BACKENDS if f != "model.pt2").get(default_model_filename, "")
    for version in reversed(version_dirs(model_dir)):
        for filename, backend in FILE_BACKENDS:
            if (model_dir / str(version) / filename).exists():
                return backend
    return ""


def backend_of(config: ModelConfig) -> str:
    return config.backend or PLATFORM_BACKENDS.get(config.platform, config.platform)


def instance_devices(group: mc.ModelInstanceGroup) -> list[int]:
    """The devices one instance group places ``count`` instances on (CPU groups: one)."""
    return list(group.gpus) if group.kind == mc.ModelInstanceGroup.KIND_GPU else [0]


def instance_count(config: ModelConfig) -> int:
    return sum(group.count * len(instance_devices(group)) for group in config.instance_group)


def config_path(model_dir: Path, config_name: str = "") -> Path:
    """The file a model's configuration is read from: ``configs/<name>.pbtxt`` where
    --model-config-name names one that exists (as Triton), else ``config.pbtxt``."""
    if config_name:
        custom = model_dir / "configs" / f"{config_name}.pbtxt"
        if custom.is_file():
            return custom
    return model_dir / "config.pbtxt"


def load_config(model_dir: Path, strict: bool, override_json: str | None = None, config_name: str = "") -> ModelConfig:
    """Read (or, without --strict-model-config, complete) a model's configuration."""
    model = model_dir.name
    path = config_path(model_dir, config_name)
    if override_json is not None:
        # (first: protobuf's parser takes an empty list as no fields, and words others in Python's terms)
        if not override_json.lstrip().startswith("{"):
            raise ConfigError(f"model '{model}': config override: the override must be a JSON object")
        try:
            config = json_format.Parse(override_json, ModelConfig())
        except json_format.ParseError as e:
            raise ConfigError(f"model '{model}': config override: {e}") from None
    elif path.exists():
        config = parse_config_text(path.read_text(), model)
    elif strict:
        raise ConfigError(f"model '{model}': config.pbtxt is missing and --strict-model-config is set")
    else:
        config = ModelConfig()
    if not config.name:
        config.name = model
    elif config.name != model:
        raise ConfigError(f"model '{model}': name '{config.name}' in config.pbtxt must match the "
                          f"model directory name '{model}'")
    if not config.backend and not config.platform:  # (Triton infers it whatever --strict-model-config says)
        config.backend = _infer_backend(model_dir, config.default_model_filename)
    if config.platform in PLATFORM_BACKENDS and not config.backend and config.platform != "ensemble":
        config.backend = PLATFORM_BACKENDS[config.platform]
    if config.backend == "onnxruntime":  # as Triton fills an ONNX model's backend fields
        config.platform = config.platform or "onnxruntime_onnx"
        config.default_model_filename = config.default_model_filename or DEFAULT_MODEL_FILES["onnxruntime"]
    if config.backend == "pytorch":  # ... and a PyTorch model's (a torch.export program keeps its own file)
        config.platform = config.platform or "pytorch_libtorch"
        exported = any(model_dir.glob("*/model.pt2"))
        if not exported and config.runtime != PYTORCH_PYTHON_RUNTIME:  # (Triton leaves it unset for model.py)
            config.default_model_filename = config.default_model_filename or DEFAULT_MODEL_FILES["pytorch"]
    complete_defaults(config)
    return config


SEQUENCE_IDLE_DEFAULT_US = 1_000_000  # Triton's max_sequence_idle_microseconds when unset


def complete_defaults(config: ModelConfig) -> None:
    """Fill what Triton fills for every model: version policy, instance groups, and a sequence
    batcher's idle time (1 s), which the config endpoints then show as Triton's do."""
    if not config.HasField("version_policy"):
        config.version_policy.latest.num_versions = 1
    if config.HasField("sequence_batching") and not config.sequence_batching.max_sequence_idle_microseconds:
        config.sequence_batching.max_sequence_idle_microseconds = SEQUENCE_IDLE_DEFAULT_US
    if config.platform == "ensemble":
        return
    if not config.instance_group:  # named after the model, as Triton names it: its instance is '<model>_0'
        config.instance_group.add(name=config.name, count=1, kind=mc.ModelInstanceGroup.KIND_AUTO)
    gpus = cuda_device_count()
    for i, group in enumerate(config.instance_group):
        if not group.name:
            group.name = f"{config.name}_{i}"
        if group.count < 1:
            group.count = 1
        if group.kind == mc.ModelInstanceGroup.KIND_AUTO:
            group.kind = mc.ModelInstanceGroup.KIND_GPU if gpus else mc.ModelInstanceGroup.KIND_CPU
        if group.kind == mc.ModelInstanceGroup.KIND_GPU and not group.gpus:
            group.gpus.extend(range(gpus))


def validate(config: ModelConfig, model_dir: Path, known_backends: set[str], versions: list[int],
             completed_later: bool = False) -> None:
    """Refuse what Triton refuses, with the model and field named. ``completed_later``: the
    backend will complete the config (no --strict-model-config), and this completed config is
    validated again; until then an unset ``max_batch_size`` is not held against the batcher's
    settings, as the backend may set it (Triton validates only the completed config)."""
    m = config.name
    if config.platform and not config.backend and config.platform not in TRITON_PLATFORMS:
        raise ConfigError(f"unexpected platform type '{config.platform}' for {m}")  # Triton's words
    backend = backend_of(config)
    why = unsupported.refusal(config)
    if why:
        raise ConfigError(f"model '{m}': {why}")
    why = response_cache.refusal(config) or batch_io_checks.problem(config) or sequence_checks.problem(config)
    if why:
        raise ConfigError(why)  # Triton's text names the model
    why = latency_histograms.problem(model_metrics(config))
    if why:
        raise ConfigError(f"model '{m}': {why}")
    if config.platform == "ensemble":
        from .ensemble_plan import check_plan

        problem = check_plan(config)
        if problem:
            raise ConfigError(f"model '{m}': ensemble_scheduling: {problem}")
        _check_tensors(config)
        return
    if not backend:
        raise ConfigError(f"model '{m}': must specify 'backend' or 'platform' (none could be inferred "
                          f"from the model files)")
    if backend not in known_backends:
        served = ", ".join(sorted(known_backends))
        if config.platform and not config.backend:  # (tensorrt_plan, tensorflow_savedmodel, ...)
            raise ConfigError(f"model '{m}': unable to find backend '{backend}': platform '{config.platform}' is "
                              f"not served by shmserve (its backends: {served})")
        raise ConfigError(f"model '{m}': unable to find backend '{backend}' (installed backends: {served})")
    if config.max_batch_size < 0:
        raise ConfigError(f"model '{m}': max_batch_size must be >= 0, got {config.max_batch_size}")
    gpus = cuda_device_count()
    for group in config.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            if not gpus:
                raise ConfigError(f"model '{m}': instance_group '{group.name}' asks for KIND_GPU but CUDA "
                                  f"is not available (no GPU found)")
            bad = [g for g in group.gpus if g < 0 or g >= gpus]
            if bad:
                raise ConfigError(f"model '{m}': instance_group '{group.name}' names GPU {bad[0]}, "
                                  f"which does not exist")
        elif group.kind not in (mc.ModelInstanceGroup.KIND_CPU, mc.ModelInstanceGroup.KIND_MODEL):
            raise ConfigError(f"model '{m}': instance_group '{group.name}' kind "
                              f"{mc.ModelInstanceGroup.Kind.Name(group.kind)} is not supported")
        elif group.gpus:  # Triton's words
            raise ConfigError(f"instance group {group.name} of model {m} has kind "
                              f"{mc.ModelInstanceGroup.Kind.Name(group.kind)} but specifies one or more GPUs")
    # (With max_batch_size 0 the dynamic batcher still orders and polices the queue, and sends one
    # request an execution, as Triton's does.)
    if config.HasField("dynamic_batching") and not (completed_later and config.max_batch_size == 0):
        for size in config.dynamic_batching.preferred_batch_size:
            if size < 1 or size > config.max_batch_size:
                raise ConfigError(f"model '{m}': dynamic_batching.preferred_batch_size {size} must be "
                                  f"between 1 and max_batch_size {config.max_batch_size}")
        problem = _priority_problem(config)
        if problem:
            raise ConfigError(problem)  # Triton's text names the model
    _check_tensors(config, completed_later)
    filename = config.default_model_filename or DEFAULT_MODEL_FILES.get(backend)
    if filename:
        for v in versions:
            alternatives = [filename] + (["model.pt2"] if filename == "model.pt" else [])
            if backend == "pytorch" and config.runtime == PYTORCH_PYTHON_RUNTIME:
                alternatives = [f for f in (config.default_model_filename, "model.py", "model.pt") if f]  # (Triton's)
            if not any((model_dir / str(v) / f).exists() for f in alternatives):
                raise ConfigError(f"model '{m}': version {v}: model file '{filename}' is missing in "
                                  f"{model_dir / str(v)}")


def _priority_problem(config: ModelConfig) -> str | None:
    """Triton's refusals of a dynamic batcher's priority levels and queue policies (its
    ValidateModelConfig): a default level or a policy's level outside the levels there are, and,
    with ``preserve_ordering``, more than one level or a policy that delays timed-out requests."""
    db, m = config.dynamic_batching, config.name
    levels = db.priority_levels
    if levels:
        if not 1 <= db.default_priority_level <= levels:
            return f"default priority level must be in range [1, {levels}] for {m}"
        if any(not 1 <= level <= levels for level in db.priority_queue_policy):
            return f"priority queue policy must have priority level in range [1, {levels}] for {m}"
    if db.preserve_ordering:
        if levels > 1:
            return f"Only one priority level is allowed when 'preserve_ordering' is true for {m}"
        delay = mc.ModelQueuePolicy.DELAY
        policies = [db.default_queue_policy, *db.priority_queue_policy.values()]
        if any(p.default_timeout_microseconds and p.timeout_action == delay for p in policies):
            return f"Queue policy can not have DELAY as timeout action when 'preserve_ordering' is true for {m}"
    return None


def _check_tensors(config: ModelConfig, completed_later: bool = False) -> None:
    """Triton's checks of each input and output. ``completed_later``: the backend may still give
    a tensor its data type and dims (auto_complete_config), so those wait for the completed config."""
    m = config.name
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen: set[str] = set()
        for t in tensors:
            if not t.name:
                raise ConfigError(f"model '{m}': an {kind} has no name")
            if t.name in seen:
                raise ConfigError(f"model '{m}': {kind} '{t.name}' is declared more than once")
            seen.add(t.name)
            if t.data_type == mc.TYPE_INVALID and not completed_later:
                raise ConfigError(f"model '{m}': {kind} '{t.name}' must specify 'data_type'")
            if not t.dims and not completed_later:  # (as Triton: even with a reshape, or a batch dimension to come)
                raise ConfigError(f"model '{m}': {kind} '{t.name}' must specify 'dims'")
            for d in t.dims:
                if d == 0 or d < -1:
                    raise ConfigError(f"model '{m}': {kind} '{t.name}' dims {list(t.dims)}: each "
                                      f"dimension must be >= 1, or -1 for a variable-size dimension")
            problem = _reshape_problem(t, config.max_batch_size) if t.dims else None
            if kind == "input" and not problem and t.format in (mc.ModelInput.FORMAT_NHWC, mc.ModelInput.FORMAT_NCHW) \
                    and len(t.dims) != 3 and (t.dims or not completed_later):  # (dims the backend may give)
                problem = "NHWC/NCHW require 3 dims"
            if problem:  # Triton's words
                raise ConfigError(f"model '{m}': model {kind} '{t.name}' {problem}")


def _element_trunks(shape: Iterable[int]) -> list[int]:
    """The element counts of the runs of a shape between its variable-size dimensions."""
    trunks = [1]
    for d in shape:
        if d == -1:
            trunks.append(1)
        else:
            trunks[-1] *= d
    return trunks


def _reshape_problem(t: Any, max_batch_size: int) -> str | None:
    """Triton's refusal of a tensor's ``reshape`` (its ValidateIOShape): empty in a model that
    does not batch (a scalar), a dimension below 1 other than -1, or not the same elements as
    ``dims`` (an empty reshape takes dims of one element), run by run between variable-size
    dimensions."""
    if not t.HasField("reshape"):
        return None
    shape = list(t.reshape.shape)
    if not shape and max_batch_size == 0:
        return "cannot have empty reshape for non-batching model as scalar tensors are not supported"
    if any(d < 1 and d != -1 for d in shape):
        return "reshape dimensions must be integer >= 1, or -1 to indicate a variable-size dimension"
    dims, reshape = _element_trunks(t.dims), _element_trunks(shape)
    if not shape:
        return None if dims == [1] else "has different size for dims and reshape"
    if len(dims) != len(reshape):
        return ("has different number of variable-size dimensions for dims and reshape" if len(dims) > 1 and
                len(reshape) > 1 else "has different size for dims and reshape")
    if dims != reshape:
        return "has different size for dims and reshape"
    return None


def select_versions(config: ModelConfig, available: list[int]) -> list[int]:
    """Versions to serve under the config's version_policy (Triton's default: the latest one)."""
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return list(available)
    if which == "specific":
        return sorted(v for v in set(policy.specific.versions) if v in available)
    n = max(policy.latest.num_versions, 0) if which == "latest" else 1  # (0: none, which Triton refuses)
    return available[-n:] if available and n > 0 else []


def model_metrics(config: ModelConfig) -> dict:
    """The config's ``model_metrics`` alone, as ``to_dict`` shows it (for shm/latency_histograms.py)."""
    return {"model_metrics": json_format.MessageToDict(config.model_metrics, preserving_proto_field_name=True)}


def from_dict(data: dict) -> ModelConfig:
    return json_format.ParseDict(data, ModelConfig(), ignore_unknown_fields=True)


def string_parameters(config: mc.ModelConfig) -> dict[str, str]:
    """The model's ``parameters`` map as plain strings (Triton keeps them in ``string_value``)."""
    return {key: value.string_value for key, value in config.parameters.items()}


def execution_timeout(parameters: dict[str, str]) -> float:
    """Parameter ``execution_timeout_s`` (shmserve's): seconds one execution may run before its
    instance is killed and restarted; 0 or absent: no limit."""
    raw = parameters.get("execution_timeout_s")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"parameter 'execution_timeout_s' must be a number of seconds, got '{raw}'") from None
    if value < 0:
        raise ValueError(f"parameter 'execution_timeout_s' must not be negative, got {value}")
    return value
