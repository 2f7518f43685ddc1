"""gRPC inference messages <-> the KServe v2 request document and its tensor pieces.

A ``ModelInferRequest`` becomes the same document an HTTP client sends (inputs with
``binary_data_size`` or shared-memory parameters, request parameters, outputs), so edge/requests.py's
``build_request`` checks it and makes the broker descriptor exactly as for HTTP: the worker side
cannot tell the two frontends apart. Tensor bytes stay in the protobuf's own buffers (``Pieces``)
until the connection copies them into the request block.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from shmserve.server.edge.requests import INT64_MAX, BadRequest
from shmserve.shm.answer import AnswerDescriptor, OutputTensor
from shmserve.shm.tensors import DTYPES, byte_view, serialize_bytes

# The typed ``contents`` field that holds each datatype (FP16 and BF16 travel raw only, as in Triton).
CONTENTS_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents",
                  "INT32": "int_contents", "INT64": "int64_contents", "UINT8": "uint_contents",
                  "UINT16": "uint_contents", "UINT32": "uint_contents", "UINT64": "uint64_contents",
                  "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents"}


class Pieces:
    """The binary tail of a request held as one buffer per input instead of one body: it answers
    ``len`` and the slices ``build_request`` takes (each exactly one piece, in order), without
    joining the pieces into a copy."""

    def __init__(self) -> None:
        self.pieces: list[memoryview] = []
        self.total = 0
        self.taken = 0  # pieces handed out so far: build_request takes them in order

    def add(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        self.pieces.append(view)
        self.total += len(view)
        return len(view)

    def __len__(self) -> int:
        return self.total

    def __getitem__(self, span: slice) -> memoryview:
        piece = self.pieces[self.taken]
        self.taken += 1
        assert span.stop - span.start == len(piece), "build_request slices whole pieces only"
        return piece


def param_value(p: Any) -> Any:
    """The Python value of an ``InferParameter`` or ``ModelRepositoryParameter`` (None: unset)."""
    kind = p.WhichOneof("parameter_choice")
    return getattr(p, kind) if kind else None


def params_dict(params: Any) -> dict[str, Any]:
    return {k: param_value(v) for k, v in params.items()}


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


def _has_contents(contents: Any) -> bool:
    return any(len(getattr(contents, f)) for f in set(CONTENTS_FIELD.values()))


def request_doc(request: Any) -> tuple[dict, Pieces]:
    """The KServe v2 document of a ``ModelInferRequest`` and the pieces its binary sizes name."""
    pieces = Pieces()
    raw = request.raw_input_contents
    used = 0  # raw contents are given in order for the inputs not in shared memory
    inputs = []
    for t in request.inputs:
        params = params_dict(t.parameters)
        if "shared_memory_region" not in params:
            if _has_contents(t.contents):
                if len(raw):
                    raise BadRequest(f"contents field must not be specified when using raw_input_contents for "
                                     f"'{t.name}' for model '{request.model_name}'")
                params["binary_data_size"] = pieces.add(typed_bytes(t.name, t.datatype, t.contents))
            elif used < len(raw):
                params["binary_data_size"] = pieces.add(raw[used])
                used += 1
            else:
                raise BadRequest(f"unable to find data for input '{t.name}' for model '{request.model_name}'")
        inputs.append({"name": t.name, "datatype": t.datatype, "shape": list(t.shape), "parameters": params})
    if used != len(raw):
        raise BadRequest(f"the request has {len(raw) - used} raw_input_contents that no input claims")
    doc: dict[str, Any] = {"inputs": inputs, "parameters": params_dict(request.parameters)}
    if request.id:
        doc["id"] = request.id
    if len(request.outputs):
        doc["outputs"] = [{"name": o.name, "parameters": params_dict(o.parameters)} for o in request.outputs]
    return doc, pieces


def infer_response(model: str, version: str, doc: dict, answer: AnswerDescriptor,
                   tensor_of: Callable[[OutputTensor], memoryview]) -> Any:
    """The ``ModelInferResponse`` of a completed request: outputs in ``raw_output_contents``, one
    per output in order (empty for one written to shared memory, whose parameters say where)."""
    resp = pb.ModelInferResponse(model_name=model, model_version=version, id=str(doc.get("id", "")))
    for key, value in (answer.params or {}).items():
        set_param(resp.parameters[key], value)
    requested = {o["name"]: o["parameters"] for o in doc.get("outputs") or ()}
    for o in answer.outputs:
        out = resp.outputs.add(name=o.name, datatype=o.datatype, shape=o.shape)
        if o.in_region:
            for key, value in requested.get(o.name, {}).items():
                if key.startswith("shared_memory"):
                    set_param(out.parameters[key], value)
            resp.raw_output_contents.append(b"")
        else:
            resp.raw_output_contents.append(bytes(tensor_of(o)))
    return resp
