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
from shmserve.shm.tensors import (DTYPES, BytesFraming, byte_view, bytes_count_words, element_count, itemsize,
                                  serialize_bytes)
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
# Request parameters the server consumes itself; the rest reach the model (as Triton does). Over
# gRPC, Triton 2.51 reads no binary_data_output (an HTTP word: it reaches the model) and takes
# triton_enable_empty_final_response for its stream (the model never sees it); "headers" is
# reserved by Triton's docs (extension_parameters.md), and kept from the model over both.
EMPTY_FINAL_PARAMETER = "triton_enable_empty_final_response"
RESERVED_PARAMETERS = frozenset({"sequence_id", "sequence_start", "sequence_end", "priority", "timeout",
                                 "binary_data_output", "headers"})
GRPC_RESERVED_PARAMETERS = RESERVED_PARAMETERS - {"binary_data_output"} | {EMPTY_FINAL_PARAMETER}


class BadRequest(Exception):
    status = 400


class JsonTypeError(BadRequest):
    """A JSON value of the wrong type, in TritonJson's words. Triton answers these 500 (its JSON
    library tags every error INTERNAL); they are the client's mistake, so they are 400 here
    (docs/compatibility.md)."""

    status = 400


# TritonJson's words for a JSON value of the wrong type (Triton's ``Unable to parse 'KEY': ...``).
NOT_ARRAY = "attempt to access JSON non-array as array"
NOT_STRING = "attempt to access JSON non-string as string"
NOT_UINT = "attempt to access JSON non-unsigned-integer as unsigned-integer"
NOT_INT = "attempt to access JSON non-signed-integer as signed-integer"
NOT_BOOL = "attempt to access JSON non-boolean as boolean"
NOT_NUMBER = "attempt to access JSON non-number as double"
NOT_OBJECT = "attempt to get members for non-object"
SHAPE_MISMATCH = "Shape does not match true shape of 'data' field"


def not_member(key: str) -> str:
    return f"attempt to access non-existing object member '{key}'"


def unable_to_parse(key: str, words: str) -> JsonTypeError:
    """Triton's refusal of member ``key`` of an HTTP request that is missing or of the wrong type."""
    return JsonTypeError(f"Unable to parse '{key}': {words}")


def is_uint(value: Any) -> bool:
    """Whether TritonJson reads ``value`` as an unsigned 64-bit integer."""
    return type(value) is int and 0 <= value <= UINT64_MAX


def json_value_error(datatype: str, values: list) -> str | None:
    """TritonJson's words for the first of ``values`` that is not of the JSON type ``datatype``
    reads (None: all are)."""
    for v in values:
        if datatype == "BOOL":
            if not isinstance(v, bool):
                return NOT_BOOL
        elif datatype[0] == "U":
            if not is_uint(v):
                return NOT_UINT
        elif datatype[0] == "I":
            if type(v) is not int or not INT64_MIN <= v <= INT64_MAX:
                return NOT_INT
        elif (datatype[0] == "F" or datatype == "BF16") and (not isinstance(v, (int, float)) or isinstance(v, bool)):
            return NOT_NUMBER
    return None


def bytes_count_text(model: str, request_id: str, name: str, expected: int, got: int) -> str:
    """Triton's refusal of a BYTES input whose data holds ``got`` elements where its shape holds
    ``expected`` (shm/tensors.py ``bytes_count_words``)."""
    return bytes_count_words(request_tag(request_id), model, name, expected, got)


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


def _flatten(data: list, depth: int = 0) -> list:
    if depth > MAX_JSON_DEPTH:
        raise BadRequest("'data' is nested too deeply")
    if data and isinstance(data[0], list):
        out: list = []
        for item in data:
            if not isinstance(item, list):
                raise BadRequest("'data' mixes nested lists and scalars")
            out.extend(_flatten(item, depth + 1))
        return out
    return data


