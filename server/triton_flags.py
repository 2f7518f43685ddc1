"""``tritonserver`` flags that shmserve accepts but does not act on (or acts on only in part).

Operators arrive with ``tritonserver`` command lines: a flag shmserve does not know must neither
stop the server with a usage error nor be dropped in silence. Each flag here is accepted under
Triton's exact spelling; ``notices`` says at start, by name, what it does here, and refuses only
what cannot be honoured (``--allow-http=false``: the HTTP frontend cannot be turned off).
"""
from __future__ import annotations

import argparse
import logging
from typing import Callable

# Triton's gRPC flags that the gRPC frontend does not act on yet, by name; True where the flag is
# a boolean (--allow-grpc, --grpc-port and --grpc-address are cli.py's own).
GRPC_FLAGS: dict[str, bool] = {
    "--grpc-header-forward-pattern": False,
    "--grpc-infer-allocation-pool-size": False, "--grpc-max-response-pool-size": False, "--grpc-use-ssl": True,
    "--grpc-use-ssl-mutual": True, "--grpc-server-cert": False, "--grpc-server-key": False,
    "--grpc-root-cert": False, "--grpc-infer-response-compression-level": False, "--grpc-keepalive-time": False,
    "--grpc-keepalive-timeout": False, "--grpc-keepalive-permit-without-calls": True,
    "--grpc-http2-max-pings-without-data": False, "--grpc-http2-min-recv-ping-interval-without-data": False,
    "--grpc-http2-max-ping-strikes": False, "--grpc-restricted-protocol": False,
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
    add_bool(p, "--allow-http", True,
             "serve HTTP (default true); false is refused: the HTTP frontend cannot be turned off")
    p.add_argument("--model-load-thread-count", type=int, default=None, metavar="N",
                   help="accepted for Triton's command lines; every instance loads in a process of its own, "
                        "all at once, so the count has no effect")
    p.add_argument("--backend-config", action="append", default=[], metavar="[BACKEND,]SETTING=VALUE",
                   help="Triton's backend settings: accepted, and each one named in a warning at start, "
                        "since none applies to shmserve's backends; repeatable")
    for flag, is_bool in GRPC_FLAGS.items():
        help_text = "not acted on by the gRPC frontend yet: accepted, with a warning naming it"
        if is_bool:
            add_bool(p, flag, None, help_text)  # None: not given
        else:
            p.add_argument(flag, default=None, metavar="VALUE", help=help_text)


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
    if not args.allow_http:
        raise ValueError("--allow-http=false: HTTP is the only network protocol that cannot be turned off in "
                         "shmserve; gRPC (--allow-grpc) and local programs through shared memory are served beside it")
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
        out.append((logging.WARNING, f"{flag} has no effect: the gRPC frontend does not act on it yet"))
    if args.model_load_thread_count is not None:
        out.append((logging.INFO, f"--model-load-thread-count {args.model_load_thread_count}: every model "
                                  f"instance loads in a process of its own, all at once; the count has no effect"))
    return out
