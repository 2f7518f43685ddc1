"""The result of a local client's call: output arrays over shared memory that keep the blocks
behind them alive for as long as any of them is used."""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Iterator

import numpy as np

from .answer import AnswerDescriptor
from .completion import Completion


class _Holder:
    """The base object of every output array: it exports the array's memory through
    ``__array_interface__`` and holds the result, so the shm blocks behind an array live as long
    as the array or any view of it (numpy keeps the exporter as the arrays' base)."""

    __slots__ = ("__array_interface__", "result", "source")

    def __init__(self, arr: np.ndarray, result: "InferResult") -> None:
        self.__array_interface__ = dict(arr.__array_interface__)
        self.result = result
        self.source = arr  # keeps the mapping the pointer points into


def _kept(arr: np.ndarray, result: "InferResult") -> np.ndarray:
    kept = np.asarray(_Holder(arr, result))
    # (the interface spells a dtype numpy does not know, ml_dtypes' bfloat16, as 2 void bytes)
    return kept if kept.dtype == arr.dtype else kept.view(arr.dtype)


class InferResult(Mapping[str, np.ndarray]):
    """The outputs of one request. Arrays handed out keep the result (and so its shm blocks)
    alive; the result holds only raw views and weak references to those arrays, never the arrays
    themselves: a cycle would leave each result to the cyclic GC, and one result stuck in an old
    generation stalls the FIFO arena behind it (the client then runs out of room)."""

    def __init__(self, completion: Completion, answer: AnswerDescriptor, outputs: dict[str, np.ndarray],
                 kept: frozenset[str] = frozenset()) -> None:
        self._completion: Completion | None = completion
        self.model_version = answer.served_version()
        self.parameters = dict(answer.params or {})
        self._answer = (answer.version, answer.trace, answer.steps)  # (a traced BLS call's: workers/python_backend/bls.py)
        self._outputs = outputs  # raw views into shm (or arrays of their own: BYTES, caller regions)
        self._kept = kept  # names whose arrays must keep this result alive
        self._handed: weakref.WeakValueDictionary[str, np.ndarray] | None = None  # made on first use

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._kept:
            return self._outputs[name]
        handed = self._handed
        if handed is None:
            handed = self._handed = weakref.WeakValueDictionary()
        arr = handed.get(name)
        if arr is None:
            arr = handed[name] = _kept(self._outputs[name], self)
        return arr

    def __iter__(self) -> Iterator[str]:
        return iter(self._outputs)

    def __len__(self) -> int:
        return len(self._outputs)

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self[name] if name in self._outputs else None

    def release(self) -> None:
        """Give the shm blocks back now; arrays taken from this result must not be used after."""
        if self._completion is not None:
            self._completion.release()
            self._completion = None

    def __enter__(self) -> "InferResult":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
