"""Host figures for the metrics: CPU utilization and memory from /proc (GPUs: ``gpu_metrics.py``)."""
from __future__ import annotations

import time


def _cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat", "rb") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user and nice
    return total - idle, total


def _memory() -> tuple[int, int]:
    """(total, used) bytes of RAM, used meaning not available to new programs (MemAvailable)."""
    info: dict[str, int] = {}
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            key, _, rest = line.partition(b":")
            info[key.decode()] = int(rest.split()[0]) * 1024
    total = info.get("MemTotal", 0)
    return total, total - info.get("MemAvailable", info.get("MemFree", 0))


class CpuSampler:
    """Utilization over the last interval: sampled at most once per ``interval_s`` (Triton's
    ``--metrics-interval-ms``), so scrapes in between see the same figure."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = max(0.05, interval_s)
        self._last = _cpu_times()
        self._at = time.monotonic()
        self._figures = (0.0, *_memory())

    def sample(self) -> tuple[float, int, int]:
        now = time.monotonic()
        if now - self._at >= self.interval_s:
            busy, total = _cpu_times()
            d_busy, d_total = busy - self._last[0], total - self._last[1]
            self._last, self._at = (busy, total), now
            self._figures = (d_busy / d_total if d_total > 0 else 0.0, *_memory())
        return self._figures
