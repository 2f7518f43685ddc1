"""Triton's classification extension: an output asked for with ``classification: N`` comes back
as its top N classes, each a string ``<value>:<index>[:<label>]`` (BYTES), instead of the tensor.

As Triton does: the N highest values of each batch row (of the whole tensor for a model without a
batch dimension), highest first and equal values in index order; N is cut to the number of
classes; floats print with six decimals; the label is the line of the output's
``label_filename`` (in the model's directory) at that index, when the file has one.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


class ClassificationError(ValueError):
    """An output that cannot be classified (answered as a 400)."""


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
    if arr.dtype.kind not in "biuf":
        raise ClassificationError(f"output '{name}': classification needs a numeric tensor, not {arr.dtype}")
    rows = arr.reshape(arr.shape[0], -1) if batched and arr.ndim else arr.reshape(1, -1)
    count = min(count, rows.shape[1])
    # Descending by value, equal values in index order: a stable sort of the negated values.
    order = np.argsort(-rows.astype(np.float64), axis=1, kind="stable")[:, :count]
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
