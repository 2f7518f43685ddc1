"""A model's own Prometheus metrics (``pb_utils.MetricFamily`` and its ``Metric``s): the model's
face of ``workers.custom_metrics``, which keeps the values and publishes them to the broker."""
from __future__ import annotations

import enum
from typing import Mapping, Optional, Sequence

import numpy as np

from shmserve.workers import custom_metrics

from .errors import TritonModelException


class MetricKind(enum.IntEnum):
    """Kinds of custom metric families, reached as ``MetricFamily.COUNTER`` etc.: Triton's stub
    gives ``pb_utils`` no ``MetricKind`` nor module-level ``COUNTER``, so neither is exported."""

    COUNTER = 0
    GAUGE = 1
    HISTOGRAM = 2


class MetricFamily:
    """A family of the model's own Prometheus metrics, served with the server's on the metrics
    port. Families of the same name (in any instance) are one family; so are metrics with the
    same labels."""

    COUNTER = MetricKind.COUNTER
    GAUGE = MetricKind.GAUGE
    HISTOGRAM = MetricKind.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:
        try:
            self._family = custom_metrics.REGISTRY.family(name, description, kind)
        except custom_metrics.MetricError as e:
            raise TritonModelException(str(e)) from None

    def Metric(self, labels: Optional[Mapping[str, str]] = None, buckets: Optional[Sequence[float]] = None) -> "Metric":  # noqa: N802 - Triton's name
        return Metric(self, labels, buckets)


# Triton's words for a misuse (python_backend metric_family.cc, core metric.cc; r24.10), less the
# "Failed to process the request for model '<instance>', message: " its stub puts before the core's.
_KIND_NAMES = {MetricKind.COUNTER: "TRITONSERVER_METRIC_KIND_COUNTER",
               MetricKind.GAUGE: "TRITONSERVER_METRIC_KIND_GAUGE",
               MetricKind.HISTOGRAM: "TRITONSERVER_METRIC_KIND_HISTOGRAM"}
_OPS = {"increment": ("increment", "Increment"), "set": ("set", "Set"), "observe": ("observe", "Observe"),
        "value": ("get", "Value")}


def _as_float(value: object, what: str) -> float:
    """A value as Triton's binding takes a C++ double: whatever ``float()`` converts without parsing
    text (numpy scalars, bools, ints, and a one-element array, as Triton's container's numpy 1
    converts it); anything else is pybind's TypeError."""
    if isinstance(value, np.ndarray) and value.size == 1:
        value = value.item()
    if not isinstance(value, (str, bytes, bytearray)):
        try:
            return float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            pass
    raise TypeError(f"{what}: incompatible function arguments: a float is required, got {type(value).__name__}")


def _checked_buckets(kind: int, buckets: object) -> Optional[list[float]]:
    """The buckets a metric of ``kind`` may have, in Triton's order of checks."""
    if buckets is None:
        if kind == MetricKind.HISTOGRAM:
            raise TritonModelException("Failed to create metric. Missing required buckets.")
        return None
    if not isinstance(buckets, (list, tuple)):  # (Triton takes only a list; a tuple means the same)
        raise TritonModelException("Failed to create metric. Buckets must be a list.")
    if kind != MetricKind.HISTOGRAM:
        raise TritonModelException("Failed to create metric. Unexpected buckets found.")
    bounds = [_as_float(b, "Metric()") for b in buckets]
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        raise TritonModelException("Error when creating Metric: Bucket Boundaries must be strictly sorted")
    return bounds


class Metric:
    """One labelled metric of a family: ``increment`` (counter, gauge), ``set`` (gauge),
    ``observe`` (histogram), ``value`` (counter, gauge)."""

    def __init__(self, family: MetricFamily, labels: Optional[Mapping[str, str]] = None,
                 buckets: Optional[Sequence[float]] = None) -> None:
        if labels is not None and not isinstance(labels, dict):
            raise TritonModelException("Failed to create metric. Labels must be a dictionary.")
        kind = family._family.kind
        bounds = _checked_buckets(kind, buckets)
        try:
            self._cell = custom_metrics.REGISTRY.cell(family._family, labels, bounds)
        except custom_metrics.MetricError as e:
            raise TritonModelException(str(e)) from None
        self._kind = kind

    def _refused(self, op: str, what: str) -> TritonModelException:
        verb = _OPS[op][0]
        return TritonModelException(f"Failed to {verb} metric value: {_KIND_NAMES[self._kind]} {what}")

    def _update(self, op: str, value: float, kinds: tuple[int, ...]) -> None:
        value = _as_float(value, f"{op}()")
        if self._kind not in kinds:
            raise self._refused(op, f"does not support {_OPS[op][1]}")
        if op == "increment" and self._kind == MetricFamily.COUNTER and value < 0:
            raise self._refused(op, "can only be incremented monotonically by non-negative values.")
        try:
            custom_metrics.REGISTRY.update(self._cell, op, value)
        except custom_metrics.MetricError as e:
            raise TritonModelException(str(e)) from None

    def increment(self, value: float) -> None:
        self._update("increment", value, (MetricFamily.COUNTER, MetricFamily.GAUGE))

    def set(self, value: float) -> None:
        self._update("set", value, (MetricFamily.GAUGE,))

    def observe(self, value: float) -> None:
        self._update("observe", value, (MetricFamily.HISTOGRAM,))

    def value(self) -> float:
        if self._kind == MetricFamily.HISTOGRAM:
            raise self._refused("value", "does not support Value")
        return self._cell.value
