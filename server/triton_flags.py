"""``tritonserver`` flags that shmserve accepts but does not act on (or acts on only in part).

Operators arrive with ``tritonserver`` command lines: a flag shmserve does not know must neither
stop the server with a usage error nor be dropped in silence. Each flag here is accepted under
Triton's exact spelling, and ``notices`` says at start, by name, what it does here.
"""
from __future__ import annotations

import argparse
import logging
from typing import Callable

from . import triton_values
from shmserve.shm.extents import DEFAULT_BYTES_SETTING, DEFAULT_GROWTH_BYTES, DEFAULT_START_BYTES, \
    GROWTH_BYTES_SETTING, MIN_START_BYTES

# Triton's gRPC flags that grpcio's asyncio server in one process has nothing to map onto, by
# name, with what stands in their place (the others are server/grpc/options.py's and cli.py's).
GRPC_FLAGS: dict[str, str] = {
    "--grpc-infer-allocation-pool-size": "grpcio allocates each call's state itself; there is no pool to size",
    "--grpc-max-response-pool-size": "each response is sent as soon as it is built; there is no response pool",
    "--grpc-infer-thread-count": "one gRPC process serves every call on one asyncio loop, and the models run in "
                                 "worker processes of their own; --http-max-inflight bounds the calls in flight",
}

# Triton's other flags that have nothing to act on here: flag -> (metavar, why). Each one given is
# accepted and named in a WARNING at start (the test walks Triton's help text against these tables).
NO_EFFECT_FLAGS: dict[str, tuple[str, str]] = {
    "--http-thread-count": ("N", "each HTTP frontend process serves its connections on one event loop; "
                                 "--http-workers sets the number of processes"),
    "--enable-peer-access": ("BOOL", "no CUDA peer access is set up: each instance works on its one device"),
    "--backend-directory": ("PATH", "backends are Python packages (the 'shmserve.backends' entry points), not "
                                    "shared libraries in a directory"),
    "--repoagent-directory": ("PATH", "repository agents are not supported"),
    "--pinned-memory-pool-byte-size": ("BYTES", "tensors are copied between host and device by each worker's "
                                                "framework; there is no pinned-memory pool to size"),
    "--cuda-memory-pool-byte-size": ("GPU:BYTES", "each worker's framework allocates its own device memory; "
                                                  "there is no CUDA memory pool to size"),
    "--cuda-virtual-address-size": ("GPU:BYTES", "each worker's framework allocates its own device memory; "
                                                 "there is no virtual address space to reserve"),
    "--min-supported-compute-capability": ("X.Y", "a GPU is used if the worker's framework supports it"),
    "--buffer-manager-thread-count": ("N", "tensors move through shared memory with no buffer manager threads"),
    "--host-policy": ("NAME,SETTING=VALUE", "no NUMA or CPU placement policy is applied to workers"),
    "--model-load-gpu-limit": ("GPU:FRACTION", "loads are not held back by the memory a GPU has in use"),
    "--sagemaker-port": ("PORT", "the SageMaker endpoint is not served"),
    "--sagemaker-safe-port-range": ("LOW-HIGH", "the SageMaker endpoint is not served"),
    "--sagemaker-thread-count": ("N", "the SageMaker endpoint is not served"),
    "--vertex-ai-port": ("PORT", "the Vertex AI endpoint is not served"),
    "--vertex-ai-thread-count": ("N", "the Vertex AI endpoint is not served"),
    "--vertex-ai-default-model": ("MODEL", "the Vertex AI endpoint is not served"),
}

# How Triton 2.51 reads each of those flags' values: one it refuses is refused here too (the others,
# and --grpc-infer-thread-count and --grpc-max-response-pool-size of later Triton, are integers).
_V = triton_values
VALUE_READERS: dict[str, Callable[[str], object]] = {
    "--enable-peer-access": _V.boolean, "--backend-directory": str, "--repoagent-directory": str,
    "--vertex-ai-default-model": str,
    "--pinned-memory-pool-byte-size": lambda v: _V.integer(v, _V.INT64),
    "--cuda-memory-pool-byte-size": _V.pair(":", _V.integer, lambda v: _V.integer(v, _V.UINT64)),
    "--cuda-virtual-address-size": _V.pair(":", _V.integer, lambda v: _V.integer(v, _V.UINT64)),
    "--min-supported-compute-capability": _V.real,
    "--host-policy": _V.config("host-policy", "policy name"),
    "--model-load-gpu-limit": _V.pair(":", _V.integer, _V.real),
    "--sagemaker-safe-port-range": _V.pair("-", _V.integer, _V.integer),
}


def _as_given(read: Callable[[str], object]) -> Callable[[str], str]:
    """``read`` as an argparse type that checks a value and keeps it as given (the notices show it so)."""
    def check(arg: str) -> str:
        read(arg)
        return arg
    return check


# Triton's switches for what shmserve does not have: false (their default) is accepted, true is
# refused at start by name: the server would not do what the command line asks.
REFUSED_WHEN_TRUE: dict[str, str] = {
    "--model-namespacing": "model namespacing is not supported: a model name is unique across the repositories",
    "--allow-sagemaker": "the SageMaker endpoint is not served",
    "--allow-vertex-ai": "the Vertex AI endpoint is not served",
}

