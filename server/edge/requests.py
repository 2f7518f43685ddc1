"""A KServe v2 inference request checked and turned into the request descriptor (shm/descriptor.py),
with Triton's refusals word for word: ``build_request`` reads the JSON document of an HTTP body (or
of a generate request); gRPC reads its message with the same checks (grpc/requests.py). HTTP's
body framing is in frontend/codec.py."""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import orjson

from shmserve.shm.descriptor import SEQUENCE_END, SEQUENCE_START, InferRequest, InputTensor, RequestedOutput
from shmserve.shm.tensors import DTYPES, byte_view, element_count, itemsize, serialize_bytes
from shmserve.signature import request_tag

MAX_JSON_DEPTH = 64
# orjson refuses documents nested deeper than this (arrays and objects); see parse_json.
ORJSON_MAX_DEPTH = 1024
# Default --http-max-tensor-elements: no input tensor may declare more elements than this.
MAX_TENSOR_ELEMENTS = 1 << 31
# Triton's wire integers are at most 64-bit: shapes are int64, sequence ids uint64.
INT64_MAX = (1 << 63) - 1
INT64_MIN = -(1 << 63)
UINT64_MAX = (1 << 64) - 1
UINT32_MAX = (1 << 32) - 1
# Request parameters the server consumes itself; the rest reach the model (as Triton does).
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "binary_data_output", "headers"})


class BadRequest(Exception):
    status = 400


class JsonTypeError(BadRequest):
    """A JSON value of the wrong type, in TritonJson's words. Triton answers these 500 (its JSON
    library tags every error INTERNAL); they are the client's mistake, so they are 400 here
    (docs/compatibility.md)."""

    status = 400


def parse_json(data: bytes | memoryview, what: str = "the request JSON buffer") -> Any:
    """orjson.loads with every failure a BadRequest, and a clear word for bodies nested too deeply."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        special = _with_nan(data) if e.doc.startswith(("NaN", "Infinity"), e.pos) else None
        if special is not None:
            return special
        if "depth limit" in str(e):
            raise BadRequest(f"failed to parse {what}: JSON nested deeper than {ORJSON_MAX_DEPTH} levels "
                             f"({e})") from None
        raise BadRequest(f"failed to parse {what}: {e}") from None


def _with_nan(data: bytes | memoryview) -> Any:
    """The document read by Python's json, which also takes NaN, Infinity and -Infinity as numbers
    (as Triton's parser does, and as tritonclient's json.dumps writes them); orjson refused the
    document where one of them stands. Anything else orjson refuses is still refused: the body
    must be UTF-8 (no byte order mark), a number too large for a double is refused, and so are lone
    surrogates. None when Python's json refuses the document too."""
    try:
        doc = json.loads(bytes(data).decode("utf-8"), parse_float=_finite_float)
        orjson.dumps(doc)  # (orjson refuses lone surrogates in strings, Python's json keeps them)
    except (ValueError, RecursionError, TypeError, orjson.JSONEncodeError):
        return None
    return doc


def _finite_float(text: str) -> float:
    value = float(text)
    if math.isinf(value):  # 1e400: orjson refuses it ("number is infinity when parsed as double")
        raise ValueError(f"number is infinity when parsed as double: {text}")
    return value


def _flatten(data: Any, depth: int = 0) -> list:
    if depth > MAX_JSON_DEPTH:
        raise BadRequest("'data' is nested too deeply")
    if isinstance(data, list) and data and isinstance(data[0], list):
        out: list = []
        for item in data:
            if not isinstance(item, list):
                raise BadRequest("'data' mixes nested lists and scalars")
            out.extend(_flatten(item, depth + 1))
        return out
    return data if isinstance(data, list) else [data]


