"""ONNX models (``platform: "onnxruntime_onnx"`` or ``backend: "onnxruntime"``) run by onnxruntime.

The version folder holds ``model.onnx`` (or ``default_model_filename``), a file or a directory
holding ``model.onnx`` beside its external data. The config is completed from the graph and
checked against it as Triton's onnxruntime backend does (onnx_graph.py); the session's options
and execution providers come from the config and the instance's kind (onnx_session.py).

A batch of several requests runs as one session run over the concatenated batch dimension and is
split back per request; ragged inputs, batch inputs and batch outputs are Triton's (batch_io.py):
a ragged input reaches the graph as one flat tensor of the batch's elements. Inputs reach the
graph as the config declares them inside the model (a ``reshape`` applied); the sequence
batcher's controls and implicit states are fed like any input, and the state outputs are fetched
on every run so the server can keep them. BYTES tensors are ONNX string tensors: onnxruntime's
Python API takes and gives text, so elements cross as UTF-8 (an element that is not valid UTF-8
fails its own request). BF16 tensors cross as their 2-byte words through ``OrtValue``, numpy
having no bfloat16 onnxruntime accepts; a bfloat16 output needs every input as an ``OrtValue``,
which a string tensor cannot be, so a graph taking strings and giving bfloat16 is refused at load.
"""
from __future__ import annotations

import ctypes
import re
from typing import Any

import numpy as np

from shmserve.shm.tensors import DTYPES

from .backend import Backend, Instance, InstanceContext, Model, ModelContext, Request, Response
from .batch_io import BatchIO
from .onnx_graph import GraphMismatch, GraphTensor, auto_complete, check, graph_tensor, model_dims
from .onnx_session import Placement, model_path, open_session, run_options

_BF16_ONNX = 16  # TensorProto.BFLOAT16
# onnxruntime's Python exceptions: "[ONNXRuntimeError] : <code> : <CODE_NAME> : <message>"
_ORT_ERROR = re.compile(r"^\[ONNXRuntimeError\] : (\d+) : \w+ : (.*)$", re.DOTALL)


def _import_onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError:
        raise RuntimeError("the onnxruntime backend needs the onnxruntime package: pip install "
                           "'shmserve[onnx]' (or onnxruntime-gpu for KIND_GPU instances)") from None
    return onnxruntime


def _signature(session: Any) -> tuple[list[GraphTensor], list[GraphTensor], list[GraphTensor]]:
    """(inputs, outputs, overridable initializers) of a session's graph."""
    def tensors(args: Any) -> list[GraphTensor]:
        return [graph_tensor(a.name, a.type, a.shape) for a in args]

    return (tensors(session.get_inputs()), tensors(session.get_outputs()),
            tensors(session.get_overridable_initializers()))


class OnnxRuntimeBackend(Backend):
    def __init__(self) -> None:
        self.ort = _import_onnxruntime()  # imported in the worker only: the broker never loads it
        # The CPU session auto-completion opened, handed to a CPU instance instead of a second one.
        self.probe: Any = None

    def auto_complete_config(self, ctx: ModelContext) -> dict[str, Any]:
        if ctx.config.get("input") and ctx.config.get("output"):
            return auto_complete(ctx.config, ctx.name, [], [])  # (says it skips)
        self.probe = open_session(self.ort, self._path(ctx), ctx.config, Placement("CPU"))
        inputs, outputs, _ = _signature(self.probe)
        return auto_complete(ctx.config, ctx.name, inputs, outputs, ctx.default_max_batch_size)

    def create_model(self, ctx: ModelContext) -> Model:
        return OnnxModel(self, ctx)

    @staticmethod
    def _path(ctx: ModelContext) -> Any:
        return model_path(ctx.version_dir, ctx.config.get("default_model_filename") or "")


