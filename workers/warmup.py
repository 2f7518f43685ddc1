"""``model_warmup``: requests a version runs before it is marked READY (Triton's semantics).

Each sample names its inputs (``zero_data``, ``random_data`` or ``input_data_file`` read from the
model's ``warmup/`` folder), a ``batch_size`` and a ``count``; as in Triton, one execution takes
``batch_size`` requests of one item each (a sample of batch size 0, the default, is skipped), the
instance executes it ``count`` times and its outputs are dropped. A sample that fails fails the
load, with the sample named.
A sample's inputs reach the model in the config's ``reshape`` where an input has one, as a
request's do (Triton's core normalizes warm-up requests alike).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shmserve.shm.descriptor import InputTensor
from shmserve.shm.tensors import CONFIG_TO_WIRE, DTYPES, deserialize_bytes, element_count, serialize_bytes, \
    wire_datatype
from shmserve.signature import InvalidRequest, ModelSignature

from .backend import Instance, ModelLoadError, Request
from .reshape import Reshapes

REFUSALS_SAID = 8  # a too large warmup batch's refusal, said once per request up to this many


class WarmupError(ModelLoadError):
    pass


def _tensor(spec: dict, shape: list[int], model_dir: Path, sample: str, name: str) -> np.ndarray:
    datatype = CONFIG_TO_WIRE.get(spec.get("data_type", ""), "")
    if not datatype:
        raise WarmupError(f"warmup sample '{sample}': input '{name}' has no valid data_type")
    if not any(key in spec for key in ("zero_data", "random_data", "input_data_file")):
        # (Triton's words: a sample must say where its data comes from, not get zeros unasked)
        raise WarmupError(f"[request id: <id_unknown>] warmup setting expects input '{name}' to have "
                          f"input_data_type set")
    dtype = DTYPES[datatype]
    count = element_count(shape)
    if spec.get("input_data_file"):
        path = model_dir / "warmup" / spec["input_data_file"]
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise WarmupError(f"warmup sample '{sample}': cannot read {path}: {e.strerror}") from None
        if datatype == "BYTES":
            return deserialize_bytes(raw, count).reshape(shape)
        arr = np.frombuffer(raw, dtype=dtype)
        if arr.size != count:
            raise WarmupError(f"warmup sample '{sample}': {path} holds {arr.size} elements, input '{name}' "
                              f"needs {count}")
        return arr.reshape(shape)
    if datatype == "BYTES":
        value = b"" if spec.get("zero_data") else b"warmup"
        out = np.empty(count, dtype=object)
        out[:] = [value] * count
        return out.reshape(shape)
    if spec.get("random_data"):
        rng = np.random.default_rng(0)
        if dtype.kind == "f":
            return rng.random(shape).astype(dtype)
        if dtype.kind == "b":
            return rng.integers(0, 2, shape).astype(dtype)
        return rng.integers(0, 100, shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def run_warmup(instance: Instance, config: dict[str, Any], model_dir: Path, signature: ModelSignature,
               instance_name: str = "") -> int:
    """Run every sample; returns how many executions it took. A sample is checked as a request
    is (Triton's core validates a warm-up request alike): one that lacks an input the model
    requires fails the load with Triton's text, not with the model's error on a missing input."""
    outputs = list(signature.outputs)
    max_batch = int(config.get("max_batch_size", 0))
    batched = max_batch > 0
    reshapes = None if instance.reshapes_itself else Reshapes(config)
    executions = 0
    for i, sample in enumerate(config.get("model_warmup", [])):
        label = sample.get("name") or f"#{i}"
        batch = int(sample.get("batch_size") or 0)
        if batch == 0:  # (Triton skips it: "Skipping batch 0 warmup sample")
            continue
        if batch != 1 and batch > max_batch:  # Triton's backends refuse each request of such a batch
            refusal = f"batch size {batch} for '{instance_name}', max allowed is {max_batch}; "
            # (Triton says it once per request of the batch: up to REFUSALS_SAID times here, the
            # batch size being a config's to choose, up to 2**32)
            more = f"(and {batch - REFUSALS_SAID} more)" if batch > REFUSALS_SAID else ""
            raise WarmupError(f"failed to run warmup sample '{label}': " + refusal * min(batch, REFUSALS_SAID) + more)
        inputs = {}
        for name, spec in (sample.get("inputs") or {}).items():
            dims = [d if d > 0 else 1 for d in spec.get("dims", [])]
            inputs[name] = _tensor(spec, ([1] if batched else []) + dims, model_dir, label, name)
        try:
            signature.check_inputs([_described(name, arr) for name, arr in inputs.items()])
        except InvalidRequest as e:
            raise WarmupError(f"warmup sample '{label}': {e}") from None
        if reshapes:
            reshapes.model_inputs(inputs)
        for _ in range(max(1, int(sample.get("count", 1) or 1))):
            requests = [Request(inputs=dict(inputs), requested_outputs=list(outputs), id=f"warmup-{label}",
                                sender=_discard if config.get("model_transaction_policy", {}).get("decoupled")
                                else None) for _ in range(batch)]
            try:
                responses = instance.execute(requests)
            except Exception as e:  # noqa: BLE001 - the model's own failure
                raise WarmupError(f"warmup sample '{label}' failed: {type(e).__name__}: {e}") from None
            for r in responses or ():
                if r is not None and r.error is not None:
                    raise WarmupError(f"warmup sample '{label}' failed: {r.error}")
            executions += 1
    return executions


def _described(name: str, arr: np.ndarray) -> InputTensor:
    """A warm-up input as a request describes it (its datatype, shape and byte size)."""
    datatype = wire_datatype(arr)
    size = len(serialize_bytes(arr)) if datatype == "BYTES" else arr.nbytes
    return InputTensor(name, datatype, list(arr.shape), size)


def _discard(response: Any, final: bool) -> None:
    """A decoupled model's warm-up responses go nowhere."""
