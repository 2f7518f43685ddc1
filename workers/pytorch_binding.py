"""Which forward() argument each input of a PyTorch model is, and which returned value each
output is: the rules of Triton's PyTorch backend (``ValidateInputs``, ``GetNamingConvention``,
``ValidateOutputs``), so that a model served by Triton gets the same tensors here.

Inputs, in the order the rules are tried:

- forward() takes one ``Dict[str, Tensor]``: every input goes in it, keyed by its name;
- every config input is named as a forward() argument: by name;
- every config input is named ``<name>__<index>``: by index;
- otherwise by the config's order (Triton warns, and so do we).

Batch inputs and sequence states follow their inputs' rule; a sequence control input must be named
``<name>__<index>``. A TorchScript model whose forward() takes another number of arguments than
the config gives inputs is refused at load, in Triton's words: binding them anyway gave the model
the wrong tensors. Outputs named ``<name>__<index>`` take that element of the returned tuple,
otherwise the config's order does (a returned dict is read by key).
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from .backend import ModelLoadError

_INDEXED = re.compile(r"^.+__(\d+)$")
log = logging.getLogger("shmserve.worker")


def _index(name: str) -> int | None:
    m = _INDEXED.match(name)
    return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class InputBinding:
    """``slots``: the input name each forward() argument takes, in order (None: nothing feeds that
    argument); ``as_dict``: forward() takes one dict of every input by name instead."""

    slots: tuple[str | None, ...]
    as_dict: bool = False


def forward_arguments(module: Any) -> list[tuple[str, str]] | None:
    """forward()'s arguments after ``self``, as (name, type kind); None where the module keeps no
    schema (a ``torch.export`` program: bound by index or the config's order)."""
    try:
        arguments = list(module.forward.schema.arguments)
    except (AttributeError, RuntimeError):
        return None
    out = [(a.name, a.type.kind()) for a in arguments]
    return out[1:] if out and out[0][1] == "ClassType" else out


def bind_inputs(model: str, config: dict, batch_targets: list[str], args: list[tuple[str, str]] | None
                ) -> InputBinding:
    """The binding of ``config``'s inputs (and its batch inputs' targets, its sequence controls
    and states) to forward()'s ``args``. Raises ModelLoadError in Triton's words."""
    names = [t["name"] for t in config.get("input", [])]
    sequence = config.get("sequence_batching") or {}
    controls = [c["name"] for c in sequence.get("control_input", []) if c.get("name")]
    states = [s["input_name"] for s in sequence.get("state", []) if s.get("input_name")]
    if args is not None and len(args) == 1 and args[0][1] == "DictType":
        return InputBinding(tuple(names + batch_targets + controls + states), as_dict=True)
    if args is not None:
        if any(kind == "DictType" for _, kind in args):
            raise ModelLoadError("Multiple inputs of kind DictType were detected. Only a single input of type "
                                 "Dict(str, Tensor) is supported.")
        expected = len(names) + len(batch_targets) + len(controls) + len(states)
        if len(args) != expected:
            raise ModelLoadError(f"unable to load model '{model}', configuration expects {expected} inputs, model "
                                 f"provides {len(args)}")
    if not names:
        raise ModelLoadError("model configuration must contain at least one input, none were specified.")
    arg_names = [a for a, _ in args] if args is not None else []
    positions: dict[str, int] = {}
    rest = batch_targets + states
    if args is not None and all(n in arg_names for n in names):
        for n in names + rest:
            at = arg_names.index(n) if n in arg_names else _index(n)
            if at is None:
                raise ModelLoadError(f"input '{n}' of model '{model}' is neither an argument of its forward() nor "
                                     f"named <name>__<index>")
            positions[n] = at
    elif all(_index(n) is not None for n in names):
        for i, n in enumerate(names + rest):
            at = _index(n)
            positions[n] = at if at is not None else i
    else:
        log.warning("input(s) of model '%s' are neither input arguments of the model nor do they follow the "
                    "<name>__<index> naming convention: they are passed in the order of the configuration",
                    model)
        positions.update({n: i for i, n in enumerate(names + rest)})
    for n in controls:
        at = _index(n)
        if at is None:
            raise ModelLoadError(f"input '{n}' does not follow <name>__<index> naming convention.")
        positions[n] = at
    count = len(args) if args is not None else max(positions.values()) + 1
    slots: list[str | None] = [None] * count
    for n, at in positions.items():
        if not 0 <= at < count or slots[at] is not None:
            taken = f"input '{slots[at]}' takes it too" if 0 <= at < count else f"forward() takes {count}"
            raise ModelLoadError(f"unable to load model '{model}', input '{n}' would be argument {at} of its "
                                 f"forward(), but {taken}")
        slots[at] = n
    return InputBinding(tuple(slots))


def output_indices(config: dict) -> dict[str, int]:
    """Each output's element of the tuple forward() returns: ``<name>__<index>`` gives it when
    every output is named so, otherwise the config's order (state outputs after the outputs)."""
    sequence = config.get("sequence_batching") or {}
    names = [t["name"] for t in config.get("output", [])]
    names += [s["output_name"] for s in sequence.get("state", []) if s.get("output_name") not in names]
    if names and all(_index(n) is not None for n in names):
        return {n: _index(n) for n in names}  # type: ignore[misc]
    return {n: i for i, n in enumerate(names)}


# The config datatypes Triton's PyTorch backend can hand a TorchScript model (its
# ModelConfigDataTypeToTorchType), and TYPE_STRING as a List[str]: no BF16, no UINT16/32/64.
TORCH_DATATYPES = frozenset({"TYPE_BOOL", "TYPE_UINT8", "TYPE_INT8", "TYPE_INT16", "TYPE_INT32", "TYPE_INT64",
                             "TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING"})


def check_datatypes(model: str, config: dict) -> None:
    """Refuse at load, in Triton's words, a tensor of a datatype Triton's PyTorch backend does not
    take (a request to it would fail each time instead)."""
    sequence = config.get("sequence_batching") or {}
    named = [("input", t["name"], t.get("data_type", "")) for t in config.get("input", [])]
    named += [("input state", s.get("input_name", ""), s.get("data_type", "")) for s in sequence.get("state", [])]
    named += [("output", t["name"], t.get("data_type", "")) for t in config.get("output", [])]
    named += [("state", s.get("output_name", ""), s.get("data_type", "")) for s in sequence.get("state", [])]
    for kind, name, data_type in named:
        if data_type not in TORCH_DATATYPES:
            raise ModelLoadError(f"unsupported datatype {data_type} for {kind} '{name}' for model '{model}'")
