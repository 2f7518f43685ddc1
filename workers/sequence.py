"""The worker's side of the sequence batcher: control inputs and implicit state.

Triton feeds a sequence model extra inputs the client never sends: START/END/READY flags and the
correlation id (``control_input``), and, for implicit state (``state``), the state tensor the
previous request of the sequence produced. A sequence stays on one instance, so this worker keeps
that state in memory, keyed by correlation id, and forgets it at END (or when the broker says the
sequence went idle).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from shmserve.shm.tensors import CONFIG_TO_WIRE, DTYPES

START, END = 1, 2
_KINDS = {"CONTROL_SEQUENCE_START": "start", "CONTROL_SEQUENCE_READY": "ready",
          "CONTROL_SEQUENCE_END": "end", "CONTROL_SEQUENCE_CORRID": "corrid"}


class SequenceSupport:
    def __init__(self, config: dict[str, Any]) -> None:
        sb = config.get("sequence_batching") or {}
        self.batched = int(config.get("max_batch_size", 0)) > 0
        self.controls: list[tuple[str, str, np.dtype, Any, Any]] = []
        for ci in sb.get("control_input", []):
            for c in ci.get("control", []):
                kind = _KINDS.get(c.get("kind", "CONTROL_SEQUENCE_START"), "start")
                if kind == "corrid":
                    dtype = DTYPES[CONFIG_TO_WIRE.get(c.get("data_type", "TYPE_UINT64"), "UINT64")]
                    self.controls.append((ci["name"], kind, dtype, None, None))
                elif c.get("fp32_false_true"):
                    f, t = c["fp32_false_true"]
                    self.controls.append((ci["name"], kind, np.dtype(np.float32), f, t))
                elif c.get("bool_false_true"):
                    f, t = c["bool_false_true"]
                    self.controls.append((ci["name"], kind, np.dtype(np.bool_), f, t))
                else:
                    f, t = c.get("int32_false_true") or [0, 1]
                    self.controls.append((ci["name"], kind, np.dtype(np.int32), f, t))
        self.states: list[tuple[str, str, np.dtype, list[int]]] = []
        for st in sb.get("state", []):
            dtype = DTYPES[CONFIG_TO_WIRE.get(st.get("data_type", "TYPE_FP32"), "FP32")]
            dims = [d if d > 0 else 1 for d in st.get("dims", [])]
            self.states.append((st["input_name"], st["output_name"], dtype, dims))
        self.state_outputs = {out for _, out, _, _ in self.states}
        self.memory: dict[Any, dict[str, np.ndarray]] = {}

    def augment(self, inputs: dict[str, np.ndarray], corr: Any, flags: int) -> None:
        """Add the control and state inputs Triton would add to this request."""
        shape = (1, 1) if self.batched else (1,)
        for name, kind, dtype, false, true in self.controls:
            if kind == "corrid":
                value = np.array(corr, dtype=dtype) if dtype != np.object_ else np.array(
                    str(corr).encode(), dtype=object)
                inputs[name] = np.full(shape, value, dtype=dtype)
                continue
            on = {"start": flags & START, "end": flags & END, "ready": True}[kind]
            inputs[name] = np.full(shape, true if on else false, dtype=dtype)
        if self.states:
            if flags & START or corr not in self.memory:
                self.memory[corr] = {}
            saved = self.memory[corr]
            for in_name, out_name, dtype, dims in self.states:
                state = saved.get(out_name)
                if state is None:
                    state = np.zeros(([1] if self.batched else []) + dims, dtype=dtype)
                inputs[in_name] = state

    def capture(self, outputs: dict[str, np.ndarray], requested: list[str], corr: Any, flags: int) -> None:
        """Keep the state outputs for the sequence's next request; they go back to the client only
        if it asked for them by name."""
        if not self.states:
            return
        saved = self.memory.setdefault(corr, {})
        for _, out_name, _, _ in self.states:
            if out_name in outputs:
                saved[out_name] = np.array(outputs[out_name], copy=True)
                if out_name not in requested:
                    del outputs[out_name]
        if flags & END:
            self.memory.pop(corr, None)

    def forget(self, corrs: list[Any]) -> None:
        for corr in corrs:
            self.memory.pop(corr, None)
