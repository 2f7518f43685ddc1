"""What the server's own shared-memory segments take, from its flags.

The launcher checks the start's share against /dev/shm before anything starts (a container's
/dev/shm is 64 MiB unless raised), the broker checks each model instance's share as it loads
(server/broker/lifecycle.py), and docs/deploy.md sizes a container's /dev/shm by these numbers.
"""
from __future__ import annotations

import argparse

from shmserve.shm import space
from shmserve.shm.channel import BrokerSegment, ClientSegment, WorkerSegment
from shmserve.shm.trace import SIZE as TRACE_BYTES

from .broker.ensemble import OWN_ARENA_BYTES, OWN_SLOTS
from .broker.options import BROKER_ARENA_BYTES

# Semaphores (a page each), the broker's journal and a frontend's FIFO: a few pages in all.
SMALL_OBJECTS_BYTES = 1 << 20


def frontend_count(args: argparse.Namespace) -> int:
    """HTTP frontends plus the gRPC one: each holds a client segment with its arena."""
    return (args.http_workers if args.allow_http else 0) + (1 if args.allow_grpc else 0)


def frontend_bytes(args: argparse.Namespace) -> int:
    return ClientSegment.nbytes(args.http_max_inflight, args.frontend_arena_mb << 20)


def broker_bytes(local_client_users: int = 0) -> int:
    """The broker's objects (a connect ring each for its user and the ``local_client_users``), its
    own client segment (ensemble steps) and the trace segment."""
    return BrokerSegment.nbytes(BROKER_ARENA_BYTES, local_client_users) + ClientSegment.nbytes(OWN_SLOTS, OWN_ARENA_BYTES) \
        + TRACE_BYTES


def startup_bytes(args: argparse.Namespace) -> int:
    """Every segment the server makes before its first model loads."""
    return (frontend_count(args) * frontend_bytes(args) + broker_bytes(len(args.local_client_users))
            + args.response_cache_bytes
            + SMALL_OBJECTS_BYTES)


def instance_bytes(worker_arena_start_bytes: int, local_client_users: int = 0) -> int:
    """One model instance's worker segment as it loads (rings, lanes and its output arena's first
    extent; each other user's lanes). The arena grows with answers up to --worker-arena-mb, each
    extent counted as it is made (shm/extents.py)."""
    return WorkerSegment.nbytes(worker_arena_start_bytes, local_client_users)


def check_startup(args: argparse.Namespace) -> None:
    """Raise space.NoRoom, naming the flags that set the sizes, when the start's segments do
    not fit in /dev/shm."""
    http = args.http_workers if args.allow_http else 0
    frontends = ([f"{http} HTTP frontend(s)"] if http else []) + (["the gRPC frontend"] if args.allow_grpc else [])
    parts = [f"{' and '.join(frontends)} with --frontend-arena-mb={args.frontend_arena_mb}"] if frontends else []
    parts.append("the broker")
    if args.response_cache_bytes:
        parts.append(f"a response cache of {space.mib(args.response_cache_bytes)}")
    each = instance_bytes(args.worker_arena_start_bytes, len(args.local_client_users))
    note = (f" (then {space.mib(each)} more per model instance, "
            f"each growing up to --worker-arena-mb={args.worker_arena_mb} with its answers)")
    space.check(args.id, startup_bytes(args), f"shmserve at start ({', '.join(parts)})", note)
