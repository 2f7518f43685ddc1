"""An ONNX graph's inputs and outputs against a model's config, as Triton's onnxruntime backend
reads them: auto-completion of the config from the graph, and the checks a config must pass
before an instance serves.

Everything here works on ``GraphTensor`` lists (name, Triton datatype, dims with -1 for every
dimension the graph leaves free), so the rules are plain functions of the config and the graph;
``onnx_backend`` reads those lists from an onnxruntime session. A mismatch is a ``GraphMismatch``
(a ``ValueError``) in Triton's words where Triton has some, naming the tensor.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from shmserve.signature import dims_text

from .backend import ModelLoadError

log = logging.getLogger("shmserve.worker")

# What Triton's backend uses when the graph can batch and the config sets no max_batch_size
# (its --backend-config=onnxruntime,default-max-batch-size, 4 by default).
DEFAULT_MAX_BATCH_SIZE = 4

# onnxruntime's type strings -> Triton's config datatypes (complex and non-tensor types have none).
ONNX_TYPES = {
    "tensor(bool)": "TYPE_BOOL", "tensor(uint8)": "TYPE_UINT8", "tensor(uint16)": "TYPE_UINT16",
    "tensor(uint32)": "TYPE_UINT32", "tensor(uint64)": "TYPE_UINT64", "tensor(int8)": "TYPE_INT8",
    "tensor(int16)": "TYPE_INT16", "tensor(int32)": "TYPE_INT32", "tensor(int64)": "TYPE_INT64",
    "tensor(float16)": "TYPE_FP16", "tensor(float)": "TYPE_FP32", "tensor(double)": "TYPE_FP64",
    "tensor(bfloat16)": "TYPE_BF16", "tensor(string)": "TYPE_STRING",
}
# The datatype each kind of sequence control feeds the model.
_CONTROL_TYPES = {"int32_false_true": "TYPE_INT32", "fp32_false_true": "TYPE_FP32", "bool_false_true": "TYPE_BOOL"}


class GraphMismatch(ModelLoadError, ValueError):
    """The config and the graph disagree: the load fails with this text alone (Triton's words)."""


@dataclasses.dataclass(frozen=True)
class GraphTensor:
    name: str
    data_type: str  # Triton's config spelling, TYPE_FP32; "" for a type Triton has no datatype for
    onnx_type: str  # onnxruntime's spelling, tensor(float): named in errors
    dims: tuple[int, ...]  # the graph's full shape, -1 where it is free


def graph_tensor(name: str, onnx_type: str, shape: Any) -> GraphTensor:
    """A session input or output as a ``GraphTensor``: a named (symbolic) or unknown dimension,
    or a negative one, is free (-1)."""
    dims = tuple(d if isinstance(d, int) and d >= 0 else -1 for d in (shape or ()))
    return GraphTensor(name, ONNX_TYPES.get(onnx_type, ""), onnx_type, dims)


def _batchable(tensors: list[GraphTensor]) -> bool:
    """Triton's rule: the model can batch when every input and output has a free first dimension."""
    return all(t.dims and t.dims[0] == -1 for t in tensors)


def _sequence_names(config: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(inputs, outputs) the sequence batcher feeds and takes: its controls and implicit states."""
    sb = config.get("sequence_batching") or {}
    inputs = {ci.get("name", "") for ci in sb.get("control_input", [])}
    inputs |= {st.get("input_name", "") for st in sb.get("state", [])}
    outputs = {st.get("output_name", "") for st in sb.get("state", [])}
    return inputs, outputs


def _config_tensor(t: GraphTensor, batched: bool) -> dict[str, Any]:
    """A config ``input``/``output`` entry for a graph tensor. A tensor with no dimension left
    (a scalar, or only the batch dimension) is declared ``dims: [1]``; with batching it gets an
    empty ``reshape`` so that the model still receives it without that 1, as Triton writes it."""
    if not t.data_type:
        raise GraphMismatch(f"tensor '{t.name}' has type {t.onnx_type}, which Triton has no datatype for")
    dims = list(t.dims[1:] if batched else t.dims)
    entry: dict[str, Any] = {"name": t.name, "data_type": t.data_type, "dims": dims or [1]}
    if not dims and batched:
        entry["reshape"] = {"shape": []}
    return entry


def auto_complete(config: dict[str, Any], model: str, inputs: list[GraphTensor], outputs: list[GraphTensor],
                  default_max_batch: int = DEFAULT_MAX_BATCH_SIZE) -> dict[str, Any]:
    """The config completed from the graph, as Triton's onnxruntime backend completes it.

    A config that declares both inputs (or batch inputs) and outputs is left as it is. Otherwise
    ``max_batch_size`` becomes ``default_max_batch`` (--backend-config default-max-batch-size, 4
    unset) when it is unset and every input and output has a free first
    dimension (a model that cannot batch with a non-zero ``max_batch_size`` is refused), a
    ``dynamic_batching`` section is added when the model batches and names no scheduler, and the
    missing inputs or outputs are taken from the graph. The sequence batcher's controls and states are not made
    inputs and outputs clients must send: they are fed by the server (Triton would list them).
    """
    # Batch inputs count as inputs here, as in Triton: a config with them and outputs is not completed.
    declared_inputs = bool(config.get("input") or config.get("batch_input"))
    if declared_inputs and config.get("output"):
        log.info("skipping model configuration auto-complete for '%s': inputs and outputs already specified", model)
        return config
    done = copy.deepcopy(config)
    max_batch = int(done.get("max_batch_size", 0) or 0)
    if _batchable(inputs + outputs):
        if max_batch == 0:
            max_batch = done["max_batch_size"] = default_max_batch
            log.warning("autofilled max_batch_size to %d for model '%s' since batching is supported but no "
                        "max_batch_size is specified in model configuration. Must specify max_batch_size to "
                        "utilize autofill with a larger max batch size", max_batch, model)
        if max_batch > 1 and done.get("dynamic_batching") is None and done.get("sequence_batching") is None:
            done["dynamic_batching"] = {}
    elif max_batch != 0:
        raise GraphMismatch(f"autofill failed for model '{model}': model does not support batching while "
                            f"non-zero max_batch_size is specified")
    fed, taken = _sequence_names(done)
    if not declared_inputs:
        done["input"] = [_config_tensor(t, max_batch > 0) for t in inputs if t.name not in fed]
    if not done.get("output"):
        done["output"] = [_config_tensor(t, max_batch > 0) for t in outputs if t.name not in taken]
    return done


def model_dims(entry: dict[str, Any]) -> list[int]:
    """The dims a config tensor has inside the model (its ``reshape``, if any), without the batch."""
    reshape = entry.get("reshape")
    return list(reshape.get("shape") or []) if reshape is not None else list(entry.get("dims") or [])


def _check_dims(model: str, entry: dict[str, Any], t: GraphTensor, max_batch: int, exact: bool) -> None:
    """Triton's CompareDimsSupported, and its texts: with batching the graph's first dimension is
    -1 and the rest is the config's shape; the ranks match and every dimension matches, where
    the graph leaves one free (-1) only for an input (``exact`` outputs must match it too). A
    graph scalar takes only dims of 1."""
    dims = model_dims(entry)
    shape = list(t.dims)
    if not shape:  # a scalar: Triton compares no dimension, and wants every configured one to be 1
        if any(d != 1 for d in dims):
            raise GraphMismatch(f"unable to load model '{model}', scalar tensor '{t.name}', should only provide 1 in "
                                f"the model configuration when the model doesn't support batching. Model "
                                f"configuration provided: {dims_text(dims)}.")
        return
    if max_batch > 0:
        if shape[0] != -1:
            raise GraphMismatch(f"model '{model}', tensor '{t.name}': for the model to support batching the shape "
                                f"should have at least 1 dimension and the first dimension must be -1; but shape "
                                f"expected by the model is {dims_text(shape)}")
        full = [-1] + dims
    else:
        full = dims
    if len(shape) != len(full) or any((exact or m != -1) and m != d for m, d in zip(shape, full)):
        specified = (f"{len(full)} dimensions (an initial batch dimension because max_batch_size > 0 followed by "
                     f"the explicit tensor shape, making complete shape {dims_text(full)})" if max_batch > 0
                     else f"{len(full)} dimensions (shape {dims_text(full)})")
        raise GraphMismatch(f"model '{model}', tensor '{t.name}': the model expects {len(shape)} dimensions (shape "
                            f"{dims_text(shape)}) but the model configuration specifies {specified}")


def _check_ragged(model: str, entry: dict[str, Any], t: GraphTensor) -> None:
    """A ragged input reaches the graph as one flat tensor of the batch's elements, so the graph
    must take it as ``[-1]`` (Triton's check and text)."""
    name = entry["name"]
    if entry.get("optional"):
        raise GraphMismatch(f"unable to load model '{model}', configuration expects model provides input with shape "
                            f"[-1] for ragged input '{name}', which is not supported for optional input")
    if list(t.dims) != [-1]:
        raise GraphMismatch(f"unable to load model '{model}', configuration expects model provides input with shape "
                            f"[-1]  for ragged input '{name}', model provides {dims_text(t.dims)}")


def _check_type(model: str, kind: str, name: str, want: str, t: GraphTensor) -> None:
    if want != t.data_type:
        # (Triton names the graph's type by the server's datatype: a string tensor is TYPE_BYTES)
        provides = "TYPE_BYTES" if t.data_type == "TYPE_STRING" else t.data_type or t.onnx_type
        raise GraphMismatch(f"unable to load model '{model}', configuration expects datatype {want} for {kind} "
                            f"'{name}', model provides {provides}")


def _onnx_name(t: GraphTensor) -> str:
    """An ONNX element type as Triton's backend names it in errors: FLOAT, INT32, BFLOAT16."""
    return t.onnx_type.removeprefix("tensor(").removesuffix(")").upper()


def _control_type(control: dict[str, Any]) -> str:
    if control.get("kind") == "CONTROL_SEQUENCE_CORRID":
        return str(control.get("data_type") or "TYPE_UINT64")
    for key, data_type in _CONTROL_TYPES.items():
        if control.get(key):
            return data_type
    return "TYPE_INT32"


def _control_count(config: dict[str, Any]) -> int:
    """The graph inputs the sequence batcher's controls feed: one per kind of control present."""
    sb = config.get("sequence_batching") or {}
    kinds = {c.get("kind") for ci in sb.get("control_input", []) for c in ci.get("control", [])}
    return len(kinds & {"CONTROL_SEQUENCE_START", "CONTROL_SEQUENCE_END", "CONTROL_SEQUENCE_READY",
                        "CONTROL_SEQUENCE_CORRID"})


def check(config: dict[str, Any], model: str, inputs: list[GraphTensor], outputs: list[GraphTensor],
          initializers: list[GraphTensor]) -> None:
    """Refuse a config the graph cannot serve, as Triton's instance initialization does and in
    its order and words: the sequence controls are ``[1]`` graph inputs of their kind's type;
    the graph has as many inputs as the config feeds (its non-optional inputs, batch inputs,
    controls and states); every config input is a graph input (or an initializer a request may
    override) of the same datatype and shape (a ragged input: ``[-1]``); every config output a
    graph output of the same datatype and exactly its shape (a batch output: any shape); and,
    beyond Triton, every graph input is fed by something, so the model can run."""
    max_batch = int(config.get("max_batch_size", 0) or 0)
    graph_in = {t.name: t for t in initializers} | {t.name: t for t in inputs}
    graph_out = {t.name: t for t in outputs}
    sb = config.get("sequence_batching") or {}
    for ci in sb.get("control_input", []):
        name = ci.get("name", "")
        t = {x.name: x for x in inputs}.get(name)
        if t is None:
            raise GraphMismatch(f"configuration specified sequence control '{name}', but model does not provide "
                                f"that input")
        dims = list(t.dims[1:] if max_batch > 0 else t.dims)
        if dims != [1]:
            raise GraphMismatch(f"unable to load model '{model}', sequence control '{name}' in model has dims "
                                f"{dims_text(dims)} but dims [1] is expected")
        for control in ci.get("control", []):
            want = _control_type(control)
            if want != t.data_type:
                raise GraphMismatch(f"unable to load model '{model}', sequence control '{name}', the model expects "
                                    f"data-type {_onnx_name(t)} but the model configuration specifies data-type "
                                    f"{want}")
    expected = sum(1 for e in config.get("input", []) if not e.get("optional")) + len(config.get("batch_input") or ())
    expected += _control_count(config) + len(sb.get("state", []))
    if len(inputs) != expected:
        raise GraphMismatch(f"unable to load model '{model}', configuration expects {expected} inputs, model "
                            f"provides {len(inputs)}")
    for entry in config.get("input", []):
        name = entry["name"]
        if entry.get("optional") and max_batch != 0:
            raise GraphMismatch(f"unable to load model '{model}', optional input '{name}' is not supported for "
                                f"models that support batching")
        t = graph_in.get(name)
        if t is None:
            raise GraphMismatch(f"unexpected inference input '{name}', allowed inputs are: "
                                f"{', '.join(sorted(graph_in))}")
        _check_type(model, "input", name, entry.get("data_type", ""), t)
        if entry.get("allow_ragged_batch"):
            _check_ragged(model, entry, t)
        else:
            _check_dims(model, entry, t, max_batch, exact=False)
    # A batch output takes an input's shape (batch_io.py): its dims are not compared.
    scattered = {b for o in config.get("batch_output") or () for b in o.get("target_name") or ()}
    for entry in config.get("output", []):
        name = entry["name"]
        t = graph_out.get(name)
        if t is None:
            raise GraphMismatch(f"unexpected inference output '{name}', allowed outputs are: "
                                f"{', '.join(sorted(graph_out))}")
        _check_type(model, "output", name, entry.get("data_type", ""), t)
        if name not in scattered:
            _check_dims(model, entry, t, max_batch, exact=True)
    for st in sb.get("state", []):
        for kind, name, graph in (("input", st.get("input_name", ""), graph_in),
                                  ("output", st.get("output_name", ""), graph_out)):
            t = graph.get(name)
            if t is None:
                raise GraphMismatch(f"unable to load model '{model}', state {kind} '{name}' is not an {kind} of "
                                    f"the model (its {kind}s: {', '.join(sorted(graph))})")
            _check_type(model, f"state {kind}", name, st.get("data_type", ""), t)
    fed = {e["name"] for e in config.get("input", [])} | _sequence_names(config)[0]
    fed |= {name for b in config.get("batch_input") or () for name in b.get("target_name") or ()}
    unfed = [t.name for t in inputs if t.name not in fed]
    if unfed:
        raise GraphMismatch(f"unable to load model '{model}', the model's input(s) {', '.join(unfed)} are not in "
                            f"the configuration (its inputs, batch inputs, sequence controls or states): the model "
                            f"could not run")