# Triton's deprecated trace flags, each the same as one --trace-config setting (as Triton maps them).
TRACE_FLAGS: dict[str, str] = {
    "--trace-file": "triton,file", "--trace-level": "level", "--trace-rate": "rate", "--trace-count": "count",
    "--trace-log-frequency": "triton,log_frequency",
}
# How Triton 2.51 reads them (an empty or malformed value refused, but --trace-file's, a path).
TRACE_READERS: dict[str, Callable[[str], str]] = {
    "--trace-level": triton_values.trace_level, "--trace-rate": _as_given(triton_values.integer),
    "--trace-count": _as_given(triton_values.integer), "--trace-log-frequency": _as_given(triton_values.integer),
}

# (backend, setting) of --backend-config -> why it has no effect here; the known ones say what plays
# their part instead. The python backend's shm-default-byte-size and shm-growth-byte-size are
# honoured (``worker_arena_sizes``): they size each worker's output arena as it starts and grows.
HONOURED_BACKEND_SETTINGS = frozenset({("python", DEFAULT_BYTES_SETTING), ("python", GROWTH_BYTES_SETTING)})
# --backend-config [onnxruntime,]default-max-batch-size=N: the max_batch_size ONNX auto-completion
# gives a model that can batch (workers/onnx_graph.py), 4 unset, as Triton's.
MAX_BATCH_SETTING = "default-max-batch-size"
DEFAULT_MAX_BATCH_SIZE = 4
BACKEND_SETTINGS: dict[tuple[str, str], str] = {
    ("python", "shm-region-prefix-name"): "shared-memory names derive from --id",
    ("python", "stub-timeout-seconds"): "workers report to the broker through shared memory, with no stub timeout",
    ("python", "shm-message-queue-size"): "requests reach workers through shared-memory rings of fixed size",
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
                   help="Triton's backend settings: python,shm-default-byte-size and python,shm-growth-byte-size "
                        "size each instance's output extents, [onnxruntime,]default-max-batch-size is ONNX "
                        "auto-completion's max_batch_size (docs/flags.md); any other is accepted and named in "
                        "a warning at start, since it applies to none of shmserve's backends; repeatable")
    for flag in GRPC_FLAGS:
        p.add_argument(flag, action="append", default=[], type=_as_given(triton_values.integer), metavar="N",
                       help="accepted for Triton's command lines, with a warning at start: no effect here")
    for flag, (metavar, why) in NO_EFFECT_FLAGS.items():
        p.add_argument(flag, action="append", default=[], type=_as_given(VALUE_READERS.get(flag, triton_values.integer)),
                       metavar=metavar, help=f"accepted for Triton's command lines, with a warning at start: {why}")
    for flag, why in REFUSED_WHEN_TRUE.items():
        add_bool(p, flag, None, f"false is accepted; true is refused: {why}")
    for flag, setting in TRACE_FLAGS.items():  # (read as Triton reads them: an empty --trace-file is no file)
        p.add_argument(flag, action="append", default=[], metavar="VALUE", type=TRACE_READERS.get(flag, str),
                       help=f"deprecated in Triton: the same as --trace-config {setting}=VALUE")
    p.add_argument("--model-config-name", default=None, metavar="NAME",
                   help="as Triton's: load each model's configs/NAME.pbtxt where it exists, else its config.pbtxt")
    p.add_argument("--model-load-retry-count", type=int, default=0, metavar="N",
                   help="as Triton's: a model whose load fails is tried again up to N more times (default 0)")
    add_bool(p, "--reuse-http-port", False, "as Triton's: bind the HTTP port with SO_REUSEPORT, so that several "
                                            "servers may share it (default false)")
    add_bool(p, "--reuse-grpc-port", False, "as Triton's: bind the gRPC port with SO_REUSEPORT (default false)")


def backend_settings(items: list[str]) -> list[tuple[str, str, str]]:
    """``--backend-config`` items as (backend, setting, value), split as Triton splits them;
    ValueError names a malformed one in Triton's words."""
    try:
        return [triton_values.backend_config(item) for item in items]
    except argparse.ArgumentTypeError as e:
        raise ValueError(str(e)) from None


