"""Serve Python functions and classes from one script, with no model repository.

    import numpy as np
    import shmserve

    @shmserve.model(inputs={"x": (np.float32, [-1])}, outputs={"y": (np.float32, [-1])},
                    max_batch_size=64, max_queue_delay_us=1000, instances=2)
    def double(x):
        return {"y": x * 2}

    if __name__ == "__main__":
        shmserve.serve(http_port=8000)

``serve`` writes a model repository for the declared models into a temporary folder (a
``config.pbtxt`` from each declaration, and a ``model.py`` that names the function) and runs the
whole server on it, so each model runs like any other: one worker process per instance, batching,
metrics, restarts. Workers import the script by its path (under another module name, so its
``if __name__ == "__main__"`` block does not run there): no user object is pickled. Functions that
``yield`` are decoupled models, one response per yield. See docs/binding.md.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

DEFAULT_MAX_QUEUE_DELAY_US = 1000
_CONFIG_TYPES = {"bool": "TYPE_BOOL", "uint8": "TYPE_UINT8", "uint16": "TYPE_UINT16", "uint32": "TYPE_UINT32",
                 "uint64": "TYPE_UINT64", "int8": "TYPE_INT8", "int16": "TYPE_INT16", "int32": "TYPE_INT32",
                 "int64": "TYPE_INT64", "float16": "TYPE_FP16", "float32": "TYPE_FP32", "float64": "TYPE_FP64"}


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    config_type: str  # config.pbtxt's data_type
    dims: tuple[int, ...]  # without the batch dimension

    @property
    def numpy_dtype(self) -> Any:
        return object if self.config_type == "TYPE_STRING" else np.dtype(self.config_type[5:].lower()
                                                                            .replace("fp", "float"))


@dataclasses.dataclass
class Declaration:
    """One model declared with ``@model``."""

    name: str
    target: Any  # the function, or the class (instantiated once per instance)
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int = 0
    max_queue_delay_us: int | None = None
    preferred_batch_sizes: tuple[int, ...] = ()
    instances: int = 1
    device: str = "cpu"
    streaming: bool = False

    def config_pbtxt(self) -> str:
        def tensors(specs: list[TensorSpec]) -> str:
            return ", ".join(f'{{ name: "{t.name}" data_type: {t.config_type} dims: [ {", ".join(map(str, t.dims))} ] }}'
                             for t in specs)

        kind = "KIND_GPU" if self.device == "gpu" else "KIND_CPU"
        lines = [f'name: "{self.name}"', 'backend: "python"', f"max_batch_size: {self.max_batch_size}",
                 f"input [ {tensors(self.inputs)} ]", f"output [ {tensors(self.outputs)} ]",
                 f"instance_group [ {{ count: {self.instances} kind: {kind} }} ]"]
        if self.max_batch_size > 0:
            delay = DEFAULT_MAX_QUEUE_DELAY_US if self.max_queue_delay_us is None else self.max_queue_delay_us
            preferred = f" preferred_batch_size: [ {', '.join(map(str, self.preferred_batch_sizes))} ]" \
                if self.preferred_batch_sizes else ""
            lines.append(f"dynamic_batching {{ max_queue_delay_microseconds: {delay}{preferred} }}")
        if self.streaming:
            lines.append("model_transaction_policy { decoupled: true }")
        return "\n".join(lines) + "\n"


MODELS: dict[str, Declaration] = {}  # what the script being imported declared, by model name


def _spec(name: str, value: Any) -> TensorSpec:
    """A tensor from ``(dtype, dims)``: a numpy dtype (or its name), or ``bytes``/``str``/"BYTES"."""
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(f"tensor '{name}': give (dtype, dims), e.g. (np.float32, [-1])")
    dtype, dims = value
    if dtype in (bytes, str, object) or (isinstance(dtype, str) and dtype.upper() in ("BYTES", "STRING")):
        config_type = "TYPE_STRING"
    else:
        config_type = _CONFIG_TYPES.get(np.dtype(dtype).name, "")
        if not config_type:
            raise TypeError(f"tensor '{name}': numpy dtype {np.dtype(dtype)} has no Triton datatype")
    return TensorSpec(name, config_type, tuple(int(d) for d in dims))


def model(*, inputs: dict[str, Any], outputs: dict[str, Any], name: str | None = None, max_batch_size: int = 0,
          max_queue_delay_us: int | None = None, preferred_batch_sizes: Iterable[int] = (), instances: int = 1,
          device: str = "cpu") -> Callable[[Any], Any]:
    """Declare a function (or a class with ``__call__`` and an optional ``setup()``) as a model.

    Inputs reach it as keyword arguments (numpy arrays; BYTES as object arrays of ``bytes``); it
    returns a dict of outputs (or, with one output, the array alone). With ``max_batch_size`` > 0
    it is called with the requests of a dynamic batch stacked along a first dimension, and must
    return outputs with that dimension; otherwise with one request's arrays. A generator streams
    (a decoupled model): each ``yield`` is one response.
    """
    if device not in ("cpu", "gpu"):
        raise ValueError("device must be 'cpu' or 'gpu'")

    def declare(target: Any) -> Any:
        call = target.__call__ if inspect.isclass(target) else target
        declared = Declaration(
            name=name or target.__name__, target=target,
            inputs=[_spec(k, v) for k, v in inputs.items()], outputs=[_spec(k, v) for k, v in outputs.items()],
            max_batch_size=max_batch_size, max_queue_delay_us=max_queue_delay_us,
            preferred_batch_sizes=tuple(preferred_batch_sizes), instances=instances, device=device,
            streaming=inspect.isgeneratorfunction(call))
        MODELS[declared.name] = declared
        return target

    return declare


MODEL_PY = '''# Written by shmserve.serve: the model "{name}" declared in {script}
from shmserve.bound_model import bound_model

TritonPythonModel = bound_model({script!r}, {name!r})
'''


def write_repository(folder: Path, script: Path, declared: Iterable[Declaration]) -> None:
    """A model repository for ``declared``: each model's config and a model.py that names it;
    the script sits beside each model.py (a link), so a change to it reloads the model in poll
    mode."""
    for d in declared:
        version = folder / d.name / "1"
        version.mkdir(parents=True)
        (folder / d.name / "config.pbtxt").write_text(d.config_pbtxt())
        (version / "model.py").write_text(MODEL_PY.format(name=d.name, script=str(script)))
        os.symlink(script, version / f"script_{script.name}")


def serve(*, repositories: Iterable[str] = (), reload: bool = False, **flags: Any) -> int:
    """Run the server on the models this script declared (beside ``repositories``, if any), with
    ``shmserve``'s flags as keyword arguments (``http_port=8000``, ``id="app"`` ...). ``reload``:
    an edit of the script reloads its models (poll mode, scanned every second). Returns the
    server's exit code once it stops (SIGTERM, Ctrl-C)."""
    main = sys.modules.get("__main__")
    script_file = getattr(main, "__file__", None)
    if not script_file:
        raise RuntimeError("shmserve.serve() serves the models of a script run as 'python app.py'")
    if not MODELS:
        raise RuntimeError("no model is declared: decorate a function with @shmserve.model(...) first")
    from shmserve.server.__main__ import main as server_main

    folder = Path(tempfile.mkdtemp(prefix="shmserve-app-"))
    try:
        write_repository(folder, Path(script_file).resolve(), MODELS.values())
        argv = ["--model-repository", str(folder)]
        for repo in repositories:
            argv += ["--model-repository", str(repo)]
        if reload:
            argv += ["--model-control-mode", "poll", "--repository-poll-secs", "1"]
        for key, value in flags.items():
            flag = "--" + key.replace("_", "-")
            argv += [f"{flag}={str(value).lower()}"] if isinstance(value, bool) else [flag, str(value)]
        return server_main(argv)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
