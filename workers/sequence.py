"""The worker's side of the sequence batcher: control inputs and implicit state.

Triton feeds a sequence model extra inputs the client never sends: START/END/READY flags and the
correlation id (``control_input``), and, for implicit state (``state``), the state tensor the
previous request of the sequence produced. A sequence stays on one instance, so this worker keeps
that state in memory, keyed by correlation id, and forgets it at END (or when the broker says the
sequence went idle). A sequence's first request gets the state's ``initial_state``: zeros
(``zero_data``) or the row-major contents of ``data_file`` in the model's ``initial_state/``
folder, as Triton reads it; zeros of the state's own dims when none is configured.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shmserve.shm.tensors import CONFIG_TO_WIRE, DTYPES, deserialize_bytes, wire_datatype

from . import device_tensors
from .backend import Request
from .requests import RequestError

START, END = 1, 2
_KINDS = {"CONTROL_SEQUENCE_START": "start", "CONTROL_SEQUENCE_READY": "ready",
          "CONTROL_SEQUENCE_END": "end", "CONTROL_SEQUENCE_CORRID": "corrid"}


def initial_state(state: dict[str, Any], dtype: np.dtype, model_dir: Path) -> np.ndarray | None:
    """The configured ``initial_state`` of one implicit state (without the batch dimension), or None
    when there is none. A broken one fails the model's load, as it does in Triton, rather than the
    sequence's first request: Triton's checks, in its order."""
    inits = state.get("initial_state") or []
    name = state.get("input_name", "")
    if len(inits) > 1:
        raise ValueError(f"initial_state field for state input '{name}' must contain exactly one or zero "
                         f"element. Found '{len(inits)}' elements.")
    if not inits:
        return None
    init = inits[0]
    if init.get("data_type", "TYPE_INVALID") != state.get("data_type", "TYPE_INVALID"):
        raise ValueError(f"The data type used for 'initial_state' field of state '{name}' does not match the "
                         f"state data type.")
    if not init.get("name"):
        raise ValueError(f"Field 'name' must be set when using initial_state for state input '{name}'.")
    dims = [int(d) for d in init.get("dims", [])]
    state_dims = [int(d) for d in state.get("dims", [])]
    if len(dims) != len(state_dims):
        raise ValueError(f"Number of dimensions in 'initial_state' doesn't match the size of 'state' dimensions "
                         f"for state input '{name}'. {len(dims)} != {len(state_dims)}")
    for d, sd in zip(dims, state_dims):
        if d == -1:
            raise ValueError(f"'initial_state' field for state input name '{name}' contains variable dimensions.")
        if sd != -1 and d != sd:
            raise ValueError(f"'initial_state' dim for input name '{name}' doesn't match 'state' dim description. "
                             f"{d} != {sd}")
    count = int(np.prod(dims, dtype=np.int64))
    if "data_file" not in init:  # zero_data: zeros, or empty strings
        return _zeros(dims, dtype)
    path = model_dir / "initial_state" / init["data_file"]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"initial_state of state input '{name}': cannot read {path}: {e.strerror}") from None
    if dtype == np.object_:  # Triton's BYTES layout: a 4-byte length before each string
        try:
            return deserialize_bytes(data, count).reshape(dims)
        except ValueError as e:
            raise ValueError(f"initial_state of state input '{name}': {path} does not hold {count} "
                             f"string(s): {e}") from None
    need = count * dtype.itemsize
    if len(data) < need:
        raise ValueError(f"initial_state setting expects {need} bytes, but the data provided from "
                         f"{init['data_file']} only has {len(data)} bytes.")
    return np.frombuffer(data[:need], dtype=dtype).reshape(dims).copy()


class SequenceSupport:
    def __init__(self, config: dict[str, Any], model_dir: Path) -> None:
        sb = config.get("sequence_batching") or {}
        self.batched = int(config.get("max_batch_size", 0)) > 0
        # The direct strategy gives each sequence a batch slot that is also its row of every
        # batch (``with_null_requests``); the oldest strategy batches whatever is ready.
        self.direct = self.batched and "oldest" not in sb
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
        # (input name, output name, the state a sequence starts from, batch dimension included)
        self.states: list[tuple[str, str, np.ndarray]] = []
        for st in sb.get("state", []):
            dtype = DTYPES[CONFIG_TO_WIRE.get(st.get("data_type", "TYPE_FP32"), "FP32")]
            first = initial_state(st, dtype, model_dir)
            if first is None:
                first = np.zeros([d if d > 0 else 1 for d in st.get("dims", [])], dtype=dtype)
            if self.batched:
                first = first[np.newaxis]
            self.states.append((st["input_name"], st["output_name"], first))
        self.state_outputs = {out for _, out, _ in self.states}
        self.memory: dict[Any, dict[str, np.ndarray]] = {}

    def augment(self, inputs: dict[str, np.ndarray], corr: Any, flags: int) -> None:
        """Add the control and state inputs Triton would add to this request."""
        shape = (1, 1) if self.batched else (1,)
        for name, kind, dtype, false, true in self.controls:
            if kind == "corrid":
                inputs[name] = np.full(shape, _correlation_id(name, dtype, corr), dtype=dtype)
                continue
            on = {"start": flags & START, "end": flags & END, "ready": True}[kind]
            inputs[name] = np.full(shape, true if on else false, dtype=dtype)
        if self.states:
            if flags & START or corr not in self.memory:
                self.memory[corr] = {}
            saved = self.memory[corr]
            for in_name, out_name, first in self.states:
                state = saved.get(out_name)
                inputs[in_name] = first.copy() if state is None else state

    def with_null_requests(self, slots: list[int | None], requests: list[Request],
                           outputs: list[str]) -> tuple[list[Request], list[int]]:
        """A direct-strategy batch as Triton's sequence batcher runs it: row ``i`` is batch slot
        ``i``, so a model may keep its state by row. ``slots`` are the ``requests``' slots (from
        the broker, in order); every slot below the highest that has no request here (empty, its
        request cancelled or waiting for an execution its shapes fit) holds a null request. Returns
        the batch and the row of each of ``requests``."""
        if not slots or len(set(slots)) != len(slots) or any(s is None or s < 0 for s in slots):
            return requests, list(range(len(requests)))  # (not a direct batch: run as it came)
        by_slot = dict(zip(slots, requests))
        like = by_slot[min(slots)]  # (Triton's: the request of the first slot that has one)
        batch = [by_slot[s] if s in by_slot else self._null_request(like, outputs) for s in range(max(slots) + 1)]
        return batch, list(slots)  # (slot s is row s)

    def _null_request(self, like: Request, outputs: list[str]) -> Request:
        """Triton's null request (``CopyAsNull``): ``like``'s inputs' types and shapes with zero
        data (empty strings for BYTES), every control off, READY too (the model must not take
        the row for a sequence's step), correlation id 0, and a state no sequence owns. What the
        model answers for it is dropped."""
        inputs = {name: _zeros_like(value) for name, value in like.inputs.items()}
        shape = (1, 1) if self.batched else (1,)
        for name, kind, dtype, false, _ in self.controls:
            inputs[name] = np.full(shape, _correlation_id(name, dtype, 0) if kind == "corrid" else false, dtype=dtype)
        for in_name, _, first in self.states:
            inputs[in_name] = first.copy()
        return Request(inputs, list(outputs), sender=_drop if like.sender is not None else None)

    def capture(self, outputs: dict[str, np.ndarray], requested: list[str], corr: Any, flags: int) -> None:
        """Keep the state outputs for the sequence's next request; they go back to the client only
        if it asked for them by name."""
        if not self.states:
            return
        saved = self.memory.setdefault(corr, {})
        for _, out_name, _ in self.states:
            if out_name in outputs:
                value = outputs[out_name]  # (a GPU model's state output is a device tensor)
                saved[out_name] = device_tensors.host_array(value) if device_tensors.is_tensor(value) \
                    else np.array(value, copy=True)
                if out_name not in requested:
                    del outputs[out_name]
        if flags & END:
            self.memory.pop(corr, None)

    def skip(self, corr: Any, flags: int) -> None:
        """A request of the sequence that does not run (it was cancelled): its START still begins
        the sequence afresh and its END still ends it, so no state outlives it."""
        if flags & (START | END):
            self.memory.pop(corr, None)

    def forget(self, corrs: list[Any]) -> None:
        for corr in corrs:
            self.memory.pop(corr, None)


def _zeros(shape: Any, dtype: np.dtype) -> np.ndarray:
    """Zero data of ``shape``: empty strings for BYTES."""
    return np.full(shape, b"", dtype=object) if dtype == np.object_ else np.zeros(shape, dtype=dtype)


def _zeros_like(value: Any) -> Any:
    return value.new_zeros(value.shape) if device_tensors.is_tensor(value) else _zeros(value.shape, value.dtype)


class _Dropped:
    """A null request's stream when its model is decoupled: what is sent goes nowhere, and a
    failure (its execute raised) ends nothing, as a worker's stream would be told."""

    def __call__(self, response: Any, final: bool) -> None:
        pass

    def fail(self, status: int, message: str) -> None:
        pass

    def name_worker(self, num: int) -> None:
        pass


_drop = _Dropped()


def _correlation_id(control: str, dtype: np.dtype, corr: Any) -> Any:
    """The sequence id as the model's CORRID control input takes it: a string control takes any
    id as its text; an integer one only an integer id that fits its type (Triton would pass a
    string id's bytes read as an integer: refused here in words, not passed on as garbage)."""
    if dtype == np.object_:
        return np.array(str(corr).encode(), dtype=object)
    wire = f"TYPE_{wire_datatype(np.empty(0, dtype))}"
    if not isinstance(corr, int):
        raise RequestError(f"sequence id '{corr}' is a string, but the model takes its correlation id in control "
                           f"input '{control}' as {wire}: send an integer sequence id")
    limits = np.iinfo(dtype)
    if not limits.min <= corr <= limits.max:
        raise RequestError(f"sequence id {corr} does not fit the model's correlation id control input "
                           f"'{control}' ({wire})")
    return corr
