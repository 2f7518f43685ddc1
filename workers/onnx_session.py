"""An onnxruntime session for one instance, built from the model's config as Triton's
onnxruntime backend builds it: the model file, the session options its ``parameters`` and
``optimization { graph { level } }`` name, and the execution providers its instance kind and
``optimization { execution_accelerators }`` ask for.

Providers: a KIND_CPU instance runs on ``CPUExecutionProvider`` (plus ``openvino`` when a
``cpu_execution_accelerator`` names it and onnxruntime has it); a KIND_GPU instance runs on
``CUDAExecutionProvider`` for its device (``tensorrt`` before it when a
``gpu_execution_accelerator`` names it), with the CPU provider for what those cannot run. An
accelerator this onnxruntime lacks, or a GPU instance whose onnxruntime has no CUDA provider,
is a load error naming it: the model never runs somewhere other than where its config put it.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from .backend import ModelLoadError
from .parameters import bool_value, int_parameter, string_parameters

log = logging.getLogger("shmserve.worker")

DEFAULT_FILENAME = "model.onnx"

# optimization { graph { level } } -> onnxruntime's GraphOptimizationLevel (Triton's mapping;
# any other level keeps onnxruntime's default, every optimization).
_GRAPH_LEVELS = {-1: "ORT_ENABLE_BASIC", 1: "ORT_ENABLE_EXTENDED", 2: "ORT_DISABLE_ALL"}
# Triton's names for TensorRT provider options that onnxruntime spells otherwise; the other
# options Triton documents (trt_*) keep their names.
_TRT_RENAMED = {"max_workspace_size_bytes": "trt_max_workspace_size",
                "int8_calibration_table_name": "trt_int8_calibration_table_name",
                "int8_use_native_calibration_table": "trt_int8_use_native_calibration_table"}
_TRT_OPTIONS = {
    "trt_max_partition_iterations", "trt_min_subgraph_size", "trt_dla_enable", "trt_dla_core",
    "trt_engine_cache_enable", "trt_engine_cache_path", "trt_engine_cache_prefix", "trt_dump_subgraphs",
    "trt_force_sequential_engine_build", "trt_context_memory_sharing_enable", "trt_layer_norm_fp32_fallback",
    "trt_timing_cache_enable", "trt_timing_cache_path", "trt_force_timing_cache", "trt_detailed_build_log",
    "trt_build_heuristics_enable", "trt_sparsity_enable", "trt_builder_optimization_level",
    "trt_auxiliary_streams", "trt_tactic_sources", "trt_extra_plugin_lib_paths", "trt_profile_min_shapes",
    "trt_profile_max_shapes", "trt_profile_opt_shapes", "trt_cuda_graph_enable", "trt_dump_ep_context_model",
    "trt_ep_context_file_path", "trt_ep_context_embed_mode"}
# Execution accelerator names -> onnxruntime's providers.
_ACCELERATORS = {"tensorrt": "TensorrtExecutionProvider", "cuda": "CUDAExecutionProvider",
                 "openvino": "OpenVINOExecutionProvider"}


class SessionError(ModelLoadError, ValueError):
    """The config asks for a session this onnxruntime cannot make: the load fails with this text."""


@dataclasses.dataclass
class Placement:
    """Where an instance runs: its kind (``CPU``/``GPU``) and GPU (the instance_group entry)."""

    kind: str
    device_id: int = 0


def model_path(version_dir: Path, filename: str) -> Path:
    """The ONNX file of a version: ``default_model_filename`` or ``model.onnx``; a directory of
    that name (a model with external data files beside it) holds its ``model.onnx``."""
    path = version_dir / (filename or DEFAULT_FILENAME)
    if path.is_dir():
        path = path / DEFAULT_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"unable to find '{path}'")
    return path


def session_options(ort: Any, config: dict[str, Any]) -> Any:
    """The options Triton's backend sets from the config: graph optimization level, execution
    mode, intra- and inter-op thread counts, the CPU memory arena and memory pattern, and
    ``session.use_device_allocator_for_initializers``; and shmserve's ``SHARE_WEIGHTS``."""
    params = string_parameters(config)
    so = ort.SessionOptions()
    graph = (config.get("optimization") or {}).get("graph")
    if graph is not None:
        level = _GRAPH_LEVELS.get(int(graph.get("level", 0) or 0), "ORT_ENABLE_ALL")
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    mode = int_parameter(params, "execution_mode")
    if mode not in (0, 1):
        raise SessionError(f"Invalid configuration value provided. Expected values for execution_mode are "
                         f"0 or 1 but got {mode} .")
    so.execution_mode = ort.ExecutionMode.ORT_PARALLEL if mode == 1 else ort.ExecutionMode.ORT_SEQUENTIAL
    intra = int_parameter(params, "intra_op_thread_count")
    inter = int_parameter(params, "inter_op_thread_count")
    if intra > 0:
        so.intra_op_num_threads = intra
    if inter > 0:
        so.inter_op_num_threads = inter
    if "enable_mem_arena" in params:
        so.enable_cpu_mem_arena = bool_value("enable_mem_arena", params["enable_mem_arena"])
    if "enable_mem_pattern" in params:
        so.enable_mem_pattern = bool_value("enable_mem_pattern", params["enable_mem_pattern"])
    key = "session.use_device_allocator_for_initializers"
    if key in params:
        so.add_session_config_entry(key, params[key])
    if bool_value("SHARE_WEIGHTS", params.get("SHARE_WEIGHTS") or "no"):
        # Without prepacking, onnxruntime reads the weights from its mapping of the model file,
        # so every instance on this host shares those pages (docs/backends.md, one copy).
        so.add_session_config_entry("session.disable_prepacking", "1")
    return so