def json_tensor_bytes(name: str, datatype: str, shape: list[int], data: Any) -> bytes | memoryview:
    """The wire bytes of a tensor given as JSON ``data``."""
    flat = _flatten(data)
    count = element_count(shape)
    if len(flat) != count:
        raise BadRequest(f"unexpected number of elements for input '{name}': shape {shape} holds {count}, "
                         f"'data' has {len(flat)}")
    try:
        if datatype == "BYTES":  # strings in JSON (Triton's parser takes nothing else)
            if not all(isinstance(x, str) for x in flat):
                raise BadRequest(f"input '{name}': BYTES data must be strings")
            arr = np.empty(len(flat), dtype=np.object_)
            arr[:] = [x.encode("utf-8", "surrogatepass") for x in flat]
            return serialize_bytes(arr)
        if datatype == "BF16":
            f32 = np.asarray(flat, dtype=np.float32)
            return byte_view((f32.view(np.uint32) >> 16).astype(np.uint16))
        if datatype == "BOOL":
            if not all(isinstance(x, bool) for x in flat):
                raise BadRequest(f"input '{name}': BOOL data must be true or false")
        elif datatype[0] in "IU":  # integers only: numpy would silently cut 1.5 to 1
            if not all(type(x) is int for x in flat):
                raise BadRequest(f"input '{name}': {datatype} data must be integers")
        elif any(isinstance(x, (str, list, dict)) or x is None for x in flat):
            raise BadRequest(f"input '{name}': {datatype} data must be numbers")
        arr = np.asarray(flat, dtype=DTYPES[datatype])
    except OverflowError:  # numpy's text names Python's C types
        raise BadRequest(f"unable to parse 'data' of input '{name}' as {datatype}: a value is out of its "
                         f"range") from None
    except (ValueError, TypeError) as e:
        raise BadRequest(f"unable to parse 'data' of input '{name}' as {datatype}: {e}") from None
    return byte_view(arr)


def _shape(name: str, raw: Any, datatype: str, max_elements: int = MAX_TENSOR_ELEMENTS,
           json_body: bool = False) -> list[int]:
    """A valid input shape: non-negative int64 dimensions whose elements stay within the limit
    (checked before anything is allocated for the tensor). ``json_body``: the shape came in an
    HTTP body, where Triton reads each dimension as an unsigned integer (its words for one that is not)."""
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in raw):
        raise BadRequest(f"input '{name}': 'shape' must be a list of integers")
    if any(d < 0 or d > UINT64_MAX for d in raw):
        if json_body:
            raise BadRequest(f"Unable to parse 'shape': attempt to access JSON non-unsigned-integer as "
                             f"unsigned-integer (input '{name}' has shape {raw})")
        raise BadRequest(f"input '{name}': 'shape' {raw} has a negative dimension")
    if len(raw) > 64:
        raise BadRequest(f"input '{name}': 'shape' has {len(raw)} dimensions, more than the 64 allowed")
    count = element_count(raw)
    if count > INT64_MAX or any(d > INT64_MAX for d in raw):
        shape_text = "[" + ",".join(str(d) for d in raw) + "]"
        raise BadRequest(f"invalid shape for input '{name}': shape {shape_text} causes total element count to "
                         f"exceed maximum size of {INT64_MAX}")
    size = itemsize(datatype)
    if size > 1 and count > INT64_MAX // size:
        raise BadRequest(f"byte size overflow for input '{name}': element count ({count}) * data type size "
                         f"({size}) exceeds maximum allowed size ({INT64_MAX})")
    if count > max_elements or any(d > max_elements for d in raw):  # (a 0 dimension zeroes the count)
        raise BadRequest(f"input '{name}': shape {raw} declares more than {max_elements} elements "
                         f"(--http-max-tensor-elements)")
    return raw