def json_tensor_bytes(name: str, datatype: str, shape: list[int], data: Any, model: str = "",
                      request_id: str = "") -> bytes | memoryview:
    """The wire bytes of a tensor given as JSON ``data`` (a list, nested or not), refused in
    Triton's words (``model`` and ``request_id`` name the request in a BYTES count's)."""
    if not isinstance(data, list):
        raise unable_to_parse("data", NOT_ARRAY)
    flat = _flatten(data)
    count = element_count(shape)
    if len(flat) != count:
        raise _data_refusal(name, datatype, flat, count, model, request_id)
    kinds = set(map(type, flat))  # (one pass in C: a Python check per value took seconds for a large body)
    try:
        if datatype == "BYTES":  # strings in JSON (Triton's parser takes nothing else)
            if not kinds <= {str}:
                raise _data_refusal(name, datatype, flat, count, model, request_id)
            arr = np.empty(len(flat), dtype=np.object_)
            arr[:] = [x.encode("utf-8", "surrogatepass") for x in flat]
            return serialize_bytes(arr)
        if datatype == "BOOL":
            if not kinds <= {bool}:
                raise _data_refusal(name, datatype, flat, count, model, request_id)
        elif datatype[0] in "IU":  # integers only (not true or false): numpy would silently cut 1.5 to 1
            if not kinds <= {int}:
                raise _data_refusal(name, datatype, flat, count, model, request_id)
        elif not kinds <= {int, float}:  # numbers only: true or false is no number to TritonJson's AsDouble
            raise _data_refusal(name, datatype, flat, count, model, request_id)
        if datatype == "BF16":
            f32 = np.asarray(flat, dtype=np.float32)
            return byte_view((f32.view(np.uint32) >> 16).astype(np.uint16))
        arr = np.asarray(flat, dtype=DTYPES[datatype])
    except OverflowError:  # numpy's text names Python's C types
        words = json_value_error(datatype, flat)  # past 64 bits: Triton's words
        if words:
            raise unable_to_parse("data", words) from None
        raise BadRequest(f"unable to parse 'data' of input '{name}' as {datatype}: a value is out of its "
                         f"range") from None
    except (ValueError, TypeError) as e:
        words = json_value_error(datatype, flat)
        if words:
            raise unable_to_parse("data", words) from None
        raise BadRequest(f"unable to parse 'data' of input '{name}' as {datatype}: {e}") from None
    return byte_view(arr)


def _data_refusal(name: str, datatype: str, flat: list, count: int, model: str, request_id: str) -> BadRequest:
    """Triton's refusal of JSON ``data`` whose values are of the wrong type or whose count is not
    the shape's ``count``: its parser reads the values in order and stops at the first of the
    wrong type or at the one past ``count``; BYTES strings are all read first, and their count is
    the core's check."""
    if datatype == "BYTES":
        if not all(isinstance(x, str) for x in flat):
            return JsonTypeError(f"Unable to parse JSON bytes array: {NOT_STRING}")
        return BadRequest(bytes_count_text(model, request_id, name, count, len(flat)))
    for v in flat[:count]:
        words = json_value_error(datatype, [v])
        if words:
            return unable_to_parse("data", words)
    return unable_to_parse("data", SHAPE_MISMATCH)


class NegativeShape(BadRequest):
    """An input shape with a negative dimension: Triton's gRPC frontend lets it reach its core,
    which refuses it as a shape the model does not take (``server/grpc/infer.py`` words it so)."""

    def __init__(self, name: str, shape: list[int]) -> None:
        super().__init__(f"input '{name}': 'shape' {shape} has a negative dimension")
        self.input_name, self.shape = name, shape


def _shape(name: str, raw: Any, datatype: str, max_elements: int = MAX_TENSOR_ELEMENTS) -> list[int]:
    """A valid input shape: non-negative int64 dimensions whose elements stay within the limit
    (checked before anything is allocated for the tensor)."""
    if not isinstance(raw, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in raw):
        raise BadRequest(f"input '{name}': 'shape' must be a list of integers")
    if any(d < 0 or d > UINT64_MAX for d in raw):
        raise NegativeShape(name, raw)
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


