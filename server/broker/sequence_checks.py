"""Triton's checks of a sequence batcher's control inputs, in its words (its
GetBooleanSequenceControlProperties and GetTypedSequenceControlProperties, run as a sequence
model loads): a control tensor has a name, and names one control; START, END and READY each come
at most once, with exactly one of ``int32_false_true``, ``fp32_false_true`` and
``bool_false_true``, of two entries (which sets its type: a ``data_type`` is not looked at);
CORRID carries none of them, and a ``data_type`` Triton can fill with an id (ValidateModelConfig:
an unset one is TYPE_INVALID, refused too). A model that passes them gets the controls it asked
for; one that does not would get values it never said (workers/sequence.py), or no answer at all.
"""
from __future__ import annotations

from typing import Any

from tritonclient.grpc import model_config_pb2 as mc

Control = mc.ModelSequenceBatching.Control
BOOLEAN_KINDS = (Control.CONTROL_SEQUENCE_START, Control.CONTROL_SEQUENCE_END, Control.CONTROL_SEQUENCE_READY)
FALSE_TRUE_FIELDS = ("int32_false_true", "fp32_false_true", "bool_false_true")
CORRID_TYPES = (mc.TYPE_UINT64, mc.TYPE_INT64, mc.TYPE_UINT32, mc.TYPE_INT32, mc.TYPE_STRING)


def problem(config: Any) -> str | None:
    """Why ``config``'s sequence batcher's controls would not load in Triton (None: they would)."""
    if not config.HasField("sequence_batching"):
        return None
    m = config.name
    controls = config.sequence_batching.control_input
    seen: set[str] = set()
    for tensor in controls:
        if not tensor.name:
            return f"sequence batching control tensor must have a name for {m}"
        if tensor.name in seen:
            return f"sequence batching control tensor '{tensor.name}' is specified for multiple control kinds for {m}"
        seen.add(tensor.name)
    for kind in (*BOOLEAN_KINDS, Control.CONTROL_SEQUENCE_CORRID):
        found = [c for tensor in controls for c in tensor.control if c.kind == kind]
        name = Control.Kind.Name(kind)
        if len(found) > 1:
            return f"sequence batching specifies multiple {name} tensors for {m}"
        if not found:
            continue
        given = [field for field in FALSE_TRUE_FIELDS if len(getattr(found[0], field))]
        if kind == Control.CONTROL_SEQUENCE_CORRID:
            if given:
                return (f"sequence batching must not specify either 'int32_false_true', 'fp32_false_true' or "
                        f"'bool_false_true' for {name} for {m}")
            if found[0].data_type not in CORRID_TYPES:
                return (f"unexpected data type for control {name} for {m}. Allowed data types are TYPE_UINT64, "
                        f"TYPE_INT64, TYPE_UINT32, TYPE_INT32 and TYPE_STRING")
        elif not given:
            return (f"sequence batching must specify either 'int32_false_true', 'fp32_false_true' or "
                    f"'bool_false_true' for {name} for {m}")
        elif len(given) > 1:
            return (f"sequence batching specifies more than one from 'int32_false_true', 'fp32_false_true' and "
                    f"'bool_false_true' for {name} for {m}")
        elif len(getattr(found[0], given[0])) != 2:
            return f"sequence batching control '{given[0]}' must have exactly 2 entries for {name} for {m}"
    return None