def _region_name(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'shared_memory_region' of '{name}' must be a non-empty string")
    return value


def _params(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"{what}: 'parameters' must be a JSON object")
    return value


def _bool_param(params: dict, key: str, what: str) -> None:
    if key in params and not isinstance(params[key], bool):
        raise BadRequest(f"{what}: parameter '{key}' must be true or false")


def build_request(model: str, version: str, doc: dict, tail: memoryview | int,
                  max_elements: int = MAX_TENSOR_ELEMENTS, json_body: bool = False) -> tuple[InferRequest, list]:
    """The request descriptor and the tensor chunks (views into the body; no copy yet). ``tail``
    may be only the binary tail's length, for a body still arriving: its chunks are then None.
    ``json_body``: the document came as an HTTP body (some refusals then read as Triton's HTTP ones)."""
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):  # empty for a model that declares no inputs, as Triton takes it
        raise BadRequest("the request must have an 'inputs' list")
    params = doc.get("parameters") or {}
    if not isinstance(params, dict):
        raise BadRequest("'parameters' must be a JSON object")
    if "id" in doc and not isinstance(doc["id"], str):
        raise BadRequest("the request 'id' must be a string")
    chunks: list = []
    out_inputs: list[InputTensor] = []
    tail_len = tail if isinstance(tail, int) else len(tail)
    pos = 0  # position in the binary tail
    rel = 0  # offset of the next tensor in our arena block
    for t in inputs:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadRequest("each input must be an object with a 'name'")
        name = t["name"]
        datatype = t.get("datatype")
        if not isinstance(datatype, str) or datatype not in DTYPES:
            raise BadRequest(f"invalid datatype for input {name}")  # Triton's HTTP words
        shape = _shape(name, t.get("shape"), datatype, max_elements, json_body)
        tparams = _params(t.get("parameters"), f"input '{name}'")
        if ("data" in t) + ("binary_data_size" in tparams) + ("shared_memory_region" in tparams) != 1:
            raise BadRequest(_content_fields_text(t, tparams))
        if "shared_memory_region" in tparams:
            region, offset, size = region_fields(tparams, name)
            desc = InputTensor(name, datatype, shape, size, region=region, offset=offset)
        else:
            if "binary_data_size" in tparams:
                n = _nonneg(tparams["binary_data_size"], name, "binary_data_size")
                if pos + n > tail_len:
                    raise BadRequest(f"unexpected end of the request body: input '{name}' needs {n} bytes at "
                                     f"{pos}, the binary data holds {tail_len}")
                chunk = None if isinstance(tail, int) else tail[pos:pos + n]
                pos += n
            else:
                chunk = json_tensor_bytes(name, datatype, shape, t["data"])
                n = len(chunk)
            check_data_size(model, doc.get("id", ""), name, datatype, shape, n)
            desc = InputTensor(name, datatype, shape, n, rel)
            chunks.append(chunk)
            rel += n
        out_inputs.append(desc)
    if pos != tail_len:
        raise BadRequest(f"the request body has {tail_len - pos} bytes of binary data that no input claims")
    outputs: list[RequestedOutput] | None = None
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise BadRequest("'outputs' must be a list")
        outputs = []
        named: set[str] = set()
        for o in doc["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise BadRequest("each requested output must be an object with a 'name'")
            op = _params(o.get("parameters"), f"output '{o['name']}'")
            outputs.append(output_descriptor(o["name"], op, doc.get("id", ""), named))
    req = InferRequest(model, version, out_inputs, outputs, doc.get("id", ""))
    if params:
        add_request_parameters(req, params)
    return req, chunks


def _queue_option(params: dict, key: str) -> int:
    """Triton's ``priority`` and ``timeout`` (microseconds): unsigned 64-bit integers."""
    value = params.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= UINT64_MAX:
        raise BadRequest(f"'{key}' must be a non-negative integer")
    return value


def _nonneg(value: Any, name: str, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= UINT64_MAX:
        raise BadRequest(f"'{field}' of '{name}' must be a non-negative integer")
    return value


# -- The pieces of a request, checked one at a time: ``build_request`` uses them, and so does a
# frontend that builds the descriptor from its own message (gRPC's protobuf, grpc/requests.py).

def check_shape(name: str, shape: list[int], datatype: str, max_elements: int = MAX_TENSOR_ELEMENTS) -> list[int]:
    """``shape`` of input ``name`` checked as ``build_request`` checks it (the dimensions, the
    element and byte counts, the element limit); raises BadRequest."""
    return _shape(name, shape, datatype, max_elements)


def _content_fields_text(tensor: dict, params: dict) -> str:
    """Triton's refusal of an input that gives its content in none or several of the three ways."""
    given = [f"'{k}'" for k, present in (("data", "data" in tensor), ("binary_data_size", "binary_data_size" in params),
                                          ("shared_memory_region", "shared_memory_region" in params)) if present]
    return ("Input must set only one of the following fields: 'data', 'binary_data_size' in 'parameters', "
            "'shared_memory_region' in 'parameters'. But " + (f"set {' '.join(given)}" if given else "no field is set"))


def region_fields(params: dict, name: str) -> tuple[str, int, int]:
    """The region, offset and byte size of a tensor whose parameters name a shared-memory region."""
    return (_region_name(params["shared_memory_region"], name),
            _nonneg(params.get("shared_memory_offset", 0), name, "shared_memory_offset"),
            _nonneg(params.get("shared_memory_byte_size"), name, "shared_memory_byte_size"))


def check_data_size(model: str, request_id: str, name: str, datatype: str, shape: list[int], size: int) -> None:
    """Input ``name``'s ``size`` bytes (not in a region) fit its shape: exactly for a fixed-size
    datatype (Triton's text), at least a 4-byte length per element for BYTES."""
    count = element_count(shape)
    if datatype != "BYTES":
        expected = count * itemsize(datatype)
        if size != expected:
            raise BadRequest(f"{request_tag(request_id)}input byte size mismatch for input '{name}' "
                             f"for model '{model}'. Expected {expected}, got {size}")
    elif count * 4 > size:  # every BYTES element has a 4-byte length prefix
        raise BadRequest(f"input '{name}': shape {shape} of BYTES needs at least {count * 4} "
                         f"bytes (a 4-byte length per element), the data has {size}")


def output_descriptor(name: str, params: dict, request_id: str, named: set[str]) -> RequestedOutput:
    """Requested output ``name`` with its ``params`` (``named``: the outputs requested before it,
    to which it is added): where it goes, and Triton's classification count."""
    if name in named:  # Triton's core refuses it (one answer per output name)
        raise BadRequest(f"{request_tag(request_id)}output '{name}' already exists in request")
    named.add(name)
    _bool_param(params, "binary_data", f"output '{name}'")
    od = RequestedOutput(name)
    if params.get("classification") is not None:  # Triton's classification extension: the top N
        count = params["classification"]
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= UINT32_MAX:
            raise BadRequest(f"output '{name}': 'classification' must be a non-negative integer")
        od.classes = count
    if "shared_memory_region" in params:
        od.region, od.offset, od.size = region_fields(params, name)
    return od


def add_request_parameters(req: InferRequest, params: dict) -> None:
    """The request ``params`` into ``req``: the model's own parameters, and the sequence,
    priority and timeout ones the server reads."""
    for key in ("sequence_start", "sequence_end", "binary_data_output"):
        _bool_param(params, key, "the request")
    model_params = {}
    for key, value in params.items():
        if key in RESERVED_PARAMETERS:
            continue
        if not isinstance(value, (bool, int, float, str)):
            raise BadRequest(f"parameter '{key}' must be a bool, a number or a string")
        if isinstance(value, float) and not math.isfinite(value):  # (the descriptor's JSON has no NaN)
            raise BadRequest(f"parameter '{key}' must be a finite number, got {value}")
        model_params[key] = value
    if model_params:
        req.parameters = model_params
    if "sequence_id" in params:
        corr = params["sequence_id"]
        if not isinstance(corr, (int, str)) or isinstance(corr, bool) or \
                (isinstance(corr, int) and not 0 <= corr <= UINT64_MAX):
            raise BadRequest("'sequence_id' must be an unsigned 64-bit integer or a string")
        req.sequence_id = corr
    req.sequence_flags = (SEQUENCE_START if params.get("sequence_start") else 0) | \
        (SEQUENCE_END if params.get("sequence_end") else 0)
    req.priority = _queue_option(params, "priority")
    req.timeout_us = _queue_option(params, "timeout")
