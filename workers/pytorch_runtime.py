"""Triton's PyTorch 2 runtime (``backend: "pytorch"`` with ``runtime: "model.py"``): the version
folder holds a ``model.py`` that defines a ``torch.nn.Module`` subclass and, optionally, beside
it a ``model.pt`` of its ``state_dict``; the module is built without arguments, given those
weights, and run through ``torch.compile``. Triton runs that layout through its Python backend;
loading the ``model.pt`` of such a folder as TorchScript, as the default runtime does, fails, so
the backend builds the module here instead, as Triton's runtime does (its ``src/model.py``):

- the file is ``default_model_filename`` if set and present, else ``model.py``, else ``model.pt``
  (which is then TorchScript);
- the class is the first ``torch.nn.Module`` subclass the file defines by name (``dir()`` order),
  else the first it imports (``module_class``);
- ``NUM_THREADS`` and ``NUM_INTEROP_THREADS`` (1 when unset, Triton's default there) set torch's
  thread pools; ``TORCH_COMPILE_OPTIONAL_PARAMETERS``, a JSON object, is passed to
  ``torch.compile``;
- inputs are passed to ``forward()`` in the config's order, and outputs are the returned tuple's
  elements in the config's order.

The parameters of the TorchScript runtime (``INFERENCE_MODE``...) are not read by this one, in
Triton as here: each that a config sets is warned about by name.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from .backend import ModelLoadError
from .parameters import string_parameters

log = logging.getLogger("shmserve.worker")

PYTHON_RUNTIME = "model.py"
# Parameters only the TorchScript runtime reads (pytorch_settings.py).
_TORCHSCRIPT_ONLY = ("DISABLE_OPTIMIZED_EXECUTION", "INFERENCE_MODE", "DISABLE_CUDNN", "ENABLE_WEIGHT_SHARING",
                     "ENABLE_CACHE_CLEANING", "INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT", "ENABLE_TENSOR_FUSER",
                     "ENABLE_JIT_PROFILING", "ENABLE_JIT_EXECUTOR", "ENABLE_DETERMINISTIC_ALGORITHMS", "SHARE_WEIGHTS")


# Parameters only this runtime reads.
_PYTHON_ONLY = ("NUM_THREADS", "NUM_INTEROP_THREADS", "TORCH_COMPILE_OPTIONAL_PARAMETERS")


def uses_python_runtime(config: dict[str, Any]) -> bool:
    return config.get("runtime") == PYTHON_RUNTIME


def warn_python_only(config: dict[str, Any], instance: str) -> None:
    """A TorchScript model's config that sets this runtime's parameters: each is named, as it has no effect."""
    ignored = [key for key in _PYTHON_ONLY if key in string_parameters(config)]
    if ignored:
        log.warning("instance '%s': parameter(s) %s are read by the PyTorch 2 runtime (runtime: \"model.py\") "
                    "only and have no effect on this TorchScript model", instance, ", ".join(ignored))


def model_file(version_dir: Path, config: dict[str, Any]) -> Path:
    """The file the runtime loads: Triton's order of names, the first that exists."""
    names = [PYTHON_RUNTIME, "model.pt"]
    if config.get("default_model_filename"):
        names.insert(0, config["default_model_filename"])
    for name in names:
        if (version_dir / name).exists():
            return version_dir / name
    raise ModelLoadError(f"No model found in {version_dir}/{names}")


def set_threads(torch: Any, config: dict[str, Any], instance: str) -> None:
    """``NUM_THREADS`` and ``NUM_INTEROP_THREADS``, 1 each when unset (Triton's runtime sets both)."""
    params = string_parameters(config)
    said = []
    for key, setter in (("NUM_THREADS", torch.set_num_threads), ("NUM_INTEROP_THREADS", torch.set_num_interop_threads)):
        value = params.get(key) or "1"
        try:
            count = int(value)
        except ValueError:
            raise ModelLoadError(f"parameter '{key}': failed to convert '{value}' to an integer") from None
        try:
            setter(count)
        except RuntimeError as e:  # (the inter-op pool can be sized only before it starts)
            log.warning("instance '%s': %s not applied: %s", instance, key, e)
            continue
        said.append(f"{key} = {count}")
    ignored = [key for key in _TORCHSCRIPT_ONLY if key in params]
    if ignored:
        log.warning("instance '%s': parameter(s) %s are read by the TorchScript runtime only and have no effect "
                    "with runtime 'model.py'", instance, ", ".join(ignored))
    log.info("instance '%s': PyTorch 2 runtime (model.py), %s", instance, "; ".join(said))


def compile_options(config: dict[str, Any]) -> dict[str, Any]:
    """``TORCH_COMPILE_OPTIONAL_PARAMETERS`` as keyword arguments of ``torch.compile``."""
    text = string_parameters(config).get("TORCH_COMPILE_OPTIONAL_PARAMETERS")
    if not text:
        return {}
    try:
        options = json.loads(text)
    except ValueError as e:
        raise ModelLoadError(f"parameter 'TORCH_COMPILE_OPTIONAL_PARAMETERS' is not a JSON object: {e}") from None
    if not isinstance(options, dict):
        raise ModelLoadError("parameter 'TORCH_COMPILE_OPTIONAL_PARAMETERS' is not a JSON object")
    if "model" in options:
        raise ModelLoadError("'model' is not an optional parameter for 'torch.compile'")
    return options


def module_class(torch: Any, source: Any) -> Any:
    """The file's first ``nn.Module`` subclass by name, one it defines before one it imports: a
    ``from torch.nn import Linear, Module`` puts those names in ``dir()`` too, ahead of a ``Net``
    (``torch.nn.Module`` itself, built bare, would fail every request; ``Linear`` fails to build)."""
    found = [attr for name in dir(source) if isinstance(attr := getattr(source, name), type)
             and issubclass(attr, torch.nn.Module) and attr is not torch.nn.Module]
    own = [cls for cls in found if cls.__module__ == source.__name__]
    return (own or found or [None])[0]


def load(torch: Any, path: Path, model: str, config: dict[str, Any], device: Any) -> Any:
    """The module to run: TorchScript for a ``.pt`` file; otherwise the file's first
    ``nn.Module`` subclass, built, given the ``state_dict`` of the ``.pt`` beside it if any, in
    eval mode on ``device``, and compiled."""
    if path.suffix != ".py":
        log.info("loading '%s' as TorchScript", model)
        return torch.jit.load(str(path), map_location=device).eval()
    spec = importlib.util.spec_from_file_location(model, str(path))
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"cannot import '{path}'")
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    cls = module_class(torch, source)
    if cls is None:
        raise ModelLoadError("Cannot find a subclass of torch.nn.Module")
    module = cls()
    weights = path.with_suffix(".pt")
    if weights.exists():
        module.load_state_dict(torch.load(str(weights), map_location=device))
    else:
        log.info("Model parameter file not found for '%s'", model)
    module.to(device).eval()
    return torch.compile(module, **compile_options(config))
