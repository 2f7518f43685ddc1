"""What the worker tells pb_utils about the model it serves, before the model's ``initialize``:
the model's directory (``get_model_dir``) and the executor that carries BLS requests and model
control calls to the server (``..bls.Bls``).

A model calls ``request.exec()`` or ``pb_utils.load_model(...)`` with no handle on the server, so
the process keeps these here: one worker process serves one model.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

from .errors import TritonModelException

if TYPE_CHECKING:
    from shmserve.shm.control_messages import ControlMessage


class Executor(Protocol):
    """The calls pb_utils makes to the server (``..bls.Bls`` implements them)."""

    def execute(self, request: Any) -> Any: ...

    async def execute_async(self, request: Any) -> Any: ...

    def stream(self, request: Any) -> Iterator[Any]: ...

    async def stream_async(self, request: Any) -> Any: ...

    def control(self, message: "ControlMessage") -> Any: ...


_model_dir: Optional[str] = None
_executor: Optional[Executor] = None


def set_model_dir(path: str) -> None:
    """Worker hook: record the model's directory for get_model_dir()."""
    global _model_dir
    _model_dir = str(path)


def set_executor(executor: Executor) -> None:
    """Worker hook: the object that carries BLS requests and model control to other models."""
    global _executor
    _executor = executor


def get_model_dir() -> str:
    """Directory holding the model (set by the worker before loading)."""
    if _model_dir is None:
        raise TritonModelException("model directory is not known yet")
    return _model_dir


def executor(unavailable: str) -> Executor:
    """The worker's executor; ``TritonModelException(unavailable)`` outside a running model."""
    if _executor is None:
        raise TritonModelException(unavailable)
    return _executor
