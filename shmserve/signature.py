"""Checks of an inference request against the model's configuration, with Triton's error texts.

They run where a request first meets the server: in the broker before it is queued (so batches
only hold requests the model can take), or in the worker for a request a client put on its
direct lane. Either way a bad request costs one 400 and nothing else.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from shmserve.shm.descriptor import InputTensor, RequestedOutput
from shmserve.shm.tensors import CONFIG_TO_WIRE, element_count, itemsize


PASSED_LIMIT = 256  # shapes remembered per model version (cleared when full)


class InvalidRequest(Exception):
    """The client's mistake: answered with 400 and the message."""

    status = 400


class UnknownModel(InvalidRequest):
    """A model or version the server does not have: Triton's NOT_FOUND, answered with 404."""

    status = 404


class VersionNotReady(InvalidRequest):
    """A version asked for by number that exists but does not serve (loading, failed, retiring):
    Triton's UNAVAILABLE, answered with 503."""

    status = 503


# Triton appends this to a shape error of a batching model (clients see it, so it is kept as is).
BATCH_DIM_NOTE = ("NOTE: Setting a non-zero max_batch_size in the model config requires a batch dimension to be "
                  "prepended to each input shape. If you want to specify the full shape including the batch dim "
                  "in your input dims config, try setting max_batch_size to zero. See the model configuration "
                  "docs for more info on max_batch_size.")


def request_tag(request_id: str) -> str:
    """The prefix Triton gives the errors it finds while checking a request's inputs."""
    return f"[request id: {request_id or '<id_unknown>'}] "


def _names_text(names: list[str]) -> str:
    return "[" + ",".join(f"'{n}'" for n in names) + "]"


def dims_text(dims: Any) -> str:
    """A shape as Triton writes it in error texts: ``[-1,512]``."""
    return "[" + ",".join(str(d) for d in dims) + "]"


class _RequestScoped(InvalidRequest):
    """An error Triton reports with the request's id in front (``check_inputs`` adds it)."""


class TensorSpec:
    __slots__ = ("name", "datatype", "dims", "optional")

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.name: str = cfg["name"]
        self.datatype: str = CONFIG_TO_WIRE.get(cfg.get("data_type", ""), "")
        dims = list(cfg.get("dims") or [])
        reshape = cfg.get("reshape")
        self.dims: list[int] = dims if dims or not reshape else list(reshape.get("shape") or [])
        self.optional: bool = bool(cfg.get("optional", False))


