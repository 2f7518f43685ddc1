"""Triton's gRPC server flags (TLS, keepalive, response compression, restricted protocols, header
forwarding): their definitions, their checks at start, and the grpc server settings they become.

The launcher parses these without importing grpcio: ``grpc_spec`` turns the flags into plain data
(channel arguments, certificate paths, restrictions) for the gRPC process's spec, which
``__main__.py`` hands to ``grpc.aio.server`` as they are. Defaults and meanings are Triton's
(``src/command_line_parser.cc``, ``src/grpc/grpc_server.h``).
"""
from __future__ import annotations

import argparse
from typing import Any, Callable

from shmserve.host_limits import usable_memory
from shmserve.server.edge.header_forward import GRPC_FLAG as FORWARD_FLAG, compile_pattern
from shmserve.server.edge.restrictions import parse as parse_restricted

# Triton's --grpc-infer-response-compression-level as grpc_compression_level. The level becomes
# grpc's default for the server's responses: grpc picks the algorithm among those the client
# accepts (low: gzip; medium and high: deflate when the client takes it).
COMPRESSION_LEVELS = {"none": 0, "low": 1, "medium": 2, "high": 3}

# Integer flag -> (grpc channel argument, Triton's default, smallest value). The connection-age
# pair defaults to 0, which (as in Triton) leaves the argument unset: grpc's own default, no limit;
# so does --grpc-max-connection-idle (not Triton's: it keeps idle connections for good).
INT_FLAGS: dict[str, tuple[str, int, int]] = {
    "--grpc-keepalive-time": ("grpc.keepalive_time_ms", 7_200_000, 1),
    "--grpc-keepalive-timeout": ("grpc.keepalive_timeout_ms", 20_000, 1),
    "--grpc-http2-max-pings-without-data": ("grpc.http2.max_pings_without_data", 2, 0),
    "--grpc-http2-min-recv-ping-interval-without-data": ("grpc.http2.min_ping_interval_without_data_ms", 300_000, 0),
    "--grpc-http2-max-ping-strikes": ("grpc.http2.max_ping_strikes", 2, 0),
    "--grpc-max-connection-age": ("grpc.max_connection_age_ms", 0, 0),
    "--grpc-max-connection-age-grace": ("grpc.max_connection_age_grace_ms", 0, 0),
    "--grpc-max-connection-idle": ("grpc.max_connection_idle_ms", 0, 0),
}
INT_HELP = {
    "--grpc-keepalive-time": "milliseconds between the server's keepalive pings (default 7200000, as Triton's)",
    "--grpc-keepalive-timeout": "milliseconds the server waits for a keepalive ping's ack before it closes the "
                                "connection (default 20000)",
    "--grpc-http2-max-pings-without-data": "pings the server sends with no data between them; 0: no limit (default 2)",
    "--grpc-http2-min-recv-ping-interval-without-data": "milliseconds a client must leave between pings while no "
                                                        "data flows; a ping sooner is a strike (default 300000)",
    "--grpc-http2-max-ping-strikes": "strikes before the server closes the connection with GOAWAY too_many_pings; "
                                     "0: any number (default 2)",
    "--grpc-max-connection-age": "milliseconds a connection may live before the server asks the client to "
                                 "reconnect; 0: no limit (default 0)",
    "--grpc-max-connection-age-grace": "milliseconds calls may go on after that; 0: no limit (default 0)",
    "--grpc-max-connection-idle": "milliseconds a connection may carry no call before the server closes it "
                                  "(GOAWAY 'connection idle'); 0: never, as Triton (default 0)",
}
MAX_CONNECTIONS_FLAG = "--grpc-max-connections"  # Triton has none: it accepts until out of descriptors
MAX_INT = (1 << 31) - 1  # grpc's limit for a channel argument, and Triton's message limit
RESTRICTED_FLAG = "--grpc-restricted-protocol"
MAX_INPUT_FLAG = "--grpc-max-input-size"  # Triton has none: its limit is fixed at MAX_INT
RECEIVE_MEMORY_FLAG = "--grpc-receive-memory-mb"  # Triton has none: it reads every message at once
RECEIVE_TIMEOUT_FLAG = "--grpc-receive-timeout-secs"


