"""The tensors each request carries: shapes from the model's metadata with ``-b`` and ``--shape``,
and data that is zeros, random (made once, as perf_analyzer does) or read from an
``--input-data`` JSON file in perf_analyzer's format."""
from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from shmserve.shm.tensors import DTYPES, deserialize_bytes
from shmserve.tools.perf.plan import TensorSpec


def parse_shapes(items: list[str]) -> dict[str, tuple[int, ...]]:
    """``--shape NAME:D1,D2`` (repeatable) to {NAME: (D1, D2)}: the shape without the batch."""
    out: dict[str, tuple[int, ...]] = {}
    for item in items:
        name, sep, dims = item.rpartition(":")
        if not sep or not name or not dims:
            raise ValueError(f"bad --shape {item!r}: expected NAME:D1,D2,...")
        out[name] = tuple(int(d) for d in dims.split(","))
    return out


def tensor_specs(entries: list[dict[str, Any]], batch: int, max_batch_size: int,
                 shapes: dict[str, tuple[int, ...]], unknown: int = 1) -> tuple[TensorSpec, ...]:
    """Metadata tensors to concrete specs. The metadata of a batching model lists the batch
    dimension as -1 first; it becomes ``batch``, and every other -1 takes ``--shape`` (or
    ``unknown``: 1 for inputs; outputs keep -1, the size the server will choose)."""
    specs = []
    for e in entries:
        if e["datatype"] not in DTYPES or e["datatype"] == "BF16":
            raise ValueError(f"tensor {e['name']}: datatype {e['datatype']} is not supported")
        dims = [int(d) for d in e["shape"]]
        lead = [batch] if max_batch_size > 0 else []
        rest = dims[1:] if max_batch_size > 0 and dims else dims
        if e["name"] in shapes:
            given = shapes[e["name"]]
            if len(given) != len(rest) or any(d not in (-1, g) for d, g in zip(rest, given)):
                raise ValueError(f"--shape {e['name']}:{','.join(map(str, given))} does not fit the model's "
                                 f"dims {rest}")
            rest = list(given)
        specs.append(TensorSpec(e["name"], e["datatype"], tuple(lead + [unknown if d < 0 else d for d in rest])))
    return tuple(specs)


def generated(specs: tuple[TensorSpec, ...], mode: str, string_data: str | None, string_length: int
              ) -> dict[str, np.ndarray]:
    """One request's inputs: zeros, or random values (small integers, so that add/sub never
    overflows; strings of ``string_length`` letters, or ``string_data`` repeated)."""
    rng = np.random.default_rng(0)
    out = {}
    for spec in specs:
        dtype = DTYPES[spec.datatype]
        if dtype == np.object_:
            text = string_data if string_data is not None else (
                "" if mode == "zero" else "".join(rng.choice(list("abcdefghij"), string_length)))
            out[spec.name] = np.full(spec.shape, text.encode(), dtype=np.object_)
        elif mode == "zero":
            out[spec.name] = np.zeros(spec.shape, dtype)
        elif dtype == np.bool_:
            out[spec.name] = rng.integers(0, 2, spec.shape).astype(np.bool_)
        elif dtype.kind in "iu":
            out[spec.name] = rng.integers(0, 100, spec.shape).astype(dtype)
        else:
            out[spec.name] = rng.random(spec.shape, dtype=np.float32).astype(dtype)
    return out


def from_json(path: Path, specs: tuple[TensorSpec, ...], batch: int, batched: bool
              ) -> tuple[tuple[dict[str, np.ndarray], ...], ...]:
    """perf_analyzer's ``{"data": [...]}``: a list of steps (one stream) or a list of lists (a
    stream per sequence). Each step gives every input for a batch of one, as a flat list, as
    ``{"b64": ...}``, or as ``{"content": ..., "shape": [...]}``; a batch of ``-b`` repeats it."""
    doc = json.loads(path.read_text())
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected {{\"data\": [...]}} with at least one entry")
    streams = data if all(isinstance(s, list) for s in data) else [data]
    by_name = {s.name: s for s in specs}
    out = []
    for stream in streams:
        steps = []
        for step in stream:
            missing = set(by_name) - set(step)
            if missing:
                raise ValueError(f"{path}: an entry lacks input(s) {sorted(missing)}")
            steps.append({name: _tensor(step[name], by_name[name], batch, batched) for name in by_name})
        out.append(tuple(steps))
    return tuple(out)


def _tensor(value: Any, spec: TensorSpec, batch: int, batched: bool) -> np.ndarray:
    """One input of one JSON step, shaped for a request of ``batch`` (the batch axis first)."""
    dtype = DTYPES[spec.datatype]
    per_item = spec.shape[1:] if batched else spec.shape
    if isinstance(value, dict) and "content" in value:
        per_item, value = tuple(int(d) for d in value["shape"]) if "shape" in value else per_item, value["content"]
    if isinstance(value, dict) and "b64" in value:
        raw = base64.b64decode(value["b64"])
        flat = deserialize_bytes(raw) if dtype == np.object_ else np.frombuffer(raw, dtype="<" + dtype.str[1:]
                                                                                 if dtype.itemsize > 1 else dtype)
    elif dtype == np.object_:
        flat = np.array([v.encode() if isinstance(v, str) else bytes(v) for v in value], dtype=np.object_)
    else:
        flat = np.asarray(value, dtype=dtype)
    count = int(np.prod(per_item, dtype=np.int64))
    if flat.size != count:
        raise ValueError(f"input {spec.name}: {flat.size} values where shape {list(per_item)} needs {count}")
    one = flat.astype(dtype, copy=False).reshape(per_item)
    return np.stack([one] * batch) if batched else one
