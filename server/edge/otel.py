"""OpenTelemetry export of traces (``--trace-config mode=opentelemetry``), optional.

Needs ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http`` (``pip install
'shmserve[trace]'``). Like Triton, each traced request becomes one span named ``InferRequest`` with
the model and trace id as attributes and one event per timestamp (an ensemble's composing
requests as spans under its own), sent to ``opentelemetry,url=``
(OTLP over HTTP; default http://localhost:4318/v1/traces). Spans are exported from a background
thread (the SDK's batch processor, sized by ``opentelemetry,bsp_*``), so the event loop never
waits on the collector.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Any, Sequence


def missing() -> str:
    """Why the SDK cannot be used ('' when it can): checked at start, before anything is spawned."""
    for module in ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http.trace_exporter"):
        try:
            if importlib.util.find_spec(module) is None:
                return f"module {module} is not installed"
        except ImportError as e:  # a parent package missing, or one that fails to import
            return f"module {module} cannot be imported: {e}"
    return ""


class OtelExporter:
    """``settings``: the ``opentelemetry,<key>=<value>`` settings (shm/trace.py): the resource's
    attributes (``service.name`` is shmserve unless one names it) and the batch span processor's
    queue size, delay and batch size, as Triton's."""

    def __init__(self, url: str, settings: tuple[tuple[str, str], ...] = ()) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from shmserve.shm.trace import otel_bsp, otel_resource

        self.url, self.settings = url, settings
        bsp = otel_bsp(list(settings))
        self.provider = TracerProvider(resource=Resource.create({"service.name": "shmserve",
                                                                 **otel_resource(list(settings))}))
        self.provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=url), max_queue_size=bsp.get("bsp_max_queue_size", 2048),
            schedule_delay_millis=bsp.get("bsp_schedule_delay", 5000),
            max_export_batch_size=bsp.get("bsp_max_export_batch_size", 512)))
        self.tracer = self.provider.get_tracer("shmserve")
        # Timestamps are CLOCK_MONOTONIC; spans want wall-clock ns.
        self.offset = time.time_ns() - time.monotonic_ns()

    def export(self, trace_id: int, model: str, version: Any, stamps: list[tuple[str, int]],
               steps: Sequence[tuple[int, str, int, int, list[tuple[str, int]]]] = ()) -> None:
        """One request's span; ``steps``: its ensemble's composing requests, (trace id, model,
        version, parent: -1 for this request or the index of a nested ensemble's step, stamps),
        each a span whose parent is the span of the request that made it."""
        span = self._span(trace_id, model, version, stamps, None)
        if span is None:
            return
        made: list[Any] = []
        for step_id, step_model, step_version, parent, step_stamps in steps:
            above = span if parent < 0 or made[parent] is None else made[parent]
            made.append(self._span(step_id, step_model, step_version, step_stamps, above))

    def _span(self, trace_id: int, model: str, version: Any, stamps: list[tuple[str, int]], parent: Any) -> Any:
        if not stamps:
            return None
        from opentelemetry import trace as otel_trace

        first, last = stamps[0][1], stamps[-1][1]
        context = otel_trace.set_span_in_context(parent) if parent is not None else None
        span = self.tracer.start_span("InferRequest", context=context, start_time=first + self.offset,
                                      attributes={"triton.model_name": model,
                                                  "triton.model_version": int(version) if str(version).lstrip("-").isdigit() else -1,
                                                  "triton.trace_id": trace_id})
        for name, ns in stamps:
            span.add_event(name, timestamp=ns + self.offset)
        span.end(end_time=last + self.offset)
        return span

    def close(self) -> None:
        self.provider.shutdown()