def _bool_param(params: dict, key: str, what: str, json_body: bool = False) -> None:
    if key in params and not isinstance(params[key], bool):
        raise unable_to_parse(key, NOT_BOOL) if json_body else \
            BadRequest(f"{what}: parameter '{key}' must be true or false")


def _input_refusal(t: Any, otherwise: BadRequest) -> BadRequest:
    """Triton's refusal of HTTP input ``t`` that failed a check, in the order Triton checks it
    (which content fields it sets, its name, datatype and shape, then whether it knows the
    datatype); ``otherwise`` when these pass (the check that failed is one of ours)."""
    params = t.get("parameters") if isinstance(t, dict) else None
    params = params if isinstance(params, dict) else {}
    tensor = t if isinstance(t, dict) else {}
    if ("data" in tensor) + ("binary_data_size" in params) + ("shared_memory_region" in params) != 1:
        return BadRequest(_content_fields_text(tensor, params))
    for key in ("name", "datatype"):
        if key not in tensor:
            return unable_to_parse(key, not_member(key))
        if not isinstance(tensor[key], str):
            return unable_to_parse(key, NOT_STRING)
    shape = tensor.get("shape")
    if "shape" not in tensor:
        return unable_to_parse("shape", not_member("shape"))
    if not isinstance(shape, list):
        return unable_to_parse("shape", NOT_ARRAY)
    if not all(is_uint(d) for d in shape):
        if all(type(d) is int for d in shape):  # (a negative dimension: which input, which shape)
            return JsonTypeError(f"Unable to parse 'shape': {NOT_UINT} (input '{tensor['name']}' has shape {shape})")
        return unable_to_parse("shape", NOT_UINT)
    if tensor["datatype"] not in DTYPES:
        return BadRequest(f"invalid datatype for input {tensor['name']}")  # Triton's HTTP words
    return otherwise


