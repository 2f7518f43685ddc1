"""KServe v2 HTTP inference bodies: the JSON header and binary tail of a request (Triton's binary
tensor extension, ``Inference-Header-Content-Length``) and the body of a response. The request's
checks and its descriptor are edge/requests.py's, shared with gRPC.
"""
from __future__ import annotations

import json
from typing import Any, Iterable

import numpy as np
import orjson

from shmserve.server.edge.requests import BadRequest, parse_json
from shmserve.shm.answer import AnswerDescriptor
from shmserve.shm.copying import joined
from shmserve.shm.tensors import DTYPES, element_count

def header_size(header_length: str | None, body_len: int) -> int | None:
    """The JSON header's length from ``Inference-Header-Content-Length`` (None: the header is
    absent, the body is all JSON; 0: a raw binary request), with Triton's refusals."""
    if header_length is None:
        return None
    try:
        n = int(header_length)
    except ValueError:  # Triton's atoi would read a raw request: refused, the client meant something else
        raise BadRequest(f"Unable to parse Inference-Header-Content-Length, got: {header_length}") from None
    if n < 0 or n > body_len:
        raise BadRequest(f"inference header size should be in range (0, {body_len}), got: {header_length}")
    return n


def split_body(body: bytes, header_length: str | None) -> tuple[Any, memoryview]:
    """The JSON header and the binary tail of an inference body (not a raw one: ``header_size`` 0).
    The header may be any JSON value: ``build_request`` refuses one that is not an object."""
    view = memoryview(body)
    n = header_size(header_length, len(body))
    head, tail = (view, view[len(body):]) if n is None else (view[:n], view[n:])
    return parse_json(head), tail


def wants_binary(doc: dict) -> dict[str, bool]:
    """Which outputs the client wants as binary data: a named output by its own ``binary_data``
    (JSON when not given, whatever the request says, as Triton), the others ("*") by the
    request's ``binary_data_output``."""
    out = {"*": bool((doc.get("parameters") or {}).get("binary_data_output", False))}
    for o in doc.get("outputs") or ():
        p = o.get("parameters") or {}
        out[o["name"]] = bool(p.get("binary_data", False))
    return out


def output_region_params(doc: dict) -> dict[str, dict]:
    out = {}
    for o in doc.get("outputs") or ():
        p = o.get("parameters") or {}
        if "shared_memory_region" in p:
            out[o["name"]] = {k: v for k, v in p.items() if k.startswith("shared_memory")}
    return out


def json_data(datatype: str, view: memoryview, shape: "list[int] | tuple[int, ...]") -> list:
    if datatype == "BYTES":
        from shmserve.shm.tensors import deserialize_bytes

        return [b.decode("utf-8", errors="replace") for b in deserialize_bytes(view, element_count(shape))]
    if datatype == "BF16":  # the 16 high bits of an FP32: widen the raw words (not their values)
        return (np.frombuffer(view, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).tolist()
    return np.frombuffer(view, dtype=DTYPES[datatype]).tolist()


FLOAT_TYPES = frozenset({"FP16", "BF16", "FP32", "FP64"})


def nonfinite(datatype: str, view: memoryview) -> bool:
    """Whether a float tensor holds a NaN or an infinity: orjson would write them as null, where
    Triton writes NaN, Infinity and -Infinity (which Python's json, tritonclient's, reads back)."""
    if datatype == "BF16":  # all exponent bits set
        return bool(((np.frombuffer(view, dtype=np.uint16) & 0x7F80) == 0x7F80).any())
    if datatype in ("FP16", "FP32", "FP64"):
        return not bool(np.isfinite(np.frombuffer(view, dtype=DTYPES[datatype])).all())
    return False


def dumps(doc: Any, floats: Iterable[tuple[str, memoryview]]) -> bytes:
    """``doc`` as JSON; where a float tensor written in it (``floats``: its datatype and bytes)
    holds a NaN or an infinity, which orjson writes as null, with Python's json, which writes them
    as Triton does (``NaN``, ``Infinity``). orjson alone in the usual case: no null, no second look."""
    body = orjson.dumps(doc)
    if b"null" in body and any(nonfinite(dt, view) for dt, view in floats):
        body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    return body


def build_response(model: str, version: str, request: dict, answer: AnswerDescriptor, tensor_of: Any
                   ) -> tuple[bytes | memoryview, int | None]:
    """(body, JSON header length when binary data follows) of a KServe v2 infer response; a large
    body is a memoryview (copied on every core: shm/copying.py)."""
    binary = wants_binary(request)
    regions = output_region_params(request)
    outputs = []
    blobs: list = []
    floats: list = []  # (datatype, bytes) of the float outputs written as JSON
    for o in answer.outputs:
        name = o.name
        entry: dict[str, Any] = {"name": name, "datatype": o.datatype, "shape": o.shape}
        if o.in_region:
            entry["parameters"] = regions.get(name, {})
        elif binary.get(name, binary["*"]):
            entry["parameters"] = {"binary_data_size": o.size}
            blobs.append(tensor_of(o))
        else:
            view = tensor_of(o)
            entry["data"] = json_data(o.datatype, view, o.shape)
            if o.datatype in FLOAT_TYPES:
                floats.append((o.datatype, view))
        outputs.append(entry)
    resp: dict[str, Any] = {"model_name": model, "model_version": version}
    if request.get("id"):  # (Triton leaves an empty id out)
        resp["id"] = str(request["id"])
    if answer.params:
        resp["parameters"] = answer.params
    resp["outputs"] = outputs
    head = dumps(resp, floats)
    if not blobs:
        return head, None
    return joined([head, *blobs]), len(head)
