"""The server's own account of the requests (the statistics extension), read at the edges of each
measurement window: how many it served and how long they queued and computed. Any KServe v2 server
with Triton's statistics extension answers it; shmserve's local client asks the broker directly."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from shmserve.tools.perf.plan import Target


@dataclass(frozen=True)
class Counters:
    """Cumulative counters of one model (all its versions, or the one asked for); nanoseconds."""

    inference_count: int = 0
    execution_count: int = 0
    success_count: int = 0
    success_ns: int = 0
    queue_count: int = 0
    queue_ns: int = 0
    compute_input_count: int = 0
    compute_input_ns: int = 0
    compute_infer_count: int = 0
    compute_infer_ns: int = 0
    compute_output_count: int = 0
    compute_output_ns: int = 0

    def __sub__(self, other: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def __add__(self, other: "Counters") -> "Counters":
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def average_us(self, part: str) -> float:
        """Average microseconds per request of ``part`` (success, queue, compute_input, ...)."""
        count = getattr(self, f"{part}_count")
        return getattr(self, f"{part}_ns") / count / 1e3 if count else 0.0


def counters(doc: dict[str, Any], model: str, version: str) -> Counters:
    """The statistics answer (HTTP's JSON, gRPC's as_json with int64 as strings) summed over the
    model's versions, or only ``version``."""
    total = Counters()
    for row in doc.get("model_stats", []):
        if row.get("name") != model or (version and str(row.get("version")) != version):
            continue
        stats = row.get("inference_stats", {})
        values = {"inference_count": int(row.get("inference_count", 0)),
                  "execution_count": int(row.get("execution_count", 0))}
        for part in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
            values[f"{part}_count"] = int(stats.get(part, {}).get("count", 0))
            values[f"{part}_ns"] = int(stats.get(part, {}).get("ns", 0))
        total = total + Counters(**values)
    return total


class StatsReader:
    """A connection that reads one model's counters; ``None`` from ``read`` when the server has
    no statistics extension (the columns that need it are then left empty)."""

    def __init__(self, target: Target, model: str, version: str) -> None:
        self.target, self.model, self.version = target, model, version
        self.available = True
        if target.protocol == "http":
            import tritonclient.http as httpclient

            self.client: Any = httpclient.InferenceServerClient(target.address, connection_timeout=10.0,
                                                                network_timeout=60.0)
        elif target.protocol == "grpc":
            import tritonclient.grpc as grpcclient

            self.client = grpcclient.InferenceServerClient(target.address)
        else:
            from shmserve.shm.client import Client

            self.client = Client(target.address)

    def read(self) -> Counters | None:
        if not self.available:
            return None
        try:
            if self.target.protocol == "http":
                doc = self.client.get_inference_statistics(self.model, self.version)
            elif self.target.protocol == "grpc":
                doc = self.client.get_inference_statistics(self.model, self.version, as_json=True)
            else:
                doc = self.client.model_statistics(self.model, self.version)
        except Exception:  # noqa: BLE001 - a server without the extension: measured without it
            self.available = False
            return None
        return counters(doc, self.model, self.version)

    def close(self) -> None:
        self.client.close()
