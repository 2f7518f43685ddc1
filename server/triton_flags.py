"""``tritonserver`` flags that shmserve accepts but does not act on (or acts on only in part).

Operators arrive with ``tritonserver`` command lines: a flag shmserve does not know must neither
stop the server with a usage error nor be dropped in silence. Each flag here is accepted under
Triton's exact spelling, and ``notices`` says at start, by name, what it does here.
"""
from __future__ import annotations

import argparse
import logging
from typing import Callable

# Triton's gRPC flags that grpcio's asyncio server in one process has nothing to map onto, by
# name, with what stands in their place (the others are server/grpc/options.py's and cli.py's).
GRPC_FLAGS: dict[str, str] = {
    "--grpc-header-forward-pattern": "gRPC metadata is not forwarded as request parameters (neither are HTTP "
                                     "headers)",
    "--grpc-infer-allocation-pool-size": "grpcio allocates each call's state itself; there is no pool to size",
    "--grpc-max-response-pool-size": "each response is sent as soon as it is built; there is no response pool",
    "--grpc-infer-thread-count": "one gRPC process serves every call on one asyncio loop, and the models run in "
                                 "worker processes of their own; --http-max-inflight bounds the calls in flight",
}

# (backend, setting) of --backend-config -> why it has no effect here. None of Triton's backend
# settings maps onto something shmserve has; the known ones say what plays their part instead.
BACKEND_SETTINGS: dict[tuple[str, str], str] = {
    ("python", "shm-default-byte-size"): "tensors travel through each worker's arena, sized by --worker-arena-mb",
    ("python", "shm-growth-byte-size"): "tensors travel through each worker's arena, sized by --worker-arena-mb",
    ("python", "shm-region-prefix-name"): "shared-memory names derive from --id",
    ("python", "stub-timeout-seconds"): "workers report to the broker through shared memory, with no stub timeout",
    ("python", "shm-message-queue-size"): "requests reach workers through shared-memory rings of fixed size",
    ("", "default-max-batch-size"): "auto-completion never sets max_batch_size on its own",
}


def add_flags(p: argparse.ArgumentParser, add_bool: Callable[..., None]) -> None:
    """Add the flags of this module to the parser ``p`` (``add_bool`` is cli.add_bool)."""
    add_bool(p, "--disable-auto-complete-config", False,
             "as Triton's: no auto-completion; each model's config.pbtxt must be complete "
             "(the same as --strict-model-config=true; default false)")
    p.add_argument("--metrics-address", default=None, metavar="ADDR",
                   help="address the metrics server binds (default: --http-address, as Triton's)")
    p.add_argument("--model-load-thread-count", type=int, default=None, metavar="N",
                   help="accepted for Triton's command lines; every instance loads in a process of its own, "
                        "all at once, so the count has no effect")
    p.add_argument("--backend-config", action="append", default=[], metavar="[BACKEND,]SETTING=VALUE",
                   help="Triton's backend settings: accepted, and each one named in a warning at start, "
                        "since none applies to shmserve's backends; repeatable")
    for flag in GRPC_FLAGS:
        p.add_argument(flag, default=None, metavar="VALUE", help="accepted for Triton's command lines, with a "
                                                                  "warning at start: no effect here")


def backend_settings(items: list[str]) -> list[tuple[str, str, str]]:
    """``--backend-config`` items as (backend, setting, value); ValueError names a malformed one."""
    out = []
    for item in items:
        head, sep, value = item.rpartition("=")
        backend, _, setting = head.rpartition(",")
        if not sep or not setting.strip():
            raise ValueError(f"--backend-config '{item}': expected [<backend>,]<setting>=<value>")
        out.append((backend.strip(), setting.strip(), value))
    return out


def notices(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(log level, line) for each of these flags given; ValueError for what is refused."""
    if args.model_load_thread_count is not None and args.model_load_thread_count < 1:
        raise ValueError("--model-load-thread-count must be at least 1")
    out: list[tuple[int, str]] = []
    for backend, setting, value in backend_settings(args.backend_config):
        why = BACKEND_SETTINGS.get((backend, setting), "shmserve's backends have no such setting")
        named = f"{backend},{setting}" if backend else setting
        out.append((logging.WARNING, f"--backend-config {named}={value} is not supported and has no effect: {why}"))
    for flag in GRPC_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is None:
            continue
        out.append((logging.WARNING, f"{flag} {value} has no effect: {GRPC_FLAGS[flag]}"))
    if args.model_load_thread_count is not None:
        out.append((logging.INFO, f"--model-load-thread-count {args.model_load_thread_count}: every model "
                                  f"instance loads in a process of its own, all at once; the count has no effect"))
    return out