def build_request(model: str, version: str, doc: Any, tail: memoryview | int,
                  max_elements: int = MAX_TENSOR_ELEMENTS) -> tuple[InferRequest, list]:
    """The request descriptor of an HTTP request's JSON document and its tensor chunks (views
    into the body; no copy yet). ``tail`` may be only the binary tail's length, for a body still
    arriving: its chunks are then None. A refusal is Triton's, at the point Triton makes it: the
    id, the request's parameters, then each input and each output (a value of the wrong JSON type
    in TritonJson's words)."""
    if not isinstance(doc, dict):
        raise unable_to_parse("inputs", not_member("inputs"))
    request_id = doc.get("id", "")
    if not isinstance(request_id, str):
        raise unable_to_parse("id", NOT_STRING)
    params = doc.get("parameters")
    req = InferRequest(model, version, [], None, request_id)
    if params is not None:
        if not isinstance(params, dict):
            raise JsonTypeError(f"failed to get request params.: {NOT_OBJECT}")
        if params:
            add_request_parameters(req, params, json_body=True)
    inputs = doc.get("inputs")
    if not isinstance(inputs, list):  # empty for a model that declares no inputs, as Triton takes it
        raise unable_to_parse("inputs", NOT_ARRAY if "inputs" in doc else not_member("inputs"))
    chunks: list = []
    out_inputs = req.inputs
    tail_len = tail if isinstance(tail, int) else len(tail)
    pos = 0  # position in the binary tail
    rel = 0  # offset of the next tensor in our arena block
    for t in inputs:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise _input_refusal(t, BadRequest("each input must be an object with a 'name'"))
        name = t["name"]
        datatype = t.get("datatype")
        if not isinstance(datatype, str) or datatype not in DTYPES:
            raise _input_refusal(t, BadRequest(f"invalid datatype for input {name}"))
        try:
            shape = _shape(name, t.get("shape"), datatype, max_elements)
        except BadRequest as e:
            raise _input_refusal(t, e) from None
        tparams = _params(t.get("parameters"), f"input '{name}'")
        if ("data" in t) + ("binary_data_size" in tparams) + ("shared_memory_region" in tparams) != 1:
            raise BadRequest(_content_fields_text(t, tparams))
        if "shared_memory_region" in tparams:
            region, offset, size = region_fields(tparams, name, json_body=True)
            desc = InputTensor(name, datatype, shape, size, region=region, offset=offset)
        else:
            if "binary_data_size" in tparams:
                n = tparams["binary_data_size"]
                if not is_uint(n):  # (null too: the key is there)
                    raise unable_to_parse("binary_data_size", NOT_UINT)
                if pos + n > tail_len:
                    raise BadRequest(f"unexpected end of the request body: input '{name}' needs {n} bytes at "
                                     f"{pos}, the binary data holds {tail_len}")
                chunk = None if isinstance(tail, int) else tail[pos:pos + n]
                pos += n
            else:
                wrong = region_type_refusal(tparams)  # (Triton reads them beside 'data' too)
                if wrong is not None:
                    raise wrong
                chunk = json_tensor_bytes(name, datatype, shape, t["data"], model, request_id)
                n = len(chunk)
            check_data_size(model, request_id, name, datatype, shape, n, chunk)
            desc = InputTensor(name, datatype, shape, n, rel)
            chunks.append(chunk)
            rel += n
        out_inputs.append(desc)
    if pos != tail_len:
        raise BadRequest(f"the request body has {tail_len - pos} bytes of binary data that no input claims")
    if doc.get("outputs") is not None:
        if not isinstance(doc["outputs"], list):
            raise unable_to_parse("outputs", NOT_ARRAY)
        outputs: list[RequestedOutput] = []
        named: set[str] = set()
        for o in doc["outputs"]:
            clash = _output_region_refusal(o.get("parameters")) if isinstance(o, dict) else None
            if clash is not None:  # (Triton's first look at an output, before its name)
                raise clash
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise unable_to_parse("name", NOT_STRING if isinstance(o, dict) and "name" in o else
                                      not_member("name"))
            op = _params(o.get("parameters"), f"output '{o['name']}'")
            outputs.append(output_descriptor(o["name"], op, request_id, named, json_body=True))
        req.outputs = outputs
    return req, chunks


def _queue_option(params: dict, key: str) -> int:
    """Triton's ``priority`` and ``timeout`` (microseconds): unsigned 64-bit integers."""
    value = params.get(key, 0)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= UINT64_MAX:
        raise BadRequest(f"'{key}' must be a non-negative integer")
    return value


def _nonneg(value: Any, name: str, field: str, json_body: bool = False) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= UINT64_MAX:
        if json_body and value is not None:
            raise unable_to_parse(field, NOT_UINT)
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


def region_type_refusal(params: dict) -> JsonTypeError | None:
    """TritonJson's refusal of an HTTP tensor's region parameter that is there (null too) with a
    value of the wrong type: Triton reads each one present, whether or not a region is named (an
    input's beside its 'data', an output's without a region)."""
    if "shared_memory_region" in params and not isinstance(params["shared_memory_region"], str):
        return unable_to_parse("shared_memory_region", NOT_STRING)
    for key in ("shared_memory_offset", "shared_memory_byte_size"):
        if key in params and not is_uint(params[key]):
            return unable_to_parse(key, NOT_UINT)
    return None


def region_fields(params: dict, name: str, json_body: bool = False) -> tuple[str, int, int]:
    """The region, offset and byte size of a tensor whose parameters name a shared-memory region
    (``json_body``: of an HTTP request, a value of the wrong type refused in TritonJson's words)."""
    region = params["shared_memory_region"]
    wrong = region_type_refusal(params) if json_body else None
    if wrong is not None:
        raise wrong
    return (_region_name(region, name),
            _nonneg(params.get("shared_memory_offset", 0), name, "shared_memory_offset", json_body),
            _nonneg(params.get("shared_memory_byte_size"), name, "shared_memory_byte_size", json_body))