def add_flags(p: argparse.ArgumentParser, add_bool: Callable[..., None]) -> None:
    """Add the flags of this module to ``p`` (``add_bool`` is cli.add_bool)."""
    add_bool(p, "--grpc-use-ssl", False, "serve gRPC over TLS with --grpc-server-cert and --grpc-server-key "
                                         "(default false)")
    add_bool(p, "--grpc-use-ssl-mutual", False, "serve gRPC over TLS and require a client certificate signed by "
                                                "--grpc-root-cert; implies --grpc-use-ssl (default false)")
    p.add_argument("--grpc-server-cert", default="", metavar="PATH", help="PEM server certificate (chain) for TLS")
    p.add_argument("--grpc-server-key", default="", metavar="PATH", help="PEM private key of --grpc-server-cert")
    p.add_argument("--grpc-root-cert", default="", metavar="PATH",
                   help="PEM root certificate(s) that client certificates must chain to (mutual TLS)")
    p.add_argument("--grpc-infer-response-compression-level", default="none", metavar="LEVEL",
                   help="compress gRPC responses: none, low, medium or high (default none)")
    for flag, (_, default, _) in INT_FLAGS.items():
        p.add_argument(flag, type=int, default=default, metavar="N", help=INT_HELP[flag])
    p.add_argument(MAX_CONNECTIONS_FLAG, type=int, default=0, metavar="N",
                   help="connections the gRPC frontend holds at once: one past it is closed as it comes; 0: what its "
                        "descriptor limit leaves once its own are kept aside, as --http-max-connections (default 0)")
    add_bool(p, "--grpc-keepalive-permit-without-calls", False,
             "let clients send keepalive pings on a connection with no call (default false)")
    p.add_argument(MAX_INPUT_FLAG, type=int, default=None, metavar="BYTES",
                   help="largest request message, after decompression: grpc refuses a larger one with "
                        "RESOURCE_EXHAUSTED as its length arrives, before reading it (default: the frontend "
                        "arena, --frontend-arena-mb, the most tensor data a request can carry; at most 2^31-1)")
    p.add_argument(RECEIVE_MEMORY_FLAG, type=int, default=None, metavar="MB",
                   help="memory the gRPC frontend gives ModelInfer messages while it receives them: it receives as "
                        f"many at once as this holds of {MAX_INPUT_FLAG}, at least one; a call past them waits, its "
                        "message left in the client (default: a quarter of the memory the server may use, its "
                        "cgroup's limit where lower, at least 1024)")
    p.add_argument(RECEIVE_TIMEOUT_FLAG, type=float, default=60.0, metavar="SECONDS",
                   help="how long a ModelInfer message may take to arrive once its receipt has begun: a call slower "
                        "than this ends with DEADLINE_EXCEEDED, so that slow senders cannot hold the receive slots "
                        "(default 60)")
    p.add_argument(RESTRICTED_FLAG, action="append", default=[], metavar="PROTOCOL[,PROTOCOL...]:KEY=VALUE",
                   help="answer these RPC groups only for calls with metadata triton-grpc-protocol-KEY: VALUE (else "
                        "UNAVAILABLE); groups as --http-restricted-api's; repeatable, as Triton's")
    p.add_argument(FORWARD_FLAG, default=None, metavar="REGEX",
                   help="forward the metadata of ModelInfer and ModelStreamInfer calls whose keys match REGEX "
                        "(searched anywhere in the key, ignoring case, as Triton's) to the model as string request "
                        "parameters; metadata wins over a request parameter of its name (default: none forwarded)")


