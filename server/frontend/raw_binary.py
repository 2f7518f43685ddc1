"""Triton's raw binary request: with ``Inference-Header-Content-Length: 0`` the body is one input's
bytes alone (``curl --data-binary @image.jpg``), for a model whose one input's shape can be
deduced from the byte size.

The body stands for the JSON header ``raw_request_doc`` makes from the model's config, so the
request goes on as any binary request does: the same checks, the same descriptor. Triton's
rules (its core's ``InferenceRequest::Normalize``) and its refusal texts: exactly one input in the
config; at most one variable dimension (it takes what the byte size leaves, rounded down; a size
that does not fit is refused with Triton's byte-size text, which names the input ``raw_input``);
BYTES only with dims [1], the body being that one element (its 4-byte length is put in front); a
batching model gets a batch of one; every output comes back as binary data.
"""
from __future__ import annotations

import struct

from shmserve.shm.tensors import CONFIG_TO_WIRE, element_count, itemsize
from shmserve.signature import request_tag

from shmserve.server.edge.requests import BadRequest

# A raw request carries no id: Triton's errors name it as unknown.
RAW_TAG = request_tag("")
RAW_INPUT = "raw_input"  # the name Triton's HTTP frontend gives the body's tensor


def is_raw(header_length: bytes | None) -> bool:
    """Whether ``Inference-Header-Content-Length`` says the body is one tensor's bytes alone."""
    if header_length is None:
        return False
    try:
        return int(header_length) == 0
    except ValueError:
        return False


def raw_request_doc(model: str, config: dict, body: bytes | memoryview) -> tuple[dict, memoryview]:
    """The JSON header a raw body stands for, and the binary data behind it."""
    inputs = config.get("input") or []
    if len(inputs) != 1:
        raise BadRequest(f"{RAW_TAG}Raw request must only have 1 input (found 1) to be deduced but got "
                         f"{len(inputs)} inputs in '{model}' model configuration")
    spec = inputs[0]
    name = spec["name"]
    datatype = CONFIG_TO_WIRE.get(spec.get("data_type", ""), "")
    if not datatype:
        raise BadRequest(f"{RAW_TAG}raw input '{name}' has an unsupported data type")
    shape = [1] if int(config.get("max_batch_size", 0)) > 0 else []
    variable = -1  # the index in ``shape`` of the one variable dimension
    fixed = 1
    for d in (int(d) for d in spec.get("dims", [])):
        if d == -1:
            if variable != -1:
                raise BadRequest(f"{RAW_TAG}The shape of the raw input '{name}' can not be deduced because there "
                                 f"are more than one variable-sized dimension")
            variable = len(shape)
        else:
            fixed *= d
        shape.append(d)
    if datatype == "BYTES":
        if variable != -1 or fixed != 1:
            raise BadRequest(f"{RAW_TAG}For BYTE datatype raw input '{name}', the model must have input shape [1]")
        if len(body) > 0xFFFFFFFF:  # its length must fit the 4-byte prefix
            raise BadRequest(f"{RAW_TAG}raw input '{name}' of {len(body)} bytes is too large for one BYTES element")
        data = memoryview(struct.pack("<I", len(body)) + bytes(body))
    else:
        data = memoryview(body)
        if variable != -1:  # rounded down, as Triton does
            shape[variable] = len(body) // fixed // itemsize(datatype) if fixed else 0
        expected = element_count(shape) * itemsize(datatype)
        if len(body) != expected:  # Triton's words name the raw input as its HTTP frontend does
            raise BadRequest(f"{RAW_TAG}input byte size mismatch for input '{RAW_INPUT}' for model '{model}'. "
                             f"Expected {expected}, got {len(body)}")
    doc = {"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                       "parameters": {"binary_data_size": len(data)}}],
           "parameters": {"binary_data_output": True}}
    return doc, data