def check_data_size(model: str, request_id: str, name: str, datatype: str, shape: list[int], size: int,
                    data: Any = None) -> None:
    """Input ``name``'s ``size`` bytes (not in a region) fit its shape: exactly for a fixed-size
    datatype, at least a 4-byte length per element for BYTES (Triton's texts; ``data``, the
    bytes if at hand, lets a BYTES refusal count the elements as Triton does)."""
    count = element_count(shape)
    if datatype != "BYTES":
        expected = count * itemsize(datatype)
        if size != expected:
            raise BadRequest(f"{request_tag(request_id)}input byte size mismatch for input '{name}' "
                             f"for model '{model}'. Expected {expected}, got {size}")
    elif count * 4 > size:  # every BYTES element has a 4-byte length prefix
        if data is None:
            raise BadRequest(f"input '{name}': shape {shape} of BYTES needs at least {count * 4} "
                             f"bytes (a 4-byte length per element), the data has {size}")
        raise BadRequest(bytes_framing_text(model, request_id, name, count, data))


def bytes_framing_text(model: str, request_id: str, name: str, count: int, data: Any) -> str:
    """Triton's refusal of BYTES ``data`` of input ``name`` that does not hold ``count`` elements
    (run only on a refusal)."""
    return BytesFraming(data, count).for_input(request_tag(request_id), model, name)


def output_descriptor(name: str, params: dict, request_id: str, named: set[str],
                      json_body: bool = False) -> RequestedOutput:
    """Requested output ``name`` with its ``params`` (``named``: the outputs requested before it,
    to which it is added): where it goes, and Triton's classification count. ``json_body``: of an
    HTTP request (Triton's HTTP words), else of a gRPC one (its gRPC words)."""
    if name in named:  # Triton's core refuses it (one answer per output name)
        raise BadRequest(f"{request_tag(request_id)}output '{name}' already exists in request")
    named.add(name)
    od = RequestedOutput(name)
    if json_body:
        _json_output_fields(od, params)
        return od
    if params.get("classification") is not None:  # Triton's classification extension: the top N
        count = params["classification"]
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= UINT32_MAX:
            raise _classification_refusal(name, count, json_body)
        od.classes = count
    if "shared_memory_region" in params:
        od.region, od.offset, od.size = region_fields(params, name, json_body)
    _bool_param(params, "binary_data", f"output '{name}'")
    if "shared_memory_region" in params:  # Triton's gRPC refusals
        clash = "classification" if params.get("classification") is not None else \
            "binary_data" if params.get("binary_data") is True else None
        if clash is not None:
            raise BadRequest(f"output can't set both 'shared_memory_region' and '{clash}'")
    return od


def _output_region_refusal(params: Any) -> BadRequest | None:
    """Triton's refusal of an HTTP output whose ``params`` name a region beside a classification
    or binary data (any value: TritonJson's Find), checked before anything else of the output."""
    if not isinstance(params, dict) or "shared_memory_region" not in params:
        return None
    if "classification" in params:
        return BadRequest("Output can't set both 'shared_memory_region' and 'classification'")
    if "binary_data" in params:
        if not isinstance(params["binary_data"], bool):
            return JsonTypeError(f"Unable to set 'binary_data': {NOT_BOOL}")
        if params["binary_data"]:
            return BadRequest("Output can't set both 'shared_memory_region' and 'binary_data'")
    return None


def _json_output_fields(od: RequestedOutput, params: dict) -> None:
    """An HTTP output's classification count, region and binary flag into ``od``, in Triton's
    order and words: each parameter that is there is read (null too), whether or not it applies."""
    if "classification" in params:
        count = params["classification"]
        if not is_uint(count) or count > UINT32_MAX:
            raise _classification_refusal(od.name, count, json_body=True)
        od.classes = count
    wrong = region_type_refusal(params)
    if wrong is not None:
        raise wrong
    if "shared_memory_region" in params:
        od.region, od.offset, od.size = region_fields(params, od.name, json_body=True)
    else:
        _bool_param(params, "binary_data", f"output '{od.name}'", json_body=True)


