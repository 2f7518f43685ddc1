"""An answer (its descriptor, shm/answer.py, and output bytes) made straight into the serialized
``ModelInferResponse``, or the ``ModelStreamInferResponse`` that carries one.

protobuf would copy each output twice more (into a ``bytes``, then into the message) before
serializing it once again. Here the message's small fields are serialized by protobuf, and each
``raw_output_contents`` item (field 6, length-delimited) is appended after them as protobuf would
write it, so an output's bytes are copied once, from shared memory into the message: a message's
fields may come in any order, and a repeated field's items keep theirs. handlers.py sends such
bytes as they are.
"""
from __future__ import annotations

from typing import Any, Callable

from tritonclient.grpc import service_pb2 as pb

from shmserve.server.edge.requests import INT64_MAX
from shmserve.shm.answer import AnswerDescriptor, OutputTensor

# Tags of the length-delimited fields written by hand: (field number << 3) | 2.
RAW_OUTPUT_TAG = b"\x32"  # ModelInferResponse.raw_output_contents = 6
STREAM_RESPONSE_TAG = b"\x12"  # ModelStreamInferResponse.infer_response = 2
FINAL_PARAMETER = "triton_final_response"


def varint(n: int) -> bytes:
    """protobuf's base-128 encoding of a non-negative length."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def set_param(target: Any, value: Any) -> None:
    """Fill an ``InferParameter`` from a Python value."""
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        if value > INT64_MAX:
            target.uint64_param = value
        else:
            target.int64_param = value
    elif isinstance(value, float):
        target.double_param = value
    else:
        target.string_param = str(value)


def error_head(msg: Any, final: bool | None = None) -> Any:
    """What Triton's stream handler sends as ``infer_response`` beside an error: the request's
    id alone for a request refused before it ran (``final`` None); for an error answer, also the
    model's name and version as the request gave them, and ``triton_final_response``."""
    head = pb.ModelInferResponse(id=msg.id)
    if final is not None:
        head.model_name, head.model_version = msg.model_name, msg.model_version
        head.parameters[FINAL_PARAMETER].bool_param = final
    return head


def infer_response(msg: Any, version: str, answer: AnswerDescriptor, tensor_of: Callable[[OutputTensor], memoryview],
                   final: bool | None = None, stream: bool = False) -> bytes:
    """The serialized response to request ``msg`` of a completed ``answer``: outputs in
    ``raw_output_contents``, one per output in order (empty for one written to a shared-memory
    region, whose parameters, as requested, say where). ``final``: the ``triton_final_response``
    parameter of a stream's response; ``stream``: wrapped in a ``ModelStreamInferResponse``.
    ``tensor_of``'s views are read before this returns (the answer may be released then)."""
    head = pb.ModelInferResponse(model_name=msg.model_name, model_version=version, id=msg.id)
    params = answer.params
    if params:
        for key, value in params.items():
            set_param(head.parameters[key], value)
    if final is not None:
        head.parameters[FINAL_PARAMETER].bool_param = final
    parts: list[Any] = []
    requested: dict[str, Any] | None = None
    for o in answer.outputs:
        out = head.outputs.add(name=o.name, datatype=o.datatype, shape=o.shape)
        if o.in_region:
            if requested is None:
                requested = {r.name: r.parameters for r in msg.outputs}
            for key, p in (requested.get(o.name) or {}).items():
                if key.startswith("shared_memory"):
                    out.parameters[key].CopyFrom(p)
            parts += (RAW_OUTPUT_TAG, b"\x00")
        else:
            data = tensor_of(o)
            parts += (RAW_OUTPUT_TAG, varint(len(data)), data)
    first = head.SerializeToString()
    if stream:
        size = len(first) + sum(len(p) for p in parts)
        return b"".join((STREAM_RESPONSE_TAG, varint(size), first, *parts))
    return b"".join((first, *parts)) if parts else first