class ModelSignature:
    """What a model accepts, precomputed once per loaded version."""

    def __init__(self, name: str, config: dict[str, Any]) -> None:
        self.name = name
        self.max_batch_size: int = int(config.get("max_batch_size", 0))
        self.inputs = {t["name"]: TensorSpec(t) for t in config.get("input", [])}
        self.outputs = {t["name"]: TensorSpec(t) for t in config.get("output", [])}
        self.required = [n for n, s in self.inputs.items() if not s.optional]
        self._passed: dict[tuple, int] = {}  # inputs' (name, datatype, shape, size) -> batch size

    def full_shape(self, spec: TensorSpec) -> list[int]:
        """The shape a client sees: with the batch dimension (-1) first for batching models."""
        return ([-1] + spec.dims) if self.max_batch_size > 0 else list(spec.dims)

    def check_inputs(self, inputs: Sequence[InputTensor], request_id: str = "", counted_only: bool = False) -> int:
        """Validate names, datatypes, shapes and byte sizes; returns the request's batch size.
        Requests of a shape seen before (the usual case: clients repeat themselves) are looked
        up instead of checked again. Errors read as Triton's, with the request's id in front
        where Triton puts it. ``counted_only``: a required input missing is refused only when
        the inputs are too few, as Triton's core does it (an ensemble's step request, which no
        frontend checked first, then reaches its model without it)."""
        key = tuple([(t.name, t.datatype, tuple(t.shape), t.size) for t in inputs])
        if counted_only:
            key += (None,)  # (passed under other rules than the same inputs from a client)
        batch = self._passed.get(key)
        if batch is None:
            try:
                batch = self._check_inputs(inputs, counted_only)
            except _RequestScoped as e:
                raise InvalidRequest(request_tag(request_id) + str(e)) from None
            if len(self._passed) >= PASSED_LIMIT:
                self._passed.clear()
            self._passed[key] = batch
        return batch

    def _check_inputs(self, inputs: Sequence[InputTensor], counted_only: bool = False) -> int:
        m = self.name
        if not len(self.required) <= len(inputs) <= len(self.inputs):  # Triton counts before it looks at any
            given = [t.name for t in inputs]
            if len(set(given)) == len(given):  # (a name given twice is refused as such below)
                raise _RequestScoped(self._count_text(given))
        names = set()
        batch = -1  # the first batching input's batch dimension; every other input must repeat it
        for t in inputs:
            name = t.name
            spec = self.inputs.get(name)
            if spec is None:
                raise InvalidRequest(f"unexpected inference input '{name}' for model '{m}'")
            if name in names:
                raise _RequestScoped(f"input '{name}' already exists in request")
            names.add(name)
            if t.datatype != spec.datatype:
                raise _RequestScoped(f"inference input '{name}' data-type is '{t.datatype}', but model "
                                     f"'{m}' expects '{spec.datatype}'")
            shape = t.shape
            dims = shape
            if self.max_batch_size > 0:
                if not shape:
                    raise _RequestScoped(f"input '{name}' has no shape but model requires batch dimension for '{m}'")
                if batch >= 0 and shape[0] != batch:
                    raise _RequestScoped(f"input '{name}' batch size does not match other inputs for '{m}'")
                batch = shape[0]
                if batch < 0 or batch > self.max_batch_size:
                    raise _RequestScoped(f"inference request batch-size must be <= {self.max_batch_size} "
                                         f"for '{m}'")
                dims = shape[1:]
            if len(dims) != len(spec.dims) or any(e != -1 and e != d for e, d in zip(spec.dims, dims)):
                note = BATCH_DIM_NOTE if self.max_batch_size > 0 else ""
                raise _RequestScoped(f"unexpected shape for input '{name}' for model '{m}'. Expected "
                                     f"{dims_text(self.full_shape(spec))}, got {dims_text(shape)}. {note}")
            if any(d < 0 for d in shape):
                raise InvalidRequest(f"input '{name}' for model '{m}' has a negative dimension {shape}")
            size = itemsize(spec.datatype)
            if size:
                # A batch of 0 rows is taken as one by Triton's byte-size check, which refuses it then
                # (a batch of 0 that passes it is refused after the loop).
                expected = element_count(dims if self.max_batch_size > 0 and not shape[0] else shape) * size
                if t.size != expected:
                    raise _RequestScoped(f"input byte size mismatch for input '{name}' for model '{m}'. "
                                         f"Expected {expected}, got {t.size}")
            elif element_count(shape) * 4 > t.size:  # each BYTES element has a 4-byte length prefix
                raise _RequestScoped(f"input byte size mismatch for input '{name}' for model '{m}'. "
                                     f"{element_count(shape)} BYTES elements need at least "
                                     f"{element_count(shape) * 4} bytes, got {t.size}")
        if not counted_only and any(n not in names for n in self.required):
            raise _RequestScoped(self._count_text(names))
        if batch == 0:  # what the byte-size check lets through (BYTES, zero-sized rows): no rows to run
            raise _RequestScoped(f"inference request batch-size must be >= 1 for '{m}', got a batch of 0")
        return max(batch, 1)

    def _count_text(self, given: Iterable[str]) -> str:
        """Triton's refusal of a request with too many inputs or a required one missing. It names
        the range when the model has optional inputs, the count when it has none; with nothing
        missing its list of missing inputs reads "]" (its text drops the opening bracket)."""
        names = sorted(set(given))
        missing = [n for n in self.required if n not in names]
        expected = (f"{len(self.required)} inputs" if len(self.required) == len(self.inputs)
                    else f"number of inputs between {len(self.required)} and {len(self.inputs)}")
        return (f"expected {expected} but got {len(names)} inputs for model '{self.name}'. Got input(s) "
                f"{_names_text(names)}, but missing required input(s) {_names_text(missing) if missing else ']'}. "
                f"Please provide all required input(s).")

    def check_outputs(self, outputs: Sequence[RequestedOutput] | None) -> None:
        if not outputs or not self.outputs:
            return
        for o in outputs:
            if o.name not in self.outputs:
                raise InvalidRequest(f"unexpected inference output '{o.name}' for model '{self.name}'")
