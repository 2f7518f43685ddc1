"""What one run of ``shmserve-perf`` does, as plain picklable values: the servers it talks to, the
load it puts on them, how it measures, and what each request carries. The client processes get
these values and nothing else."""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass, field

import numpy as np

PROTOCOLS = ("http", "grpc", "local")
DEFAULT_URLS = {"http": "localhost:8000", "grpc": "localhost:8001", "local": "shmserve"}


@dataclass(frozen=True)
class Target:
    """One server: ``address`` is host:port (HTTP, gRPC) or a shmserve ``--id`` (local)."""

    name: str
    protocol: str
    address: str

    @property
    def port(self) -> int | None:
        """The listening port, by which ``proc_cpu`` finds the server's processes; None for local."""
        return None if self.protocol == "local" else int(self.address.rsplit(":", 1)[1])


def parse_target(text: str, default_protocol: str, allow_remote: bool) -> Target:
    """``[NAME=][http:|grpc:|local:]ADDRESS``; without a protocol, ``default_protocol``."""
    name, sep, rest = text.partition("=")
    if not sep:
        name, rest = "", text
    protocol, colon, address = rest.partition(":")
    if not colon or protocol not in PROTOCOLS:
        protocol, address = default_protocol, rest
    if not address or (protocol != "local" and ":" not in address):
        raise ValueError(f"bad server {text!r}: expected [NAME=][http:|grpc:|local:]HOST:PORT (or local:SERVER_ID)")
    if protocol != "local" and not allow_remote:
        require_loopback(address)
    return Target(name or rest, protocol, address)


def require_loopback(address: str) -> None:
    """A load generator stays on this machine unless told otherwise (``--allow-remote``)."""
    host = address.rsplit(":", 1)[0].strip("[]")
    for info in socket.getaddrinfo(host, None):
        addr = ipaddress.ip_address(info[4][0])
        if not addr.is_loopback:
            raise ValueError(f"{address!r} is not on this machine ({addr}); pass --allow-remote to load it")


def parse_range(text: str, integer: bool) -> tuple[float, ...]:
    """perf_analyzer's ``START[:END[:STEP]]`` to the levels it names, END included; or the
    levels themselves, ``A,B,C`` (1,2,4,8 is no single step)."""
    num = int if integer else float
    if "," in text:
        try:
            levels = tuple(num(v) for v in text.split(","))
        except ValueError:
            raise ValueError(f"bad levels {text!r}: expected numbers, comma-separated") from None
        if min(levels) <= 0:
            raise ValueError(f"bad levels {text!r}: each must be above 0")
        return levels
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or not all(parts):
        raise ValueError(f"bad range {text!r}: expected START[:END[:STEP]]")
    start = num(parts[0])
    end = num(parts[1]) if len(parts) > 1 else start
    step = num(parts[2]) if len(parts) > 2 else num(1)
    if start <= 0 or end < start or step <= 0:
        raise ValueError(f"bad range {text!r}: needs 0 < START <= END and STEP > 0")
    levels, value = [], start
    while value <= end + 1e-9:
        levels.append(value)
        value = num(round(value + step, 9))
    return tuple(levels)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor as every request sends it: name, KServe datatype, full shape (batch included)."""

    name: str
    datatype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Load:
    """The sweep: closed loops of ``levels`` concurrent requests, or an open loop at ``levels``
    requests per second with ``distribution`` intervals."""

    mode: str  # "concurrency" or "request_rate"
    levels: tuple[float, ...]
    distribution: str = "constant"
    threads: int = 16  # open loop: the most requests in flight at once, over all client processes


@dataclass(frozen=True)
class Measurement:
    """perf_analyzer's stabilization: windows of ``interval_ms`` until the last three agree
    within ``stability_pct`` in throughput and latency (``percentile``, or the average), at most
    ``max_trials`` windows, after ``warmup_ms`` of unmeasured load."""

    interval_ms: int = 5000
    percentile: int | None = None
    stability_pct: float = 10.0
    max_trials: int = 10
    warmup_ms: int = 0


@dataclass(frozen=True)
class Requests:
    """What each request carries and how: ``data[stream][step]`` maps input names to arrays (one
    stream unless ``--input-data`` gives several for a sequence model)."""

    model: str
    version: str
    batch: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    data: tuple[tuple[dict[str, np.ndarray], ...], ...] = field(repr=False)
    shared_memory: str = "none"
    output_shm_size: int = 102400
    sequence: bool = False
    sequence_length: int = 20
    sequence_variation_pct: float = 20.0
    sequence_id_start: int = 1
    decoupled: bool = False
    timeout_s: float = 120.0

    def entries(self) -> list[dict[str, np.ndarray]]:
        """Every step of every stream, in order: the round robin of a model without sequences."""
        return [step for stream in self.data for step in stream]