def grpc_spec(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as the gRPC process's settings: ``options`` (grpc channel arguments, the
    message limits among them), ``max_connections`` (0: derived there), ``receive_slots`` and
    ``receive_timeout_s`` (receiving.py), ``tls`` (certificate paths, or None), ``restricted`` (group ->
    (key, value)) and ``header_forward_pattern`` (None: none). ValueError says what is wrong, by flag."""
    options = [("grpc.max_receive_message_length", max_input_size(args)),
               ("grpc.max_send_message_length", MAX_INT)]  # Triton's
    for flag, (argument, default, low) in INT_FLAGS.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if not low <= value <= MAX_INT:
            raise ValueError(f"{flag} must lie in [{low}, {MAX_INT}], got {value}")
        if value or default:
            options.append((argument, value))
    options.append(("grpc.keepalive_permit_without_calls", int(args.grpc_keepalive_permit_without_calls)))
    # A call waiting for a receive slot (receiving.py) leaves its message in the client only as far
    # as its HTTP/2 window: grpc's bandwidth-delay probing would grow each such window to megabytes.
    # (A read in progress opens its stream's window to the whole message, probing or not.)
    options.append(("grpc.http2.bdp_probe", 0))
    options.append(("grpc.so_reuseport", int(bool(args.reuse_grpc_port))))  # grpcio's default is on, Triton's off
    level = args.grpc_infer_response_compression_level.lower()  # Triton's is case-insensitive
    if level not in COMPRESSION_LEVELS:
        raise ValueError(f"--grpc-infer-response-compression-level must be none, low, medium or high, got "
                         f"'{args.grpc_infer_response_compression_level}'")
    if COMPRESSION_LEVELS[level]:
        options.append(("grpc.default_compression_level", COMPRESSION_LEVELS[level]))
    compile_pattern(args.grpc_header_forward_pattern, FORWARD_FLAG)
    if not 0 <= args.grpc_max_connections <= MAX_INT:
        raise ValueError(f"{MAX_CONNECTIONS_FLAG} must lie in [0, {MAX_INT}], got {args.grpc_max_connections}")
    if not 0 < args.grpc_receive_timeout_secs <= 86400:
        raise ValueError(f"{RECEIVE_TIMEOUT_FLAG} must lie in (0, 86400], got {args.grpc_receive_timeout_secs:g}")
    receive_slots = max(1, receive_memory(args) // max_input_size(args))
    return {"options": options, "max_connections": args.grpc_max_connections, "tls": tls(args),
            "receive_slots": receive_slots, "receive_timeout_s": args.grpc_receive_timeout_secs,
            "restricted": parse_restricted(args.grpc_restricted_protocol, RESTRICTED_FLAG, "protocol"),
            "header_forward_pattern": args.grpc_header_forward_pattern}


def max_input_size(args: argparse.Namespace) -> int:
    """``--grpc-max-input-size``, by default the frontend arena's size: a message larger than the
    arena could never be served (its tensor data goes through the arena), and grpc would read it
    whole before the frontend refused it."""
    value = args.grpc_max_input_size
    if value is None:
        return min(args.frontend_arena_mb << 20, MAX_INT)
    if not 1 <= value <= MAX_INT:
        raise ValueError(f"{MAX_INPUT_FLAG} must lie in [1, {MAX_INT}], got {value}")
    return value


def receive_memory(args: argparse.Namespace) -> int:
    """``--grpc-receive-memory-mb`` in bytes; by default a quarter of the memory the server may use,
    at least 1 GiB. Each receive slot costs at most ``--grpc-max-input-size`` of it, and a call that
    finds none free waits a round of the event loop longer: with 4 slots, 32 clients of small
    requests cost the frontend 15-20% more CPU a request than with none (docs/performance.md), so
    the default grows with the host, where it can afford them."""
    if args.grpc_receive_memory_mb is None:
        return max(1 << 30, usable_memory() // 4)
    if not 1 <= args.grpc_receive_memory_mb <= 1 << 30:
        raise ValueError(f"{RECEIVE_MEMORY_FLAG} must lie in [1, {1 << 30}], got {args.grpc_receive_memory_mb}")
    return args.grpc_receive_memory_mb << 20


def tls(args: argparse.Namespace) -> dict[str, Any] | None:
    """The TLS settings (None: plaintext); the files must hold PEM data."""
    mutual = bool(args.grpc_use_ssl_mutual)
    if not (args.grpc_use_ssl or mutual):
        return None
    needed = ["--grpc-server-cert", "--grpc-server-key"] + (["--grpc-root-cert"] if mutual else [])
    for flag in needed:
        if not getattr(args, flag[2:].replace("-", "_")):
            raise ValueError(f"{'--grpc-use-ssl-mutual' if mutual else '--grpc-use-ssl'} needs {', '.join(needed)}")
    paths = {"cert": args.grpc_server_cert, "key": args.grpc_server_key, "root": args.grpc_root_cert}
    flags = {"cert": "--grpc-server-cert", "key": "--grpc-server-key", "root": "--grpc-root-cert"}
    for name, path in paths.items():
        if path:
            read_pem(path, flags[name])
    return {**paths, "mutual": mutual}


def read_pem(path: str, flag: str) -> bytes:
    """The file's bytes; ValueError (naming ``flag``) when it cannot be read or holds no PEM block."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"cannot read {flag} '{path}': {e.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} '{path}' holds no PEM data")
    return data
