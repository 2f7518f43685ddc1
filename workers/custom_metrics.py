"""A model's own Prometheus metrics (``pb_utils.MetricFamily`` and its ``Metric``s).

Values live in the worker; the whole set is published as one JSON document in the worker's
segment (a seqlock area the broker reads when Prometheus scrapes), after each round of requests
in which a value changed, or at once when a model's own thread changed it. The broker merges
the documents of all instances, so a family shared by several instances reads as one, as it does
in Triton's single process: counters and histograms add up; a gauge is the value of the instance
that set() it last, plus what instances that never set it added with increment().
"""
from __future__ import annotations

import logging
import re
import threading
import time
from bisect import bisect_left
from typing import Any

import orjson

log = logging.getLogger("shmserve.worker")

COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
KINDS = {COUNTER: "counter", GAUGE: "gauge", HISTOGRAM: "histogram"}
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
RESERVED_PREFIXES = ("nv_", "shmserve_")  # the server's own families


class MetricError(ValueError):
    """A misuse of the metrics API (pb_utils turns it into TritonModelException)."""


class Cell:
    """One labelled metric's state, shared by every Metric object with the same labels."""

    __slots__ = ("kind", "labels", "value", "set_ns", "buckets", "counts", "sum", "count")

    def __init__(self, kind: int, labels: dict[str, str], buckets: list[float] | None) -> None:
        self.kind = kind
        self.labels = labels
        self.value = 0.0
        self.set_ns = 0
        self.buckets = buckets or []
        self.counts = [0] * (len(self.buckets) + 1)  # per bucket, the last for +Inf
        self.sum = 0.0
        self.count = 0

    def doc(self) -> dict[str, Any]:
        if self.kind == HISTOGRAM:
            return {"labels": self.labels, "buckets": self.buckets, "counts": self.counts, "sum": self.sum,
                    "count": self.count}
        return {"labels": self.labels, "value": self.value, "t": self.set_ns}


class Family:
    __slots__ = ("name", "description", "kind", "cells")

    def __init__(self, name: str, description: str, kind: int) -> None:
        self.name, self.description, self.kind = name, description, kind
        self.cells: dict[tuple, Cell] = {}


class Registry:
    def __init__(self) -> None:
        self.families: dict[str, Family] = {}
        self.lock = threading.Lock()
        self.dirty = False
        self.area: Any = None  # the worker's Published area; None outside a worker
        self.owner = threading.get_ident()  # the thread that flushes after each round
        self._too_big = False

    def attach(self, area: Any) -> None:
        self.area = area
        self.owner = threading.get_ident()

    def family(self, name: str, description: str, kind: int) -> Family:
        if not isinstance(name, str) or not _NAME.match(name):
            raise MetricError(f"metric family name '{name}' is not a valid Prometheus name")
        if name.startswith(RESERVED_PREFIXES):
            raise MetricError(f"metric family name '{name}' uses a prefix the server reserves ({RESERVED_PREFIXES})")
        if kind not in KINDS:
            raise MetricError(f"metric family kind {kind!r} is not COUNTER, GAUGE or HISTOGRAM")
        with self.lock:
            family = self.families.get(name)
            if family is None:
                family = self.families[name] = Family(name, str(description), kind)
            elif family.kind != kind:
                raise MetricError(f"metric family '{name}' already exists as a {KINDS[family.kind]}")
            return family

    def cell(self, family: Family, labels: Any, buckets: Any) -> Cell:
        labels = {} if labels is None else labels
        if not isinstance(labels, dict) or not all(isinstance(k, str) and _LABEL.match(k) and isinstance(v, str)
                                                   for k, v in labels.items()):
            raise MetricError("metric labels must be a dict of valid label names to strings")
        if family.kind == HISTOGRAM:
            if not buckets or not all(isinstance(b, (int, float)) for b in buckets):
                raise MetricError(f"histogram '{family.name}' needs buckets: a list of upper bounds")
            buckets = sorted(float(b) for b in buckets)
        elif buckets is not None:
            raise MetricError(f"buckets are only for histograms, and '{family.name}' is a {KINDS[family.kind]}")
        key = (tuple(sorted(labels.items())), tuple(buckets or ()))
        with self.lock:
            cell = family.cells.get(key)
            if cell is None:
                cell = family.cells[key] = Cell(family.kind, dict(labels), buckets)
                self._changed()
            return cell

    def update(self, cell: Cell, op: str, value: float) -> None:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise MetricError(f"a metric value must be a number, not {type(value).__name__}")
        with self.lock:
            if op == "observe":
                cell.counts[bisect_left(cell.buckets, value)] += 1
                cell.sum += value
                cell.count += 1
            elif op == "set":
                cell.value = float(value)
                cell.set_ns = time.time_ns()  # the broker keeps the gauge an instance set last
            else:
                cell.value += value
            self._changed()

    def _changed(self) -> None:
        self.dirty = True
        if self.area is not None and threading.get_ident() != self.owner:
            self._publish()  # no round end will come for a model's own thread

    def flush(self) -> None:
        """After a round: publish if anything changed (one attribute read otherwise)."""
        if self.dirty and self.area is not None:
            with self.lock:
                self._publish()

    def _publish(self) -> None:
        doc = orjson.dumps([{"name": f.name, "description": f.description, "kind": KINDS[f.kind],
                             "metrics": [c.doc() for c in f.cells.values()]} for f in self.families.values()])
        self.dirty = False
        try:
            self.area.publish(doc)
        except ValueError:
            if not self._too_big:
                self._too_big = True
                log.error("custom metrics take %d bytes as JSON, more than the worker's %d-byte area: "
                          "not published", len(doc), self.area._size)


REGISTRY = Registry()
