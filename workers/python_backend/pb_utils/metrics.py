"""A model's own Prometheus metrics (``pb_utils.MetricFamily`` and its ``Metric``s): the model's
face of ``workers.custom_metrics``, which keeps the values and publishes them to the broker."""
from __future__ import annotations

import enum
from typing import Mapping, Optional, Sequence

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


class Metric:
    """One labelled metric of a family: ``increment`` (counter, gauge), ``set`` (gauge),
    ``observe`` (histogram), ``value`` (counter, gauge)."""

    def __init__(self, family: MetricFamily, labels: Optional[Mapping[str, str]] = None,
                 buckets: Optional[Sequence[float]] = None) -> None:
        try:
            self._cell = custom_metrics.REGISTRY.cell(family._family, dict(labels) if labels is not None else None,
                                                      list(buckets) if buckets is not None else None)
        except custom_metrics.MetricError as e:
            raise TritonModelException(str(e)) from None
        self._kind = family._family.kind

    def _update(self, op: str, value: float, kinds: tuple[int, ...]) -> None:
        if self._kind not in kinds:
            raise TritonModelException(f"{op}() is not supported by a {custom_metrics.KINDS[self._kind]} metric")
        if op == "increment" and self._kind == MetricFamily.COUNTER and isinstance(value, (int, float)) \
                and value < 0:
            raise TritonModelException("a counter can only be incremented by a non-negative value")
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
            raise TritonModelException("value() is not supported by a histogram metric")
        return self._cell.value
