"""Triton's ``reshape`` of config tensors: the shape a model works with differs from the one its
clients use.

Triton rewrites a request's input shape from the config's ``dims`` to its ``reshape`` before the
backend sees it, and an output's shape from its ``reshape`` back to its ``dims`` when the backend
adds it to the response: the model gets ``[batch] + reshape`` and clients get ``[batch] + dims``.
Each -1 of the target takes the next variable dimension (a -1 of the source) in order, as Triton
does. The worker applies it for every frontend alike (HTTP, gRPC, the local client); a backend
that reshapes for itself (ONNX Runtime, onnx_backend.py) says so with ``Instance.reshapes_itself``.

Ragged inputs reach a batching backend flat and batch outputs take an input's shape
(batch_io.py): neither is reshaped, as there.
"""
from __future__ import annotations

from typing import Any, Sequence

from shmserve.batching import ragged_inputs

Dims = tuple[int, ...]


def reshaped(shape: Sequence[int], source: Sequence[int], target: Sequence[int], batched: bool) -> tuple[int, ...]:
    """``shape`` (a batch dimension first when ``batched``) moved from the config's ``source``
    dims to its ``target`` dims; unchanged when it does not fit them (the model gave another
    shape: it reaches the client as it is)."""
    rows = tuple(shape[:1]) if batched and shape else ()
    inner = tuple(shape[len(rows):])
    if len(inner) != len(source):
        return tuple(shape)
    variable = [d for d, s in zip(inner, source) if s == -1]
    out = []
    for d in target:
        if d != -1:
            out.append(int(d))
        elif variable:
            out.append(int(variable.pop(0)))
        else:
            return tuple(shape)
    if _count(out) != _count(inner):
        return tuple(shape)
    return rows + tuple(out)


def _count(dims: Sequence[int]) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


class Reshapes:
    """One model's reshaped inputs and outputs: name -> (client dims, model dims)."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.batched = int(config.get("max_batch_size", 0) or 0) > 0
        ragged = set(ragged_inputs(config)) if self.batched else set()
        batch_outputs = {name for b in config.get("batch_output", []) for name in b.get("target_name", [])}
        self.inputs = _table(config.get("input", []), ragged)
        self.outputs = _table(config.get("output", []), batch_outputs)

    def __bool__(self) -> bool:
        return bool(self.inputs or self.outputs)

    def model_inputs(self, inputs: dict[str, Any]) -> None:
        """Give each reshaped input (in place) the shape the model takes: its ``reshape``."""
        for name, (dims, inner) in self.inputs.items():
            arr = inputs.get(name)
            if arr is not None:
                shape = reshaped(tuple(arr.shape), dims, inner, self.batched)
                if shape != tuple(arr.shape):
                    inputs[name] = arr.reshape(shape)

    def client_output(self, name: str, arr: Any) -> Any:
        """Output ``arr`` in the shape clients get: its config ``dims``."""
        dims = self.outputs.get(name)
        if dims is None:
            return arr
        shape = reshaped(tuple(arr.shape), dims[1], dims[0], self.batched)
        return arr if shape == tuple(arr.shape) else arr.reshape(shape)


def _table(entries: list[dict[str, Any]], skip: set[str]) -> dict[str, tuple[Dims, Dims]]:
    return {e["name"]: (tuple(e.get("dims") or ()), tuple(e["reshape"].get("shape") or ()))
            for e in entries if e.get("reshape") is not None and e["name"] not in skip}
