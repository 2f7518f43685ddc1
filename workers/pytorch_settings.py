"""The ``parameters`` of a PyTorch model's config that Triton's PyTorch backend reads, read the
same way here: a Triton config.pbtxt that tunes its TorchScript model keeps those settings.

Each worker runs one instance in a process of its own, so the process-wide torch settings
(threads, JIT executor and fuser, cuDNN, deterministic algorithms) are set once, when the
instance is made, as Triton's backend sets them for the instances it hosts. Values are Triton's
booleans ("true"/"false", also "1"/"0", "yes"/"no", "on"/"off") and integers; anything else
fails the load, naming the parameter, as Triton's backend refuses it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any, Iterator

from .backend import ModelLoadError

log = logging.getLogger("shmserve.worker")

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


class SettingError(ModelLoadError, ValueError):
    """A parameter's value is not of its kind: the load fails with this text."""


def _flag(params: dict[str, Any], key: str) -> bool | None:
    """A boolean parameter, None when the config does not set it."""
    value = params.get(key)
    if value is None:
        return None
    text = str(value.get("string_value", "") if isinstance(value, dict) else value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise SettingError(f"parameter '{key}' must be true or false, got '{text}'")


def _count(params: dict[str, Any], key: str) -> int | None:
    """A thread-count parameter; None when unset (as Triton, 0 or less leaves torch's default)."""
    value = params.get(key)
    if value is None:
        return None
    text = str(value.get("string_value", "") if isinstance(value, dict) else value).strip()
    try:
        n = int(text)
    except ValueError:
        raise SettingError(f"parameter '{key}' must be an integer, got '{text}'") from None
    return n if n > 0 else None


@dataclasses.dataclass(frozen=True)
class TorchSettings:
    """What a model's parameters ask of torch; the defaults are Triton 2.51's."""

    optimized_execution: bool = True  # DISABLE_OPTIMIZED_EXECUTION
    inference_mode: bool = True  # INFERENCE_MODE (else torch.no_grad())
    cudnn: bool = True  # DISABLE_CUDNN
    cache_cleaning: bool = False  # ENABLE_CACHE_CLEANING: empty the CUDA cache after each execution
    deterministic: bool | None = None  # ENABLE_DETERMINISTIC_ALGORITHMS
    tensor_fuser: bool | None = None  # ENABLE_TENSOR_FUSER
    jit_profiling: bool | None = None  # ENABLE_JIT_PROFILING
    jit_executor: bool | None = None  # ENABLE_JIT_EXECUTOR
    intra_op_threads: int | None = None  # INTRA_OP_THREAD_COUNT
    inter_op_threads: int | None = None  # INTER_OP_THREAD_COUNT

    @classmethod
    def from_config(cls, config: dict) -> "TorchSettings":
        """Raises SettingError for a value that is not of its parameter's kind."""
        params = config.get("parameters") or {}
        _flag(params, "ENABLE_WEIGHT_SHARING")  # checked only: instances' weights are shared copy-on-write
        disable_optimized = _flag(params, "DISABLE_OPTIMIZED_EXECUTION")
        inference_mode = _flag(params, "INFERENCE_MODE")
        disable_cudnn = _flag(params, "DISABLE_CUDNN")
        return cls(optimized_execution=not disable_optimized,
                   inference_mode=inference_mode is not False,
                   cudnn=not disable_cudnn,
                   cache_cleaning=bool(_flag(params, "ENABLE_CACHE_CLEANING")),
                   deterministic=_flag(params, "ENABLE_DETERMINISTIC_ALGORITHMS"),
                   tensor_fuser=_flag(params, "ENABLE_TENSOR_FUSER"),
                   jit_profiling=_flag(params, "ENABLE_JIT_PROFILING"),
                   jit_executor=_flag(params, "ENABLE_JIT_EXECUTOR"),
                   intra_op_threads=_count(params, "INTRA_OP_THREAD_COUNT"),
                   inter_op_threads=_count(params, "INTER_OP_THREAD_COUNT"))

    def apply(self, torch: Any, instance: str) -> None:
        """Set what is process-wide, before the model runs; one line says what was set."""
        said = []
        if self.intra_op_threads is not None:
            torch.set_num_threads(self.intra_op_threads)
            said.append(f"intra-op threads {self.intra_op_threads}")
        if self.inter_op_threads is not None:
            try:  # (torch allows it only before its inter-op pool started)
                torch.set_num_interop_threads(self.inter_op_threads)
                said.append(f"inter-op threads {self.inter_op_threads}")
            except RuntimeError as e:
                log.warning("instance '%s': INTER_OP_THREAD_COUNT not applied: %s", instance, e)
        if not self.cudnn:
            torch.backends.cudnn.enabled = False
            said.append("cuDNN disabled")
        if self.deterministic is not None:
            torch.use_deterministic_algorithms(self.deterministic)
            said.append(f"deterministic algorithms {'enabled' if self.deterministic else 'disabled'}")
        for value, setter, name in ((self.tensor_fuser, "_jit_set_texpr_fuser_enabled", "tensor fuser"),
                                    (self.jit_profiling, "_jit_set_profiling_mode", "JIT profiling"),
                                    (self.jit_executor, "_jit_set_profiling_executor", "JIT executor")):
            if value is not None:
                getattr(torch._C, setter)(value)
                said.append(f"{name} {'enabled' if value else 'disabled'}")
        if not self.optimized_execution:
            said.append("optimized execution disabled")
        if not self.inference_mode:
            said.append("inference mode disabled (no_grad)")
        if self.cache_cleaning:
            said.append("CUDA cache cleaning enabled")
        if said:
            log.info("instance '%s': %s", instance, ", ".join(said))

    @contextlib.contextmanager
    def running(self, torch: Any) -> Iterator[None]:
        """Around each forward: inference mode (or no_grad) and the graph executor's optimization."""
        grad = torch.inference_mode() if self.inference_mode else torch.no_grad()
        with grad, torch.jit.optimized_execution(self.optimized_execution):
            yield
