"""Triton's load-time checks of a config's ``batch_input`` and ``batch_output`` entries (its
``ValidateBatchIO``), with its texts: each entry names exactly one source input the config
declares, a batch input is INT32 or FP32, a batch output's targets are declared outputs, each
named once. The backends that generate and scatter them (workers/batch_io.py) rely on this.
"""
from __future__ import annotations

from tritonclient.grpc import model_config_pb2 as mc


def _kind_name(enum: object, kind: int) -> str:
    try:
        return enum.Name(kind)  # type: ignore[attr-defined]
    except ValueError:  # a number no kind has (text format accepts one)
        return str(kind)


def problem(config: mc.ModelConfig) -> str | None:
    """Why the config's batch inputs or outputs cannot be served, as Triton says it (the model's
    name last, as Triton appends it), or None."""
    inputs = {t.name for t in config.input}
    outputs = {t.name for t in config.output}
    why = _batch_inputs(config, inputs) or _batch_outputs(config, inputs, outputs)
    return f"{why} for {config.name}" if why else None


def _batch_inputs(config: mc.ModelConfig, inputs: set[str]) -> str | None:
    for b in config.batch_input:
        kind = _kind_name(mc.BatchInput.Kind, b.kind)
        if b.kind not in mc.BatchInput.Kind.values():
            return f"unknown batch input kind '{kind}'"
        if len(b.source_input) != 1:
            return f"batch input kind '{kind}' expects 1 source input, got {len(b.source_input)}"
        if b.data_type not in (mc.TYPE_INT32, mc.TYPE_FP32):
            return "batch input data type must be TYPE_INT32 or TYPE_FP32"
        for source in b.source_input:
            if source not in inputs:
                return f"unknown source input name '{source}'"
    return None


def _batch_outputs(config: mc.ModelConfig, inputs: set[str], outputs: set[str]) -> str | None:
    for b in config.batch_output:
        kind = _kind_name(mc.BatchOutput.Kind, b.kind)
        if b.kind not in mc.BatchOutput.Kind.values():
            return f"unknown batch output kind '{kind}'"
        if len(b.source_input) != 1:
            return f"batch output kind '{kind}' expects 1 source input, got {len(b.source_input)}"
        for source in b.source_input:
            if source not in inputs:
                return f"unknown source input name '{source}'"
        targets: set[str] = set()
        for target in b.target_name:
            if target not in outputs:
                return f"unknown target output name '{target}'"
            if target in targets:
                return f"target output name '{target}' can only be specified once"
            targets.add(target)
    return None
