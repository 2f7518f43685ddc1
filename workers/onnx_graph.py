"""An ONNX graph's inputs and outputs against a model's config, as Triton's onnxruntime backend
reads them: auto-completion of the config from the graph, and the checks a config must pass
before an instance serves.

Everything here works on ``GraphTensor`` lists (name, Triton datatype, dims with -1 for every
dimension the graph leaves free), so the rules are plain functions of the config and the graph;
``onnx_backend`` reads those lists from an onnxruntime session. A mismatch is a ``ValueError``
with Triton's wording where Triton has one, naming the model and the tensor.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
from typing import Any

from shmserve.signature import dims_text

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
        raise ValueError(f"tensor '{t.name}' has type {t.onnx_type}, which Triton has no datatype for")
    dims = list(t.dims[1:] if batched else t.dims)
    entry: dict[str, Any] = {"name": t.name, "data_type": t.data_type, "dims": dims or [1]}
    if not dims and batched:
        entry["reshape"] = {"shape": []}
    return entry


def auto_complete(config: dict[str, Any], model: str, inputs: list[GraphTensor],
                  outputs: list[GraphTensor]) -> dict[str, Any]:
    """The config completed from the graph, as Triton's onnxruntime backend completes it.

    A config that declares both inputs (or batch inputs) and outputs is left as it is. Otherwise
    ``max_batch_size`` becomes 4 when it is unset and every input and output has a free first
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
            max_batch = done["max_batch_size"] = DEFAULT_MAX_BATCH_SIZE
            log.warning("autofilled max_batch_size to %d for model '%s' since batching is supported but no "
                        "max_batch_size is specified in model configuration. Must specify max_batch_size to "
                        "utilize autofill with a larger max batch size", max_batch, model)
        if max_batch > 1 and done.get("dynamic_batching") is None and done.get("sequence_batching") is None:
            done["dynamic_batching"] = {}
    elif max_batch != 0:
        raise ValueError(f"autofill failed for model '{model}': model does not support batching while "
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


def _check_dims(model: str, kind: str, entry: dict[str, Any], t: GraphTensor, max_batch: int) -> None:
    """Triton's CompareDimsSupported: with batching the graph's first dimension must be free;
    then the ranks match, and every dimension the graph fixes is the config's."""
    dims = model_dims(entry)
    shape = list(t.dims)
    if max_batch > 0:
        if not shape or shape[0] != -1:
            raise ValueError(f"unable to load model '{model}', model configuration supports batching but "
                             f"first dimension of {kind} '{t.name}' expected by framework is not a "
                             f"variable-size batch dimension: {dims_text(shape)} whereas model "
                             f"configuration shape is: {dims_text(dims)}")
        shape = shape[1:]
    if not shape:  # a scalar: Triton declares it dims [1]
        if any(d != 1 for d in dims):
            raise ValueError(f"unable to load model '{model}', scalar tensor '{t.name}', should only provide 1 "
                             f"in the model configuration when the model doesn't support batching. Model "
                             f"configuration provided: {dims_text(dims)}.")
        return
    if len(shape) != len(dims) or any(m != -1 and m != d for m, d in zip(shape, dims)):
        raise ValueError(f"unable to load model '{model}', {kind} '{t.name}' shape expected by framework "
                         f"{dims_text(shape)} doesn't match model configuration shape {dims_text(dims)}")


def _check_ragged(model: str, entry: dict[str, Any], t: GraphTensor) -> None:
    """A ragged input reaches the graph as one flat tensor of the batch's elements, so the graph
    must take it as ``[-1]`` (Triton's check and text)."""
    name = entry["name"]
    if entry.get("optional"):
        raise ValueError(f"unable to load model '{model}', configuration expects model provides input with shape "
                         f"[-1] for ragged input '{name}', which is not supported for optional input")
    if list(t.dims) != [-1]:
        raise ValueError(f"unable to load model '{model}', configuration expects model provides input with shape "
                         f"[-1]  for ragged input '{name}', model provides {dims_text(t.dims)}")


def _check_type(model: str, kind: str, name: str, want: str, t: GraphTensor) -> None:
    if want != t.data_type:
        provides = t.data_type or t.onnx_type
        raise ValueError(f"unable to load model '{model}', configuration expects datatype {want} for {kind} "
                         f"'{name}', model provides {provides}")


def _control_type(control: dict[str, Any]) -> str:
    if control.get("kind") == "CONTROL_SEQUENCE_CORRID":
        return str(control.get("data_type") or "TYPE_UINT64")
    for key, data_type in _CONTROL_TYPES.items():
        if control.get(key):
            return data_type
    return "TYPE_INT32"


def check(config: dict[str, Any], model: str, inputs: list[GraphTensor], outputs: list[GraphTensor],
          initializers: list[GraphTensor]) -> None:
    """Refuse a config the graph cannot serve, as Triton's instance initialization does: every
    config input is a graph input (or an initializer a request may override) of the same
    datatype and shape (a ragged input: ``[-1]``; a batch output: any shape), every config output a
    graph output; every graph input is fed by the config, a batch input, a sequence control or a
    state; controls are ``[1]`` tensors of their kind's type."""
    max_batch = int(config.get("max_batch_size", 0) or 0)
    graph_in = {t.name: t for t in initializers} | {t.name: t for t in inputs}
    graph_out = {t.name: t for t in outputs}
    # Shapes the server decides at run time (batch_io.py): ragged inputs are flat, batch outputs
    # take an input's shape.
    unchecked = {b for o in config.get("batch_output") or () for b in o.get("target_name") or ()}
    for entry in config.get("input", []):
        if entry.get("allow_ragged_batch"):
            unchecked.add(entry["name"])
            if entry["name"] in graph_in:
                _check_ragged(model, entry, graph_in[entry["name"]])
        if entry.get("optional") and max_batch != 0:
            raise ValueError(f"unable to load model '{model}', optional input '{entry['name']}' is not supported "
                             f"for models that support batching")
    for kind, entries, graph in (("input", config.get("input", []), graph_in),
                                 ("output", config.get("output", []), graph_out)):
        for entry in entries:
            name = entry["name"]
            t = graph.get(name)
            if t is None:
                raise ValueError(f"unable to load model '{model}', unexpected inference {kind} '{name}', allowed "
                                 f"{kind}s are: {', '.join(sorted(graph))}")
            _check_type(model, kind, name, entry.get("data_type", ""), t)
            if name not in unchecked:
                _check_dims(model, kind, entry, t, max_batch)
    sb = config.get("sequence_batching") or {}
    for ci in sb.get("control_input", []):
        name = ci.get("name", "")
        t = graph_in.get(name)
        if t is None:
            raise ValueError(f"unable to load model '{model}', configuration specified sequence control "
                             f"'{name}', but model does not provide that input")
        dims = list(t.dims[1:] if max_batch > 0 else t.dims)
        if dims != [1]:
            raise ValueError(f"unable to load model '{model}', sequence control '{name}' in model has dims "
                             f"{dims_text(dims)} but dims [1] is expected")
        for control in ci.get("control", []):
            want = _control_type(control)
            if want != t.data_type:
                raise ValueError(f"unable to load model '{model}', sequence control '{name}', the model "
                                 f"expects data-type {t.data_type or t.onnx_type} but the model "
                                 f"configuration specifies data-type {want}")
    for st in sb.get("state", []):
        for kind, name, graph in (("input", st.get("input_name", ""), graph_in),
                                  ("output", st.get("output_name", ""), graph_out)):
            t = graph.get(name)
            if t is None:
                raise ValueError(f"unable to load model '{model}', state {kind} '{name}' is not an {kind} of "
                                 f"the model (its {kind}s: {', '.join(sorted(graph))})")
            _check_type(model, f"state {kind}", name, st.get("data_type", ""), t)
    fed = {e["name"] for e in config.get("input", [])} | _sequence_names(config)[0]
    fed |= {name for b in config.get("batch_input") or () for name in b.get("target_name") or ()}
    unfed = [t.name for t in inputs if t.name not in fed]
    if unfed:
        raise ValueError(f"unable to load model '{model}', the model's input(s) {', '.join(unfed)} are not in "
                         f"the configuration (its inputs, batch inputs, sequence controls or states): the model "
                         f"could not run")