def _classification_refusal(name: str, count: Any, json_body: bool) -> BadRequest:
    if json_body and not is_uint(count):
        return JsonTypeError(f"Unable to set 'classification': {NOT_UINT}")
    if not json_body and (type(count) is not int):
        return BadRequest("invalid value type for 'classification' parameter, expected int64_param")
    if not json_body and count < 0:
        return BadRequest("invalid value for 'classification' parameter, expected >= 0")
    return BadRequest(f"output '{name}': 'classification' must be a non-negative integer")


# gRPC's parameter types for the request parameters Triton reads (its words for a value of another type).
GRPC_PARAMETER_TYPES = {"sequence_id": "int64_param or string_param.", "sequence_start": "bool_param.",
                        "sequence_end": "bool_param.", "priority": "int64_param or uint64_param.",
                        "timeout": "int64_param.", EMPTY_FINAL_PARAMETER: "bool_param."}
_HTTP_PARAMETER_WORDS = {"sequence_id": NOT_STRING, "sequence_start": NOT_BOOL, "sequence_end": NOT_BOOL,
                         "binary_data_output": NOT_BOOL, "priority": NOT_UINT, "timeout": NOT_UINT}


def add_request_parameters(req: InferRequest, params: dict, json_body: bool = False) -> None:
    """The request ``params`` into ``req``: the model's own parameters, and the sequence,
    priority and timeout ones the server reads. ``json_body``: of an HTTP request, else of a
    gRPC one; a refusal names the first wrong parameter in Triton's words for it."""
    reserved = RESERVED_PARAMETERS if json_body else GRPC_RESERVED_PARAMETERS
    try:
        for key in ("sequence_start", "sequence_end", "binary_data_output") if json_body else \
                ("sequence_start", "sequence_end", EMPTY_FINAL_PARAMETER):
            _bool_param(params, key, "the request")
        model_params = {}
        for key, value in params.items():
            if key in reserved:
                continue
            if value is None and not json_body:  # an InferParameter with no value set: Triton's words
                raise BadRequest(f"invalid value type for '{key}' parameter, expected int64_param, bool_param, or "
                                 f"string_param.")
            if not isinstance(value, (bool, int, float, str)):
                raise BadRequest(f"parameter '{key}' must be a bool, a number or a string")
            if isinstance(value, float) and not math.isfinite(value):  # (the descriptor's JSON has no NaN)
                raise BadRequest(f"parameter '{key}' must be a finite number, got {value}")
            if json_body and type(value) is int and not INT64_MIN <= value <= INT64_MAX:
                value = float(value)  # a JSON number past int64 is a double to Triton (as on generate)
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
    except BadRequest as e:
        raise _parameter_refusal(params, json_body, e) from None


def _parameter_refusal(params: dict, json_body: bool, otherwise: BadRequest) -> BadRequest:
    """Triton's refusal of the first parameter (in the request's order) it would refuse;
    ``otherwise`` (ours) when it would take them all."""
    for key, value in params.items():
        if json_body:
            words = _HTTP_PARAMETER_WORDS.get(key)
            if words is None:
                if key not in RESERVED_PARAMETERS and not isinstance(value, (bool, int, float, str)):
                    return BadRequest(f"parameter '{key}' has invalid type. It should be either 'int', 'bool', "
                                      f"or 'string'.")
            elif not (isinstance(value, bool) if words == NOT_BOOL else
                      is_uint(value) or (words == NOT_STRING and isinstance(value, str))):
                return unable_to_parse(key, words)
        elif key in GRPC_PARAMETER_TYPES:
            expected = GRPC_PARAMETER_TYPES[key]
            if expected == "bool_param.":
                fits = isinstance(value, bool)
            else:
                fits = type(value) is int or (expected.endswith("string_param.") and isinstance(value, str))
            if not fits:
                return BadRequest(f"invalid value type for '{key}' parameter, expected {expected}")
            if key == "priority" and value < 0:
                return BadRequest("invalid value for 'priority', expected value >= 0.")
    return otherwise