def run_options(ort: Any, config: dict[str, Any]) -> Any:
    """Per-run options: ``memory.enable_memory_arena_shrinkage`` (Triton sets it on every run)."""
    ro = ort.RunOptions()
    key = "memory.enable_memory_arena_shrinkage"
    value = string_parameters(config).get(key)
    if value:
        ro.add_run_config_entry(key, value)
    return ro


def _accelerators(config: dict[str, Any], which: str) -> list[dict[str, Any]]:
    eas = (config.get("optimization") or {}).get("execution_accelerators") or {}
    return list(eas.get(which) or [])


def _tensorrt_options(ea: dict[str, Any], device_id: int) -> dict[str, Any]:
    options: dict[str, Any] = {"device_id": device_id}
    for key, value in (ea.get("parameters") or {}).items():
        if key == "precision_mode":
            if value not in ("FP32", "FP16", "INT8"):
                raise SessionError(f"unsupported precision mode '{value}' is requested")
            options["trt_fp16_enable"] = value == "FP16"
            options["trt_int8_enable"] = value == "INT8"
        elif key in _TRT_RENAMED:
            options[_TRT_RENAMED[key]] = value
        elif key in _TRT_OPTIONS:
            options[key] = value
        else:
            raise SessionError(f"unknown parameter '{key}' is provided for TensorRT Execution Accelerator")
    return options


def _cuda_options(config: dict[str, Any], ea_params: dict[str, str], device_id: int) -> dict[str, Any]:
    """CUDA provider options: Triton's defaults, its older top-level parameters, then those of a
    ``cuda`` gpu_execution_accelerator; the device is always the instance's."""
    params = string_parameters(config)
    options: dict[str, Any] = {}
    if "cudnn_conv_algo_search" in params:
        search = int_parameter(params, "cudnn_conv_algo_search")
        names = {0: "EXHAUSTIVE", 1: "HEURISTIC", 2: "DEFAULT"}
        if search not in names:
            raise SessionError(f"unsupported cudnn_conv_algo_search value '{search}' is requested")
        options["cudnn_conv_algo_search"] = names[search]
    if "gpu_mem_limit" in params:
        options["gpu_mem_limit"] = params["gpu_mem_limit"]
    if "arena_extend_strategy" in params:
        strategy = int_parameter(params, "arena_extend_strategy")
        names = {0: "kNextPowerOfTwo", 1: "kSameAsRequested"}
        if strategy not in names:
            raise SessionError(f"unsupported arena_extend_strategy value '{strategy}' is requested")
        options["arena_extend_strategy"] = names[strategy]
    if "do_copy_in_default_stream" in params:
        options["do_copy_in_default_stream"] = params["do_copy_in_default_stream"]
    options.update(ea_params)
    options["device_id"] = device_id
    return options


