"""What the launcher tells the broker (passed as JSON on its command line, never pickled)."""
from __future__ import annotations

import dataclasses
from typing import Any


STARTUP_FAILED = 3  # the broker's exit code when a model failed at start with --exit-on-error
BROKER_ARENA_BYTES = 64 << 20  # the broker's own arena (batch descriptors, control replies)


@dataclasses.dataclass
class BrokerOptions:
    server_id: str
    repositories: list[str]
    control_mode: str = "none"
    repository_poll_s: int = 15  # poll mode: seconds between scans of the repositories (0: events only)
    load_models: list[str] = dataclasses.field(default_factory=list)
    strict_config: bool = False
    config_name: str = ""  # --model-config-name: each model's configs/<name>.pbtxt where it exists
    load_retries: int = 0  # --model-load-retry-count: more tries of a load whose instances fail
    strict_readiness: bool = True
    exit_on_error: bool = True
    exit_timeout_s: float = 30.0
    log: dict[str, Any] = dataclasses.field(default_factory=dict)  # Triton's log settings (shm/logs.py)
    trace: dict[str, Any] = dataclasses.field(default_factory=dict)  # --trace-config settings (shm/trace.py)
    # The log and trace files as their flags named them, relative or not: Triton's logging and trace
    # APIs show them so (the settings hold absolute paths, which every process opens whatever its cwd)
    log_file_shown: str = ""
    trace_file_shown: str = ""
    broker_arena_bytes: int = BROKER_ARENA_BYTES  # its first extent, in broker.0
    broker_arena_cap_bytes: int = 256 << 20  # --broker-arena-mb: the cap of its output extents together
    worker_arena_bytes: int = 256 << 20  # --worker-arena-mb: the cap of one instance's output extents
    # --backend-config python,shm-default-byte-size / shm-growth-byte-size (shm/extents.py)
    worker_arena_start_bytes: int = 4 << 20
    worker_arena_growth_bytes: int = 1 << 20
    # --backend-config [onnxruntime,]default-max-batch-size: ONNX auto-completion's max_batch_size
    default_max_batch_size: int = 4
    allow_remote_shm: bool = False
    allow_client_shm: bool = True  # --allow-client-shm: false refuses every client region (region_access.py)
    allow_file_uploads: bool = False  # --allow-model-file-uploads: loads with 'file:' contents from any client
    metrics_port: int = 8002
    metrics_address: str = "0.0.0.0"  # --metrics-address (default: --http-address)
    metrics_interval_ms: int = 2000
    metrics_config: dict[str, str] = dataclasses.field(default_factory=dict)  # Triton's --metrics-config
    cpu_metrics: bool = True
    gpu_metrics: bool = True
    poll_us: int = 500  # --poll-us: how long a worker polls for its next request before it sleeps
    response_cache_bytes: int = 0  # --cache-config local,size=<bytes>: the response cache (0: none)
    rate_limit: str = "off"  # --rate-limit: off or execution_count (rate_limiter.py)
    rate_limit_resources: list[tuple[str, int, int | None]] = dataclasses.field(default_factory=list)  # (name, count, device)
    # The local copies of cloud repositories (s3://, gs://, as://) among ``repositories``:
    # {local repository folder: its URL}, re-synced while serving (cloud_sync.py)
    cloud_repositories: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def histogram_latencies(self) -> bool:
        """``--metrics-config histogram_latencies=true``: workers count latency histograms."""
        return self.metrics_config.get("histogram_latencies") == "true"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "BrokerOptions":
        return cls(**data)