class OnnxModel(Model):
    def __init__(self, backend: OnnxRuntimeBackend, ctx: ModelContext) -> None:
        self.backend = backend
        self.ctx = ctx

    def create_instance(self, ictx: InstanceContext) -> Instance:
        backend, ctx = self.backend, self.ctx
        session, backend.probe = backend.probe, None
        if session is None or ictx.kind != "CPU":
            session = open_session(backend.ort, backend._path(ctx), ctx.config, Placement(ictx.kind, ictx.device_id))
        inputs, outputs, initializers = _signature(session)
        check(ctx.config, ctx.name, inputs, outputs, initializers)
        return OnnxInstance(session, run_options(backend.ort, ctx.config), ctx.config, inputs + initializers,
                            outputs)


class OnnxInstance(Instance):
    reshapes_itself = True  # with the graph's scalars declared dims [1] (``self.reshaped``)

    def __init__(self, session: Any, options: Any, config: dict[str, Any], inputs: list[GraphTensor],
                 outputs: list[GraphTensor]) -> None:
        import onnxruntime  # (already imported by the backend)

        self.ort = onnxruntime
        self.session = session
        self.options = options
        self.batched = int(config.get("max_batch_size", 0) or 0) > 0
        self.graph_inputs = {t.name: t for t in inputs}
        self.graph_outputs = [t.name for t in outputs]
        self.config_outputs = [e["name"] for e in config.get("output", [])]
        self.batch_io = BatchIO(config)
        # BF16 tensors cross as OrtValues of their 2-byte words (numpy has no bfloat16 onnxruntime takes).
        self.bf16_inputs = {t.name for t in inputs if t.data_type == "TYPE_BF16"}
        self.bf16_outputs = {t.name for t in outputs if t.data_type == "TYPE_BF16"}
        if self.bf16_outputs and any(t.data_type == "TYPE_STRING" for t in inputs):
            raise GraphMismatch("onnxruntime's Python API cannot run a graph that takes string tensors and gives "
                             "bfloat16 ones (a bfloat16 output needs every input as an OrtValue, which a "
                             "string tensor cannot be)")
        # Config tensors whose shape inside the model differs from the one clients use (a reshape,
        # or a scalar declared dims [1]): name -> (the model's dims, the client's dims).
        self.reshaped: dict[str, tuple[list[int], list[int]]] = {}
        rank = {t.name: len(t.dims) - (1 if self.batched else 0) for t in inputs + outputs}
        for entry in list(config.get("input", [])) + list(config.get("output", [])):
            if entry["name"] in self.batch_io.outputs or entry["name"] in self.batch_io.ragged:
                continue  # flattened for the model, or scattered with an input's shape: never reshaped
            inner, outer = model_dims(entry), list(entry.get("dims") or [])
            if rank.get(entry["name"]) == 0:
                inner = []
            if inner != outer:
                self.reshaped[entry["name"]] = (inner, outer)
        sb = config.get("sequence_batching") or {}
        self.state_outputs = [st["output_name"] for st in sb.get("state", [])]

    def failure(self, name: str, e: BaseException) -> str:
        """Triton's onnxruntime backend's words for a run that failed (its ``RETURN_IF_ORT_ERROR``)."""
        m = _ORT_ERROR.match(str(e))
        return f"onnx runtime error {m.group(1)}: {m.group(2)}" if m else super().failure(name, e)

    def execute(self, requests: list[Request]) -> list[Response]:
        responses: list[Response] = [Response() for _ in requests]
        feeds: dict[int, dict[str, np.ndarray]] = {}
        for i, r in enumerate(requests):
            try:
                feeds[i] = {name: self._input(name, arr) for name, arr in r.inputs.items() if name in self.graph_inputs}
            except ValueError as e:  # this request's own data: the others run
                responses[i] = Response(error=str(e), status=400)
        wanted = list(dict.fromkeys([n for i in feeds for n in requests[i].requested_outputs or self.config_outputs
                                     if n in self.graph_outputs] + self.state_outputs))
        # Without batching each request is a run of its own.
        for group in [list(feeds)] if self.batched else [[i] for i in feeds]:
            if group:
                self._run_group(group, feeds, [requests[i].inputs for i in group], wanted, responses)
        return responses

    def _run_group(self, group: list[int], feeds: dict[int, dict[str, np.ndarray]], inputs: list[dict[str, Any]],
                   wanted: list[str], responses: list[Response]) -> None:
        """One session run for the requests ``group`` indexes (their graph ``feeds``, their
        ``inputs`` as sent): inputs concatenated, each output split back by rows or scattered."""
        io = self.batch_io
        feed = {name: _join(io.parts(name, [feeds[i][name] for i in group])) for name in feeds[group[0]]}
        feed.update(io.batch_inputs(inputs))
        results = self._run(wanted, feed)
        scattered = {k: io.scatter(k, v, inputs) for k, v in results.items() if k in io.outputs}
        start = 0
        for j, i in enumerate(group):
            n = len(next(iter(feeds[i].values()))) if len(group) > 1 else 0
            responses[i].outputs = {k: self._output(k, scattered[k][j] if k in scattered else
                                                    v if len(group) == 1 else v[start:start + n])
                                    for k, v in results.items()}
            start += n

    def _input(self, name: str, arr: np.ndarray) -> np.ndarray:
        """One request's input as the graph takes it: reshaped to the model's dims, strings as
        text, BF16 as its 2-byte words."""
        if name in self.reshaped:
            rows = [arr.shape[0]] if self.batched else []
            arr = arr.reshape(rows + self.reshaped[name][0])
        if arr.dtype == np.object_:
            try:
                return np.array([b.decode("utf-8") if isinstance(b, bytes) else str(b) for b in arr.reshape(-1)],
                                dtype=object).reshape(arr.shape)
            except UnicodeDecodeError:
                raise ValueError(f"input '{name}': an element is not valid UTF-8, which an ONNX string tensor "
                                 f"needs in onnxruntime") from None
        if name in self.bf16_inputs:
            return arr.view(np.uint16)
        return arr

    def _run(self, wanted: list[str], feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ort = self.ort
        values: dict[str, Any] = {name: ort.OrtValue.ortvalue_from_numpy_with_onnx_type(np.ascontiguousarray(arr),
                                                                                       _BF16_ONNX)
                                  if name in self.bf16_inputs else arr for name, arr in feed.items()}
        if not self.bf16_outputs.intersection(wanted):
            return dict(zip(wanted, self.session.run(wanted, values, self.options)))
        # numpy cannot take a bfloat16 output: every value crosses as an OrtValue (no strings: see __init__)
        values = {name: v if name in self.bf16_inputs else ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v))
                  for name, v in values.items()}
        out = self.session.run_with_ort_values(wanted, values, self.options)
        return {name: _bf16_words(v) if name in self.bf16_outputs else v.numpy() for name, v in zip(wanted, out)}

    def _output(self, name: str, value: np.ndarray) -> np.ndarray:
        """A graph output as the client sees it: the config's dims, strings as UTF-8 bytes, BF16
        as its wire dtype."""
        if name in self.reshaped:
            rows = [value.shape[0]] if self.batched else []
            value = value.reshape(rows + self.reshaped[name][1])
        if value.dtype == np.object_:
            flat = [s.encode("utf-8") if isinstance(s, str) else s for s in value.reshape(-1)]
            return np.array(flat, dtype=object).reshape(value.shape)
        if name in self.bf16_outputs:
            return value.view(DTYPES["BF16"])
        return value


def _join(parts: list[np.ndarray]) -> np.ndarray:
    """One input of a run: a lone request's array as it is, several requests' concatenated."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _bf16_words(value: Any) -> np.ndarray:
    """A host OrtValue of bfloat16 as a uint16 array (a copy: the OrtValue owns its memory)."""
    shape = tuple(value.shape())
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype=np.uint16)
    words = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.ctypeslib.as_array(words).reshape(shape).copy()
