"""OpenTelemetry export of traces (``--trace-config mode=opentelemetry``), optional.

Needs ``opentelemetry-sdk`` and ``opentelemetry-exporter-otlp-proto-http`` (``pip install
'shmserve[trace]'``). Like Triton, each traced request becomes one span named ``InferRequest`` with
the model and trace id as attributes and one event per timestamp, sent to ``opentelemetry,url=``
(OTLP over HTTP; default http://localhost:4318/v1/traces). Spans are exported from a background
thread (the SDK's batch processor), so the event loop never waits on the collector.
"""
from __future__ import annotations

import importlib.util
import time
from typing import Any


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
    def __init__(self, url: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.url = url
        self.provider = TracerProvider(resource=Resource.create({"service.name": "shmserve"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url),
                                                            schedule_delay_millis=200))
        self.tracer = self.provider.get_tracer("shmserve")
        # Timestamps are CLOCK_MONOTONIC; spans want wall-clock ns.
        self.offset = time.time_ns() - time.monotonic_ns()

    def export(self, trace_id: int, model: str, version: Any, stamps: list[tuple[str, int]]) -> None:
        if not stamps:
            return
        first, last = stamps[0][1], stamps[-1][1]
        span = self.tracer.start_span("InferRequest", start_time=first + self.offset,
                                      attributes={"triton.model_name": model,
                                                  "triton.model_version": int(version) if str(version).lstrip("-").isdigit() else -1,
                                                  "triton.trace_id": trace_id})
        for name, ns in stamps:
            span.add_event(name, timestamp=ns + self.offset)
        span.end(end_time=last + self.offset)

    def close(self) -> None:
        self.provider.shutdown()