def _require(available: list[str], provider: str, why: str) -> None:
    if provider not in available:
        raise SessionError(f"{why} needs onnxruntime's {provider}, which this onnxruntime does not have "
                         f"(its providers: {', '.join(available)})")


def providers(config: dict[str, Any], placement: Placement, available: list[str]) -> list[tuple[str, dict]]:
    """The execution providers of an instance, in order of preference, with their options."""
    chosen: list[tuple[str, dict]] = []
    if placement.kind == "GPU":
        cuda_params: dict[str, str] = {}
        for ea in _accelerators(config, "gpu_execution_accelerator"):
            name = ea.get("name", "")
            if name == "tensorrt":
                _require(available, _ACCELERATORS[name], "gpu_execution_accelerator 'tensorrt'")
                chosen.append((_ACCELERATORS[name], _tensorrt_options(ea, placement.device_id)))
            elif name == "cuda":
                cuda_params.update({k: str(v) for k, v in (ea.get("parameters") or {}).items()})
            else:
                raise SessionError(f"unknown Execution Accelerator '{name}' is requested")
        _require(available, "CUDAExecutionProvider", "a KIND_GPU instance")
        chosen.append(("CUDAExecutionProvider", _cuda_options(config, cuda_params, placement.device_id)))
    for ea in _accelerators(config, "cpu_execution_accelerator"):
        name = ea.get("name", "")
        if name != "openvino":
            raise SessionError(f"unknown Execution Accelerator '{name}' is requested")
        _require(available, _ACCELERATORS[name], "cpu_execution_accelerator 'openvino'")
        chosen.append((_ACCELERATORS[name], {"device_type": "CPU"}))
    chosen.append(("CPUExecutionProvider", {}))
    return chosen


def open_session(ort: Any, path: Path, config: dict[str, Any], placement: Placement) -> Any:
    """An ``InferenceSession`` on the providers the instance asks for; refused if onnxruntime
    quietly left one of them out (a CUDA library it could not load, say)."""
    wanted = providers(config, placement, ort.get_available_providers())
    if placement.kind == "GPU" and hasattr(ort, "preload_dlls"):
        # onnxruntime-gpu opens cuBLAS, cuFFT, cuRAND and cuDNN by name. This loads those of
        # NVIDIA's pip packages beside it (torch's, or onnxruntime-gpu[cuda,cudnn]'s) first, as
        # onnxruntime advises, so a GPU instance needs no CUDA toolkit and no LD_LIBRARY_PATH;
        # libraries already loaded or on the loader's path serve as they are.
        ort.preload_dlls()
    session = ort.InferenceSession(str(path), sess_options=session_options(ort, config),
                                   providers=[name for name, _ in wanted], provider_options=[o for _, o in wanted])
    missing = [name for name, _ in wanted if name not in session.get_providers()]
    if missing:
        raise SessionError(f"onnxruntime could not enable {', '.join(missing)} for '{path}' (it runs on "
                         f"{', '.join(session.get_providers())}); see the worker's log for why")
    so = session.get_session_options()
    device = session.get_provider_options().get("CUDAExecutionProvider", {}).get("device_id")
    log.info("onnxruntime %s session for '%s': providers %s%s, graph optimization %s, execution mode %s, "
             "intra-op threads %d, inter-op threads %d", ort.__version__, path, session.get_providers(),
             f" on GPU {device}" if device is not None else "", so.graph_optimization_level.name,
             so.execution_mode.name, so.intra_op_num_threads, so.inter_op_num_threads)
    return session
