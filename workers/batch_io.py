"""Triton's ragged batching for the backends that run a whole batch as one call (ONNX Runtime,
PyTorch): what Triton's backend utilities (``BackendInputCollector``, ``BackendOutputResponder``)
do for its ONNX Runtime, PyTorch and TensorRT backends.

A ragged input (``allow_ragged_batch``) may have another shape in each request of a batch (the
batcher lets them batch together), so it cannot be stacked along the batch dimension: it reaches
the model as every request's elements, in request order, in one flat tensor ``[total elements]``.
The model finds each request's elements through the ``batch_input`` tensors the server makes from
the batch, and a ``batch_output`` is an output of the whole batch that goes back to each request
with the shape of one of its inputs. Element counts and shapes are those the clients sent, batch
dimension included.

The Python backend does none of this, as in Triton: its model gets each request as it came, and
no batch inputs.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

import numpy as np

from shmserve.batching import ragged_inputs

# Triton's batch input datatypes (the broker refuses any other at load).
_DTYPES = {"TYPE_INT32": np.int32, "TYPE_FP32": np.float32}

Shapes = Sequence[Mapping[str, Any]]  # each request's inputs (arrays or tensors: only .shape is read)


@dataclasses.dataclass(frozen=True)
class BatchInput:
    kind: str
    targets: tuple[str, ...]  # the model inputs that receive it (each gets the same tensor)
    dtype: Any
    source: str


@dataclasses.dataclass(frozen=True)
class BatchOutput:
    source: str
    shape: tuple[int, ...]  # [-1] (batching models) + the output's dims; each -1 is the source's dimension


def _elements(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _dims(output: dict[str, Any]) -> list[int]:
    """An output's dims as Triton's batch output takes them: its ``reshape`` when it has one."""
    reshape = output.get("reshape")
    return list(reshape.get("shape") or []) if reshape is not None else list(output.get("dims") or [])


class BatchIO:
    """One model's ragged inputs, batch inputs and batch outputs, read from its config (the dict
    form) once per instance."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.ragged = ragged_inputs(config)
        self.inputs = [BatchInput(str(b.get("kind") or "BATCH_ELEMENT_COUNT"), tuple(b.get("target_name") or ()),
                                  _DTYPES.get(b.get("data_type", ""), np.int32), (b.get("source_input") or [""])[0])
                       for b in config.get("batch_input") or ()]
        batched = int(config.get("max_batch_size", 0) or 0) > 0
        dims = {o["name"]: _dims(o) for o in config.get("output") or ()}
        self.outputs: dict[str, BatchOutput] = {}
        for b in config.get("batch_output") or ():
            for name in b.get("target_name") or ():
                shape = ([-1] if batched else []) + dims.get(name, [])
                self.outputs[name] = BatchOutput((b.get("source_input") or [""])[0], tuple(shape))

    @property
    def targets(self) -> list[str]:
        """The model inputs the batch inputs feed, in config order (after the config's inputs)."""
        return [name for b in self.inputs for name in b.targets]

    def parts(self, name: str, parts: list[Any]) -> list[Any]:
        """One input's per-request arrays (or tensors), to concatenate: a ragged input's flattened."""
        return [p.reshape(-1) for p in parts] if name in self.ragged else parts

    def batch_inputs(self, requests: Shapes) -> dict[str, np.ndarray]:
        """Every batch input of the batch, under each of its target names."""
        out: dict[str, np.ndarray] = {}
        for b in self.inputs:
            value = _batch_input(b, [tuple(r[b.source].shape) for r in requests])
            out.update({name: value for name in b.targets})
        return out

    def scatter(self, name: str, value: Any, requests: Shapes) -> list[Any]:
        """A batch output's elements, in request order, each request's shaped as its source input
        says (the output's dims with every -1 taken from that dimension of the input)."""
        spec = self.outputs[name]
        flat = value.reshape(-1)
        pieces, start = [], 0
        for r in requests:
            source = tuple(r[spec.source].shape)
            if any(d == -1 and i >= len(source) for i, d in enumerate(spec.shape)):
                raise ValueError(f"batch output '{name}': its shape {list(spec.shape)} has more dimensions than "
                                 f"input '{spec.source}' {list(source)}")
            shape = [source[i] if d == -1 else d for i, d in enumerate(spec.shape)]
            count = _elements(shape)
            if start + count > flat.shape[0]:
                raise ValueError(f"batch output '{name}' has {flat.shape[0]} elements, fewer than the requests' "
                                 f"'{spec.source}' shapes need")
            pieces.append(flat[start:start + count].reshape(shape))
            start += count
        return pieces


def _batch_input(b: BatchInput, shapes: list[tuple[int, ...]]) -> np.ndarray:
    """The tensor of one batch input, for requests whose source inputs have ``shapes``: the shapes
    Triton's BackendInputCollector gives (no batch dimension added)."""
    counts = [_elements(s) for s in shapes]
    if b.kind == "BATCH_ELEMENT_COUNT":  # [requests]
        return np.array(counts, dtype=b.dtype)
    if b.kind == "BATCH_ACCUMULATED_ELEMENT_COUNT":  # [requests]: where each request's elements end
        return np.cumsum(counts, dtype=np.int64).astype(b.dtype)
    if b.kind == "BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO":  # [requests + 1]: where each starts, then the end
        return np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(b.dtype)
    if b.kind == "BATCH_MAX_ELEMENT_COUNT_AS_SHAPE":  # [max count]: only its shape says something
        return np.zeros(max(counts, default=0), dtype=b.dtype)
    if b.kind not in ("BATCH_ITEM_SHAPE", "BATCH_ITEM_SHAPE_FLATTEN"):
        raise ValueError(f"unsupported batch input kind '{b.kind}'")
    # BATCH_ITEM_SHAPE: [batch size, rank - 1], each batch item's shape without the batch dimension;
    # BATCH_ITEM_SHAPE_FLATTEN: the same values in one dimension.
    rows = [s[1:] for s in shapes for _ in range(s[0] if s else 0)]
    width = len(shapes[0]) - 1 if shapes and shapes[0] else 0
    items = np.array(rows, dtype=b.dtype).reshape(len(rows), width)
    return items.reshape(-1) if b.kind == "BATCH_ITEM_SHAPE_FLATTEN" else items