def worker_arena_sizes(args: argparse.Namespace) -> tuple[int, int]:
    """(first extent, least growth) of each worker's output arena, in bytes, from
    ``--backend-config python,shm-default-byte-size=N`` and ``shm-growth-byte-size=N`` (Triton's
    python backend's names); ValueError names a value that is not a size or passes the cap."""
    cap = args.worker_arena_mb << 20
    start, growth = min(DEFAULT_START_BYTES, cap), DEFAULT_GROWTH_BYTES
    for backend, setting, value in backend_settings(args.backend_config):
        if (backend, setting) not in HONOURED_BACKEND_SETTINGS:
            continue
        named = f"--backend-config {backend},{setting}={value}"
        try:
            n = int(value)
        except ValueError:
            raise ValueError(f"{named}: expected a number of bytes") from None
        if setting == DEFAULT_BYTES_SETTING:
            if not MIN_START_BYTES <= n <= cap:
                raise ValueError(f"{named}: must lie between {MIN_START_BYTES} and --worker-arena-mb "
                                 f"({args.worker_arena_mb} MiB = {cap} bytes), which caps the arena's growth")
            start = -(-n // 4096) * 4096  # whole pages
        else:
            if n < 1:
                raise ValueError(f"{named}: must be at least 1")
            growth = n
    return start, growth


def default_max_batch_size(args: argparse.Namespace) -> int:
    """``--backend-config [onnxruntime,]default-max-batch-size=N`` (the last one given; a negative
    N is 0, as Triton clamps it); ValueError names a value that is not an integer."""
    n = DEFAULT_MAX_BATCH_SIZE
    for backend, setting, value in backend_settings(args.backend_config):
        if setting == MAX_BATCH_SETTING and backend in ("", "onnxruntime"):
            try:
                n = int(value)
            except ValueError:
                raise ValueError(f"--backend-config {backend + ',' if backend else ''}{setting}={value}: expected "
                                 f"an integer") from None
    return max(n, 0)


def trace_items(args: argparse.Namespace) -> list[tuple[int, str]]:
    """Fold the deprecated trace flags into ``args.trace_config`` (before it is parsed; a
    --trace-config setting given too wins, as it comes later) and name each in a WARNING."""
    items, out = [], []
    for flag, setting in TRACE_FLAGS.items():
        for value in getattr(args, _dest(flag)):
            if value:  # (an empty --trace-file, which Triton takes, is no setting; the others are refused)
                items.append(f"{setting}={value}")
            out.append((logging.WARNING, f"{flag} is deprecated: use --trace-config {setting}={value}"))
    args.trace_config = items + list(args.trace_config)
    return out


def strict_config_notices(args: argparse.Namespace) -> list[tuple[int, str]]:
    """Triton's warnings for its deprecated ``--strict-model-config`` (given: not None), and for
    ``=false`` overridden by ``--disable-auto-complete-config``; ``args.strict_model_config``
    becomes the setting that results."""
    out: list[tuple[int, str]] = []
    if args.strict_model_config is not None:
        out.append((logging.WARNING, "'--strict-model-config' has been deprecated! Please use "
                                     "'--disable-auto-complete-config' instead."))
        if args.disable_auto_complete_config and not args.strict_model_config:
            out.append((logging.WARNING, "Overriding deprecated '--strict-model-config' from False to True in "
                                         "favor of '--disable-auto-complete-config'!"))
    args.strict_model_config = bool(args.strict_model_config or args.disable_auto_complete_config)
    return out


def _dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def notices(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(log level, line) for each of these flags given; ValueError for what is refused."""
    if args.model_load_thread_count is not None and args.model_load_thread_count < 0:
        raise ValueError("--model-load-thread-count must be 0 or more")  # (Triton takes 0)
    if args.model_load_retry_count < 0:
        raise ValueError("--model-load-retry-count must be 0 or more")
    if args.model_config_name == "":  # given empty: Triton's words
        raise ValueError("empty argument for --model-config-name")
    args.model_config_name = args.model_config_name or ""
    if any(c.isspace() for c in args.model_config_name) or "/" in args.model_config_name:
        raise ValueError(f"--model-config-name '{args.model_config_name}': a name, with no space or '/'")
    for flag, why in REFUSED_WHEN_TRUE.items():
        if getattr(args, _dest(flag)):
            raise ValueError(f"{flag}=true is not supported: {why}")
    out: list[tuple[int, str]] = trace_items(args) + strict_config_notices(args)
    for flag, (_, why) in NO_EFFECT_FLAGS.items():
        for value in getattr(args, _dest(flag)):  # (repeatable, as Triton's --host-policy and others)
            out.append((logging.WARNING, f"{flag} {value} has no effect: {why}"))
    args.worker_arena_start_bytes, args.worker_arena_growth_bytes = worker_arena_sizes(args)
    args.default_max_batch_size = default_max_batch_size(args)
    for backend, setting, value in backend_settings(args.backend_config):
        if (backend, setting) in HONOURED_BACKEND_SETTINGS or (setting == MAX_BATCH_SETTING
                                                               and backend in ("", "onnxruntime")):
            continue
        why = BACKEND_SETTINGS.get((backend, setting), "shmserve's backends have no such setting")
        named = f"{backend},{setting}" if backend else setting
        out.append((logging.WARNING, f"--backend-config {named}={value} is not supported and has no effect: {why}"))
    for flag in GRPC_FLAGS:
        for value in getattr(args, _dest(flag)):
            out.append((logging.WARNING, f"{flag} {value} has no effect: {GRPC_FLAGS[flag]}"))
    if args.model_load_thread_count is not None:
        out.append((logging.INFO, f"--model-load-thread-count {args.model_load_thread_count}: every model "
                                  f"instance loads in a process of its own, all at once; the count has no effect"))
    return out
