"""A ``ModelInferRequest`` read from its bytes and made straight into the broker's request descriptor
and its tensor chunks.

The one place where the gRPC frontend reads a request message: every check HTTP's
``build_request`` makes (server/edge/requests.py, whose pieces it calls, with Triton's texts),
without first turning the message into a KServe document. Raw tensors stay the protobuf's own
bytes until the connection copies them into the request block; typed ``contents`` are encoded
here. Each ``raw_input_contents`` item is read once: protobuf copies it on every read.

A large message (``read_infer_request``) keeps its raw tensors where grpc received them: protobuf
parses the message without them, and they are views of the received bytes, so a tensor is copied
once, into the request block, instead of three times.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

from shmserve.server.edge.header_forward import add_to_request
from shmserve.server.edge.requests import (BadRequest, add_request_parameters, check_data_size, check_shape,
                                           output_descriptor, region_fields)
from shmserve.shm.descriptor import InferRequest, InputTensor
from shmserve.shm.tensors import DTYPES, byte_view, element_count, serialize_bytes

# The typed ``contents`` field that holds each datatype (FP16 and BF16 travel raw only, as in Triton).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}
_FIELDS = tuple(sorted(set(CONTENTS_FIELD.values())))
# The datatype Triton's gRPC frontend names for each typed field, when an input's data is in another.
FIELD_DATATYPE = {"bool_contents": "BOOL", "int_contents": "INT32", "int64_contents": "INT64",
                  "uint_contents": "UINT32", "uint64_contents": "UINT64", "fp32_contents": "FP32",
                  "fp64_contents": "FP64", "bytes_contents": "BYTES"}
# Past this many elements even a 16-byte element could overflow int64 bytes: the full check decides.
_SURELY_SAFE_COUNT = 1 << 59


# Messages from this size on keep their raw tensors as views of the received bytes.
LARGE_MESSAGE = 64 << 10
RAW_INPUT_FIELD = 7  # ModelInferRequest.raw_input_contents
_WIRE_LENGTH_DELIMITED = 2


class ReceivedRequest:
    """A large ``ModelInferRequest`` as received: the message's fields, its ``raw_input_contents``
    as views of the received bytes (read as the message's by ``descriptor_from_message``)."""

    __slots__ = ("model_name", "model_version", "id", "parameters", "inputs", "outputs", "raw_input_contents")

    def __init__(self, msg: Any, raw: list[memoryview]) -> None:
        self.model_name, self.model_version, self.id = msg.model_name, msg.model_version, msg.id
        self.parameters, self.inputs, self.outputs = msg.parameters, msg.inputs, msg.outputs
        self.raw_input_contents = raw


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise DecodeError("varint too long")


def _without_raw(data: bytes) -> tuple[bytes, list[memoryview]]:
    """The message's bytes without its top-level raw_input_contents fields, and those fields'
    contents as views of ``data``. Raises DecodeError (or IndexError) where the framing is wrong."""
    view = memoryview(data)
    kept: list[memoryview] = []
    raw: list[memoryview] = []
    pos = kept_from = 0
    size = len(data)
    while pos < size:
        start = pos
        tag, pos = _varint(data, pos)
        wire = tag & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == _WIRE_LENGTH_DELIMITED:
            length, pos = _varint(data, pos)
            if tag >> 3 == RAW_INPUT_FIELD:
                if pos + length > size:
                    raise DecodeError("truncated raw_input_contents")
                kept.append(view[kept_from:start])
                raw.append(view[pos:pos + length])
                kept_from = pos + length
            pos += length
        else:
            raise DecodeError(f"wire type {wire}")
        if pos > size:
            raise DecodeError("truncated message")
    kept.append(view[kept_from:])
    return b"".join(kept), raw


def read_infer_request(data: bytes) -> Any:
    """The ``ModelInferRequest`` in ``data`` (grpc's deserializer); a large one as a
    ``ReceivedRequest`` whose raw tensors are views of ``data``. Raises DecodeError."""
    if len(data) < LARGE_MESSAGE:
        return pb.ModelInferRequest.FromString(data)
    try:
        rest, raw = _without_raw(data)
    except (DecodeError, IndexError):
        return pb.ModelInferRequest.FromString(data)  # protobuf says what is wrong, or reads what we do not
    return ReceivedRequest(pb.ModelInferRequest.FromString(rest), raw)


def param_value(p: Any) -> Any:
    """The Python value of an ``InferParameter`` or ``ModelRepositoryParameter`` (None: unset)."""
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def params_dict(params: Any) -> dict[str, Any]:
    """A protobuf parameter map as a dict (``{}`` at once for an empty one)."""
    return {k: param_value(v) for k, v in params.items()} if len(params) else {}


def typed_bytes(name: str, datatype: str, contents: Any) -> bytes | memoryview:
    """The wire bytes of a tensor given in typed ``contents``."""
    field = CONTENTS_FIELD.get(datatype)
    if field is None:
        raise BadRequest(f"unable to find data for input '{name}': datatype {datatype} can only be sent in "
                         f"raw_input_contents")
    values = getattr(contents, field)
    if datatype == "BYTES":
        arr = np.empty(len(values), dtype=np.object_)
        arr[:] = list(values)
        return serialize_bytes(arr)
    try:
        return byte_view(np.asarray(values, dtype=DTYPES[datatype]))
    except OverflowError as e:
        raise BadRequest(f"input '{name}': a value does not fit {datatype}: {e}") from None


def _has_contents(tensor: Any) -> bool:
    """Whether an input carries typed contents (the message field is set only when sent)."""
    if not tensor.HasField("contents"):
        return False
    contents = tensor.contents
    return any(len(getattr(contents, f)) for f in _FIELDS)


def _contents_refusal(tensor: Any, model: str, otherwise: BadRequest) -> BadRequest:
    """Triton's refusal of an input whose typed contents are in another datatype's field (the
    field of its own datatype is then empty); ``otherwise`` for any other size refusal."""
    if not _has_contents(tensor) or len(getattr(tensor.contents, CONTENTS_FIELD.get(tensor.datatype, ""), ())):
        return otherwise
    given = next(f for f in _FIELDS if len(getattr(tensor.contents, f)))
    return BadRequest(f"unexpected explicit tensor data for input tensor '{tensor.name}' for model '{model}' of "
                      f"type '{FIELD_DATATYPE[given]}', expected datatype '{tensor.datatype}'")


def _shape(name: str, tensor: Any, datatype: str, max_elements: int) -> list[int]:
    """The input's shape, checked: a protobuf shape is int64 already, so one in the limits passes
    on a few comparisons; any other goes through ``check_shape``, which names what is wrong."""
    shape = list(tensor.shape)
    count = element_count(shape)
    if len(shape) <= 64 and count <= max_elements and count <= _SURELY_SAFE_COUNT and \
            (not shape or (min(shape) >= 0 and max(shape) <= max_elements)):
        return shape
    return check_shape(name, shape, datatype, max_elements)


def descriptor_from_message(msg: Any, max_elements: int, max_bytes: int,
                            forwarded: dict[str, str] | None = None) -> tuple[InferRequest, list]:
    """The broker descriptor of request ``msg`` and its tensor chunks in order, with the
    ``forwarded`` metadata as parameters (header_forward.py). ``max_elements``: the most elements
    an input may declare; ``max_bytes``: the most tensor bytes that can fit the arena.
    Raises BadRequest with the text Triton's gRPC frontend gives where it has one."""
    model, request_id = msg.model_name, msg.id
    raw = msg.raw_input_contents
    raw_count = len(raw)
    used = 0  # raw contents are given in order for the inputs not in shared memory
    chunks: list = []
    inputs: list[InputTensor] = []
    rel = 0  # offset of the next tensor in the request block's tensor bytes
    for t in msg.inputs:
        name, datatype = t.name, t.datatype
        if datatype not in DTYPES:
            raise BadRequest(f"input '{name}': unknown datatype '{datatype}'")
        shape = _shape(name, t, datatype, max_elements)
        params = params_dict(t.parameters)
        if "shared_memory_region" in params:
            region, offset, size = region_fields(params, name)
            inputs.append(InputTensor(name, datatype, shape, size, region=region, offset=offset))
        else:
            if _has_contents(t):
                if raw_count:
                    raise BadRequest(f"contents field must not be specified when using raw_input_contents for "
                                     f"'{name}' for model '{model}'")
                try:
                    data: bytes | memoryview = typed_bytes(name, datatype, t.contents)
                except BadRequest as e:  # (FP16, BF16: no field of their own; Triton names the one given)
                    raise _contents_refusal(t, model, e) from None
            elif used < raw_count:
                data = raw[used]
                used += 1
            else:
                raise BadRequest(f"unable to find data for input tensor '{name}' for model '{model}' in request.")
            size = len(data)
            try:
                check_data_size(model, request_id, name, datatype, shape, size, data)
            except BadRequest as e:
                raise _contents_refusal(t, model, e) from None
            inputs.append(InputTensor(name, datatype, shape, size, rel))
            chunks.append(data)
            rel += size
    if used != raw_count:
        raise BadRequest(f"the request has {raw_count - used} raw_input_contents that no input claims")
    outputs = None
    if len(msg.outputs):
        named: set[str] = set()
        outputs = [output_descriptor(o.name, params_dict(o.parameters), request_id, named) for o in msg.outputs]
    req = InferRequest(model, msg.model_version, inputs, outputs, request_id)
    if len(msg.parameters):
        add_request_parameters(req, params_dict(msg.parameters))
    add_to_request(req, forwarded)
    if rel > max_bytes:
        raise BadRequest(f"the request's {rel} bytes of tensor data exceed the frontend's shared-memory "
                         f"arena (--frontend-arena-mb); send large tensors through shared memory")
    return req, chunks
