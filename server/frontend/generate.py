"""Triton's generate extension: ``/generate`` and ``/generate_stream`` (server-sent events).

The body is a flat JSON object: keys that name model inputs become tensors (a scalar or a string
becomes a one-element tensor, a list a tensor of its length; a batching model gets a batch of
one), ``parameters`` and any other key become request parameters. Each response is a flat JSON
object of the outputs: one-element tensors become scalars (BYTES as text), others lists.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shm.tensors import CONFIG_TO_WIRE, DTYPES, deserialize_bytes, element_count, serialize_bytes

from .codec import BadRequest


def build_generate_request(model: str, version: str, body: Any, config: dict) -> tuple[dict, list]:
    if not isinstance(body, dict):
        raise BadRequest("the generate request must be a JSON object")
    specs = {t["name"]: t for t in config.get("input", [])}
    batched = int(config.get("max_batch_size", 0)) > 0
    raw_params = body.get("parameters") or {}
    if not isinstance(raw_params, dict):
        raise BadRequest("the generate request's 'parameters' must be a JSON object")
    params = dict(raw_params)
    inputs, chunks, rel = [], [], 0
    for key, value in body.items():
        if key in ("parameters", "id"):
            continue
        spec = specs.get(key)
        if spec is None:
            if isinstance(value, (bool, int, float, str)):
                params[key] = value
            continue
        datatype = CONFIG_TO_WIRE.get(spec.get("data_type", ""), "")
        if not datatype:
            raise BadRequest(f"input '{key}' has an unsupported data type")
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, (dict, list)) or v is None for v in values):
            raise BadRequest(f"input '{key}': a generate input is a scalar or a flat list of scalars")
        try:
            if datatype == "BYTES":
                arr = np.empty(len(values), dtype=object)
                arr[:] = [v.encode() if isinstance(v, str) else str(v).encode() for v in values]
                data: Any = serialize_bytes(arr)
            else:
                arr = np.asarray(values, dtype=DTYPES[datatype])
                data = arr.tobytes()
        except (TypeError, ValueError, OverflowError) as e:
            raise BadRequest(f"input '{key}': cannot read {value!r} as {datatype}: {e}") from None
        shape = ([1] if batched else []) + list(arr.shape)
        inputs.append({"name": key, "datatype": datatype, "shape": shape, "data": rel, "size": len(data)})
        chunks.append(data)
        rel += len(data)
    missing = [n for n, s in specs.items() if n not in body and not s.get("optional")]
    if missing:
        raise BadRequest(f"the generate request lacks input(s) {missing} of model '{model}'")
    req: dict[str, Any] = {"model": model, "version": version, "inputs": inputs, "outputs": None}
    if "id" in body:
        if not isinstance(body["id"], str):
            raise BadRequest("the generate request 'id' must be a string")
        req["id"] = body["id"]
    if params:
        req["params"] = {k: v for k, v in params.items() if isinstance(v, (bool, int, float, str))}
    return req, chunks


def generate_response(model: str, result: dict, tensor_of: Any) -> dict:
    out: dict[str, Any] = {"model_name": model, "model_version": str(result.get("version", ""))}
    for o in result.get("outputs", ()):
        view = tensor_of(o)
        if o["datatype"] == "BYTES":
            values: list = [b.decode("utf-8", errors="replace")
                            for b in deserialize_bytes(view, element_count(o["shape"]))]
        else:
            values = np.frombuffer(view, dtype=DTYPES[o["datatype"]]).tolist()
        out[o["name"]] = values[0] if len(values) == 1 else values
    return out
