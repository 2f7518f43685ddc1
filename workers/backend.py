"""The backend interface every model runs behind, mirroring Triton's backend lifecycle.

Triton's C API has backend, model and instance initialize/finalize and instance execute; here the
same stages are three small classes. A backend is found by name through the ``shmserve.backends``
entry-point group, so a user installs a package to add one, with no change to shmserve:

    [project.entry-points."shmserve.backends"]
    mybackend = "mypkg.backend:MyBackend"

One worker process runs exactly one instance of one model version, so each stage happens once per
process; the split still matters because Triton's models (and users) expect those hooks.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np

from shmserve.shm.answer import ErrorCode
from shmserve.shm.channel import ClientSegment

from .failure import execute_failure

ENTRY_POINT_GROUP = "shmserve.backends"


@dataclasses.dataclass
class ModelContext:
    """What a backend may know about the model it loads (the config is Triton's JSON form)."""

    name: str
    version: int
    model_dir: Path
    config: dict[str, Any]
    strict_config: bool = False
    server_id: str = "shmserve"  # lets a model call other models of the same server (BLS)
    weights_key: str = ""  # names this load's shared copy of the weights (shared_weights.py)
    # what auto-completion gives a model that can batch (--backend-config default-max-batch-size)
    default_max_batch_size: int = 4

    @property
    def version_dir(self) -> Path:
        return self.model_dir / str(self.version)


@dataclasses.dataclass
class InstanceContext:
    name: str
    index: int
    kind: str  # "CPU" or "GPU"
    # The instance's GPU as the server numbers its visible devices (an instance_group ``gpus``
    # entry), which is also its number in the worker: a worker sees every GPU the server sees.
    device_id: int


@dataclasses.dataclass
class Request:
    """One inference request as a backend sees it: inputs are numpy views over shared memory (the
    process's own for those in ``own_inputs``: copies of a client's registered region, private
    views), or torch tensors over a client's CUDA region for an instance that takes device inputs."""

    inputs: dict[str, np.ndarray]
    requested_outputs: list[str]  # empty: every output the model produces
    id: str = ""
    correlation_id: int | str = 0
    flags: int = 0
    parameters: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Streaming requests (decoupled models): send(response or None, final) any number of times.
    sender: Any = None
    # Outputs the client placed in CUDA regions: a GPU backend may answer them with device tensors.
    device_outputs: frozenset[str] = frozenset()
    # Whether the request's owner cancelled it (Triton's ``is_cancelled``): ``cancel.is_set()``.
    cancel: "CancelFlag | None" = None
    # Inputs that are this process's own (read from a client's region, or private copy-on-write views of
    # an arena, workers/input_views.py), not views of memory others read.
    own_inputs: frozenset[str] = frozenset()
    timeout_us: int = 0  # the client's timeout (0: none), as Triton's request.timeout() gives it
    traced: bool = False  # sampled for tracing: the BLS requests it makes are traced as its children


class CancelFlag:
    """A request's cancelled word in its owner's slot, read each time a model asks: the owner
    sets it whenever it gives up (an HTTP client gone, a local caller's timeout or cancel)."""

    __slots__ = ("client", "slot")

    def __init__(self, client: ClientSegment, slot: int) -> None:
        self.client = client
        self.slot = slot

    def is_set(self) -> bool:
        try:
            return self.client.cancelled(self.slot)
        except (ValueError, OSError, TypeError):  # its client left and its segment is unmapped
            return True


@dataclasses.dataclass
class Response:
    outputs: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    error: str | None = None
    parameters: dict[str, Any] | None = None
    status: int = 500  # the HTTP-like status an error completes with (statistics, local clients)
    code: ErrorCode | None = None  # a model's own error: its code, which each frontend maps as Triton does
    # The traces of the BLS requests a traced request made (shm/answer.py StepTrace), which its
    # answer carries to the frontend that writes its trace.
    steps: tuple = ()
    # An error of the model's own answer, not the backend's failure (a class attribute: nothing
    # more to set on each response).
    model_error: ClassVar[bool] = False


class ModelLoadError(Exception):
    """A load the worker refuses with a text that says it all (a setting, a warm-up sample): the
    text is the load's error as it stands, with no exception class in front of it."""


class ModelErrorResponse(Response):
    """An error response the model returned itself (a Python model's ``InferenceResponse(error=
    ...)``): an error to its client, but a request the backend executed successfully, which
    Triton counts as a success (``workers/worker.py``), unlike an ``execute`` that raised."""

    model_error: ClassVar[bool] = True


class Instance(ABC):
    # Whether inputs in a client's CUDA region reach ``execute`` as device tensors (a GPU
    # instance that can use them) rather than copied to host arrays.
    device_inputs: bool = False
    # Whether the model may write into its host inputs (they are its own): large ones in shared
    # arenas then come as copy-on-write views (workers/input_views.py), smaller ones as copies.
    writable_inputs: bool = False
    # Whether the backend applies the config's ``reshape`` itself (the worker does it otherwise:
    # workers/reshape.py).
    reshapes_itself: bool = False

    @abstractmethod
    def execute(self, requests: list[Request]) -> list[Response]:
        """Run one batch; one response per request, in order. Raise to fail the whole batch."""

    def finalize(self) -> None:
        """Instance finalize: release what ``Model.create_instance`` took."""

    def readiness_check(self) -> Callable[[], Any] | None:
        """The model's own readiness check (a Python model's ``is_ready``), or None: then the
        instance is ready while its worker serves (workers/readiness.py)."""
        return None

    def failure(self, name: str, e: BaseException) -> str:
        """The error every request of a batch gets when ``execute`` raised ``e`` (``name``: this
        instance's name)."""
        return execute_failure(name, e, frames=False)


class Model(ABC):
    @abstractmethod
    def create_instance(self, ctx: InstanceContext) -> Instance:
        """Instance initialize."""

    def finalize(self) -> None:
        """Model finalize."""


class Backend(ABC):
    """Backend initialize happens in ``__init__``; ``finalize`` at worker exit."""

    def auto_complete_config(self, ctx: ModelContext) -> dict[str, Any]:
        """Return the config completed from the model itself (used unless strict config)."""
        return ctx.config

    @abstractmethod
    def create_model(self, ctx: ModelContext) -> Model:
        """Model initialize."""

    def finalize(self) -> None:
        """Backend finalize."""


# shmserve's own backends, loaded without scanning every installed distribution's entry points
# (a scan costs a worker ~0.1 s of start-up); the entry-point group also lists them.
BUILT_IN = {"python": "shmserve.workers.python_backend.backend:PythonBackend",
            "pytorch": "shmserve.workers.pytorch_backend:PyTorchBackend",
            "onnxruntime": "shmserve.workers.onnx_backend:OnnxRuntimeBackend"}


def installed_backends() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def load_backend(name: str) -> Backend:
    target = BUILT_IN.get(name)
    if target is not None:
        import importlib

        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)()
    eps = installed_backends()
    if name not in eps:
        raise RuntimeError(f"unable to find backend '{name}'")
    cls = eps[name].load()
    return cls()
