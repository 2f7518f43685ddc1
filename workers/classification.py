"""Triton's classification extension: an output asked for with ``classification: N`` comes back
as its top N classes, each a string ``<value>:<index>[:<label>]`` (BYTES), instead of the tensor.

As Triton does: integer and FP32/FP64 outputs only; the N highest values of each batch row (of
the whole tensor for a model without a batch dimension), highest first and equal values in index
order; N is cut to the number of classes; floats print with six decimals; the label is the line
of the output's ``label_filename`` (in the model's directory) at that index, when the file has one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shmserve.shm.tensors import wire_datatype

# The datatypes Triton classifies (its TopkClassifications): no BOOL, FP16, BF16 or BYTES.
CLASSIFIABLE = {np.dtype(t) for t in (np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16, np.int32,
                                      np.int64, np.float32, np.float64)}
# Newer Triton refuses to rank more values than this per batch row; here it also bounds what one
# request costs the broker's loop, which classifies ensemble outputs.
MAX_CLASSIFIED_ELEMENTS = 1_000_000


class ClassificationError(ValueError):
    """An output that cannot be classified (answered as a 400)."""


def unsupported_type(datatype: str) -> ClassificationError:
    """Triton's refusal of an output of a datatype it does not classify."""
    return ClassificationError(f"class result not available for output due to unsupported type '{datatype}'")


def load_labels(config: dict[str, Any], model_dir: Path) -> dict[str, list[str]]:
    """The labels of every output that names a ``label_filename``; a file that cannot be read
    fails the load, as in Triton."""
    labels = {}
    for output in config.get("output", []):
        filename = output.get("label_filename")
        if filename:
            path = model_dir / filename
            try:
                labels[output["name"]] = path.read_text(encoding="utf-8").splitlines()
            except OSError as e:  # Triton's words
                raise ValueError(f"failed to open text file for read {path}: {e.strerror}") from None
    return labels


def classify(name: str, arr: np.ndarray, count: int, batched: bool, labels: list[str] | None) -> np.ndarray:
    """The top ``count`` classes of ``arr`` as an object array of bytes: [batch, count] or [count]."""
    if arr.dtype not in CLASSIFIABLE:
        raise unsupported_type(_datatype(arr))
    rows = arr.reshape(arr.shape[0], -1) if batched and arr.ndim else arr.reshape(1, -1)
    if rows.shape[1] > MAX_CLASSIFIED_ELEMENTS:
        raise ClassificationError("classification output tensor too large")
    count = min(count, rows.shape[1])
    order = _top_indices(-rows.astype(np.float64), count)
    floating = arr.dtype.kind == "f"
    out = np.empty((rows.shape[0], count), dtype=object)
    for r, row in enumerate(order):
        for c, index in enumerate(row.tolist()):
            value = rows[r, index]
            text = f"{float(value):f}:{index}" if floating else f"{int(value)}:{index}"
            if labels is not None and index < len(labels):
                text += f":{labels[index]}"
            out[r, c] = text.encode()
    return out if batched else out.reshape(count)


def _datatype(arr: np.ndarray) -> str:
    try:
        return wire_datatype(arr)
    except ValueError:
        return str(arr.dtype)


def _top_indices(negated: np.ndarray, count: int) -> np.ndarray:
    """The indices of each row's ``count`` smallest values (of the negated tensor: its largest),
    equal values in index order: a stable sort, of only the values that can make the cut when
    there are many (ranking a large output costs the broker's loop, which classifies ensembles')."""
    width = negated.shape[1]
    if count == 0 or count * 8 >= width:
        return np.argsort(negated, axis=1, kind="stable")[:, :count]
    cut = np.partition(negated, count - 1, axis=1)[:, count - 1]
    out = np.empty((negated.shape[0], count), dtype=np.int64)
    for r, row in enumerate(negated):
        if np.isnan(cut[r]):  # fewer values than asked for are numbers: NaNs rank last, as in the full sort
            out[r] = np.argsort(row, kind="stable")[:count]
            continue
        candidates = np.flatnonzero(row <= cut[r])  # ascending: ties stay in index order
        out[r] = candidates[np.argsort(row[candidates], kind="stable")[:count]]
    return out
