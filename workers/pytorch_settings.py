"""The ``parameters`` of a PyTorch model's config that Triton's PyTorch backend reads, read the
same way here: a Triton config.pbtxt that tunes its TorchScript model keeps those settings.

Each worker runs one instance in a process of its own, so the process-wide torch settings
(threads, JIT executor and fuser, cuDNN, deterministic algorithms) are set once, when the
instance is made, as Triton's backend sets them for the instances it hosts. Values are read as
the ONNX Runtime backend reads its own (parameters.py): anything that is not a boolean or an
integer where one is due fails the load, naming the parameter, as Triton's backend refuses it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from .parameters import bool_parameter, int_parameter, string_parameters

log = logging.getLogger("shmserve.worker")


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
        """Raises ParameterError (parameters.py) for a value that is not of its parameter's kind."""
        params = string_parameters(config)
        bool_parameter(params, "ENABLE_WEIGHT_SHARING")  # checked only: instances' weights are shared copy-on-write
        threads = {key: n if (n := int_parameter(params, key)) > 0 else None  # (0 or less: torch's default)
                   for key in ("INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT")}
        return cls(optimized_execution=not bool_parameter(params, "DISABLE_OPTIMIZED_EXECUTION"),
                   inference_mode=bool_parameter(params, "INFERENCE_MODE") is not False,
                   cudnn=not bool_parameter(params, "DISABLE_CUDNN"),
                   cache_cleaning=bool(bool_parameter(params, "ENABLE_CACHE_CLEANING")),
                   deterministic=bool_parameter(params, "ENABLE_DETERMINISTIC_ALGORITHMS"),
                   tensor_fuser=bool_parameter(params, "ENABLE_TENSOR_FUSER"),
                   jit_profiling=bool_parameter(params, "ENABLE_JIT_PROFILING"),
                   jit_executor=bool_parameter(params, "ENABLE_JIT_EXECUTOR"),
                   intra_op_threads=threads["INTRA_OP_THREAD_COUNT"],
                   inter_op_threads=threads["INTER_OP_THREAD_COUNT"])

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

    def running(self, torch: Any) -> Any:
        """The guard around each forward: inference mode (or no_grad), and with optimized
        execution disabled the graph executor's switch too (entered only then: the default path
        costs what one guard costs)."""
        grad = torch.inference_mode() if self.inference_mode else torch.no_grad()
        if self.optimized_execution:
            return grad
        stack = contextlib.ExitStack()
        stack.enter_context(grad)
        stack.enter_context(torch.jit.optimized_execution(False))
        return stack
