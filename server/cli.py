"""Command-line flags, named as ``tritonserver``'s where they mean the same thing."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any, NoReturn, Sequence

from shmserve.host_limits import usable_cores

from . import __version__, cache_flags, triton_flags, triton_values
from .edge.header_forward import HTTP_FLAG as HTTP_FORWARD_FLAG, compile_pattern
from .broker.summary_window import summary_quantiles
from .frontend.limits import HttpLimits
from .grpc import options as grpc_options


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (true/false), got '{value}'")


TRITON_HTTP_THREADS = 8  # tritonserver's --http-thread-count default, whatever the host


def default_http_workers() -> int:
    """Triton serves HTTP on a pool of 8 threads, which run on as many cores as the host has, up
    to 8. Each of our frontends is an event loop that holds a core while it works and polls for its
    answers (--poll-us), beside the model's worker, which does too: one frontend per two cores,
    up to 8. (On 2 cores, 600 KB bodies: two frontends took 0.71x the rate of one, at 1.30x
    the server's CPU per request, and four 0.57x; docs/performance.md, "Large bodies".)"""
    return min(TRITON_HTTP_THREADS, max(1, usable_cores() // 2))


# The sections of --help, as docs/flags.md has them: (title, flags or prefixes of flags), the first
# that matches a flag takes it; flags accepted from tritonserver's command lines with no effect
# here (their help says so) have a section of their own, last.
SECTIONS = (
    ("models and repositories", ("--model-", "--repository-", "--load-model", "--strict-model-config",
                                 "--disable-auto-complete-config", "--backend-config", "--strict-readiness",
                                 "--exit-on-error", "--exit-timeout-secs", "--allow-model-file-uploads",
                                 "--rate-limit", "--rate-limit-resource")),
    ("HTTP", ("--http-", "--allow-http", "--reuse-http-port")),
    ("gRPC", ("--grpc-", "--allow-grpc", "--reuse-grpc-port")),
    ("metrics", ("--metrics-", "--allow-metrics", "--allow-cpu-metrics", "--allow-gpu-metrics")),
    ("logging", ("--log-",)),
    ("tracing", ("--trace-",)),
    ("response cache", ("--cache-", "--response-cache-")),
    ("shared memory and local clients", ("--id", "--allow-client-shm", "--local-client-users", "--allow-remote-shm",
                                         "--worker-arena-mb", "--broker-arena-mb", "--frontend-arena-mb",
                                         "--poll-us")),
)
NO_EFFECT_SECTION = "tritonserver flags accepted but not acted on (each named at start; some refused when true)"
NO_EFFECT_HELP = ("accepted for Triton's command lines", "false is accepted; true is refused")


class _Parser(argparse.ArgumentParser):
    """One-line errors; each flag in its section of --help (``SECTIONS``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sections = {title: self.add_argument_group(title) for title, _ in SECTIONS}
        self._sections[NO_EFFECT_SECTION] = self.add_argument_group(NO_EFFECT_SECTION)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        section = _section_of(args[0] if args else "", str(kwargs.get("help", "")))
        if section is None:
            return super().add_argument(*args, **kwargs)
        return self._sections[section].add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, exit code 2, as operators' scripts expect
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def _section_of(flag: str, help: str) -> str | None:
    if help.startswith(NO_EFFECT_HELP):
        return NO_EFFECT_SECTION
    for title, names in SECTIONS:
        if any(flag == n or (n.endswith("-") and flag.startswith(n)) for n in names):
            return title
    return None


METRICS_CONFIG_KEYS = {"summary_latencies", "histogram_latencies", "counter_latencies", "summary_quantiles"}


def metrics_config(items: Sequence[str]) -> dict[str, str]:
    """``--metrics-config key=value`` pairs; unknown keys and malformed values are refused."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value or "," in key:  # Triton's words for a malformed item
            raise ValueError(f"--metrics-config option format is <setting>=<value>. Got {item}")
        key = key.strip()
        if key not in METRICS_CONFIG_KEYS:
            raise ValueError(f"--metrics-config: unknown option '{item}' (known: {', '.join(sorted(METRICS_CONFIG_KEYS))})")
        if key == "summary_quantiles":
            summary_quantiles(value)
            out[key] = value.strip()
            continue
        try:
            out[key] = str(parse_bool(value)).lower()
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"--metrics-config {key}: {e}") from None
    return out


def add_bool(p: argparse.ArgumentParser, flag: str, default: bool | None, help: str) -> None:
    """A boolean flag as tritonserver's: ``--flag``, ``--flag=true`` or ``--flag=false`` (default
    None: the flag's absence can be told apart)."""
    p.add_argument(flag, type=parse_bool, nargs="?", const=True, default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shmserve", description="Serve Triton model repositories over KServe v2 HTTP and "
                                             "POSIX shared memory.")
    p.add_argument("--version", action="version", version=f"shmserve {__version__}",
                   help="print the version and exit")
    p.add_argument("--model-repository", "--model-store", action="append", required=True, metavar="PATH",
                   help="a model repository (Triton's layout): a folder, or s3://, gs://, as:// (served from a "
                        "local copy; docs/cloud_repository.md); repeat to serve several")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--http-address", default="0.0.0.0", help="address the HTTP server binds (default 0.0.0.0)")
    p.add_argument("--http-workers", type=int, default=default_http_workers(),
                   help=f"frontend processes sharing the HTTP port (default: one per two cores this process may use, "
                        f"at most {TRITON_HTTP_THREADS} as Triton's HTTP threads; {default_http_workers()} here)")
    p.add_argument("--http-max-input-size", type=int, default=1 << 26,
                   help="largest request body in bytes, before and after decompression (default 64 MiB, "
                        "as Triton's)")
    p.add_argument("--http-max-tensor-elements", type=int, default=1 << 31,
                   help="most elements an input tensor's shape may declare; more is refused with 400 before "
                        "anything is allocated (default 2^31)")
    p.add_argument("--http-max-inflight", type=int, default=1024,
                   help="requests one frontend process holds in flight at most; past it a request gets 503 "
                        "(the bound that keeps an overloaded server's queues and memory flat; default 1024)")
    p.add_argument("--http-idle-timeout-secs", type=float, default=0.0, metavar="SECONDS",
                   help="close a connection with no request in progress for this long: from its accept, and "
                        "after each answer; 0 (default): never, as Triton (a proxy pooling connections to the "
                        "server must not find one closed under it); at --http-max-connections the one idle "
                        "longest is closed for a new one")
    p.add_argument("--http-header-timeout-secs", type=float, default=30.0, metavar="SECONDS",
                   help="a request's head (request line and header fields) must be complete this long after "
                        "its first byte, else 408 and the connection is closed (default 30)")
    p.add_argument("--http-body-timeout-secs", type=float, default=60.0, metavar="SECONDS",
                   help="while a request body is read, the longest wait for its next bytes, else 408 and the "
                        "connection is closed (default 60)")
    p.add_argument("--http-send-timeout-secs", type=float, default=60.0, metavar="SECONDS",
                   help="while an answer waits for its client to read it, the longest the client may read none "
                        "of it, else the connection is closed and what was left unsent freed (default 60)")
    p.add_argument("--http-max-header-bytes", type=int, default=64 << 10, metavar="BYTES",
                   help="largest request head (request line and header fields); larger is refused with 431 "
                        "(default 65536)")
    p.add_argument("--http-max-connections", type=int, default=0, metavar="N",
                   help="connections one frontend process holds at most; past it a new connection is answered "
                        "503 and closed (default 0: its descriptor limit, less 128 and one in 16 kept for itself)")
    p.add_argument("--http-restricted-api", action="append", default=[], metavar="API[,API...]:KEY=VALUE",
                   help="answer these endpoint groups only for requests with header KEY: VALUE (else 403); "
                        "groups: health, metadata, inference, shared-memory, model-config, model-repository, "
                        "statistics, trace, logging; repeatable, as Triton's")
    p.add_argument(HTTP_FORWARD_FLAG, default=None, metavar="REGEX",
                   help="forward the headers of infer and generate requests whose names match REGEX (searched "
                        "anywhere in the name, ignoring case, as Triton's) to the model as string request "
                        "parameters; a header wins over a body parameter of its name (default: none forwarded)")
    add_bool(p, "--allow-http", True, "serve HTTP (default true); false with --allow-grpc serves gRPC only, and "
                                      "with both false only local clients (shmserve.Client) are served, as in Triton")
    add_bool(p, "--allow-grpc", True, "serve Triton's gRPC protocol (GRPCInferenceService) beside HTTP (default true)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    p.add_argument("--grpc-address", default="0.0.0.0", help="address the gRPC server binds (default 0.0.0.0)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port (default 8002)")
    add_bool(p, "--allow-metrics", True,
             "serve Prometheus metrics (default true)")
    add_bool(p, "--allow-cpu-metrics", True,
             "export nv_cpu_utilization and nv_cpu_memory_* (default true)")
    add_bool(p, "--allow-gpu-metrics", True,
             "export nv_gpu_* and nv_energy_consumption per visible CUDA device (default true)")
    p.add_argument("--metrics-interval-ms", type=int, default=2000,
                   help="how often CPU and GPU figures are sampled, in milliseconds (default 2000)")
    p.add_argument("--metrics-config", action="append", default=[], metavar="KEY=VALUE",
                   help="metrics options as Triton's: counter_latencies=false leaves out the "
                        "nv_inference_*_duration_us counters; summary_latencies=true adds nv_inference_*_summary_us "
                        "quantiles over the last minute (estimated from log-spaced histograms), at "
                        "summary_quantiles=Q:E,... (default 0.5:0.05,0.9:0.01,0.95:0.001,0.99:0.001,0.999:0.001); "
                        "histogram_latencies=true adds "
                        "nv_inference_first_response_histogram_ms and shmserve's request, queue and compute "
                        "histograms (buckets per model through model_metrics); repeatable")
    p.add_argument("--model-control-mode", type=triton_values.choice(("none", "poll", "explicit"),
                                                                      "--model-control-mode"),
                   default="none", metavar="none|poll|explicit",
                   help="none: load all models at start; poll: also follow changes in the repository; "
                        "explicit: load only --load-model models and what the repository API asks for (ignoring "
                        "case, as Triton's)")
    p.add_argument("--repository-poll-secs", type=int, default=None, metavar="N",
                   help="with poll control, also scan the repositories every N seconds for changes no file "
                        "event reports (NFS and FUSE mounts, model folders that are links); 0: events only "
                        "(default 15)")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="with explicit control, a model to load at start ('*' for all); repeatable")
    add_bool(p, "--strict-model-config", None,
             "deprecated in Triton (a warning says so), as --disable-auto-complete-config: require a complete "
             "config.pbtxt and disable auto-completion (default false)")
    add_bool(p, "--strict-readiness", True,
             "report ready only when every model is ready (default true)")
    add_bool(p, "--exit-on-error", True,
             "exit if a model fails to load at start (default true)")
    p.add_argument("--exit-timeout-secs", type=float, default=30.0,
                   help="on SIGTERM, how long the drain waits for requests in flight; meanwhile readiness says no "
                        "and new requests get 503 (default 30)")
    p.add_argument("--log-verbose", type=triton_values.int_or_bool, default=0, metavar="N",
                   help="verbose logging level: lines of verbose level <= N are logged; 0 is off; true and false "
                        "are 1 and 0, as Triton's (default 0)")
    add_bool(p, "--log-info", True,
             "log INFO lines (default true)")
    add_bool(p, "--log-warning", True,
             "log WARNING lines (default true)")
    add_bool(p, "--log-error", True,
             "log ERROR lines (default true)")
    p.add_argument("--log-format", choices=["default", "ISO8601"], default="default",
                   help="line format: 'default' starts lines with 'I1122 06:31:41.123456', 'ISO8601' with "
                        "'2026-11-22T06:31:41Z I' (default 'default')")
    p.add_argument("--log-file", default="", metavar="PATH",
                   help="append every process's log lines to this file instead of stderr (default: stderr)")
    p.add_argument("--trace-config", action="append", default=[], metavar="[MODE,]SETTING=VALUE",
                   help="tracing as Triton's: level=OFF|TIMESTAMPS, rate=N (every N-th request), count=N "
                        "(-1: no limit), mode=triton|opentelemetry, triton,file=PATH, triton,log-frequency=N "
                        "(a new file PATH.<k> every N traces), opentelemetry,url=URL; repeatable")
    p.add_argument("--id", default="shmserve",
                   help="server id: the name server metadata (GET /v2) reports, as Triton's --id; it also "
                        "names the server's shared-memory objects and lets local clients find it "
                        "(default 'shmserve'; '--id triton' for clients that check for Triton's name)")
    add_bool(p, "--allow-client-shm", True,
             "let clients register and unregister system and CUDA shared-memory regions, as Triton's flag "
             "(default true: a caller may register only an object it could open itself; see "
             "docs/serving.md)")
    p.add_argument("--local-client-users", default="", metavar="USER[,USER...]",
                   help="other users (names or uids) whose local clients may call this server through "
                        "/dev/shm, as an application container of another runAsUser in the pod: each gets "
                        "read and write on the objects clients open, by an ACL entry (no one else: the owning "
                        "group and others get nothing); their "
                        "clients can read the answers these objects hold for every client, as clients of the "
                        "server's own user can (default none; docs/deploy.md)")
    add_bool(p, "--allow-remote-shm", False,
             "let non-loopback HTTP peers register system shared memory. Risky: anyone who "
                        "reaches the port could make the server read or write this host's shared memory "
                        "objects they name (default false)")
    add_bool(p, "--allow-model-file-uploads", False,
             "let the repository API load a model from 'file:' contents sent with the request (a model.py "
             "runs as the server's user). Risky: anyone who reaches the port could run code on this host; "
             "without it such loads are refused (403) unless the model-repository group is restricted and "
             "the request carries its key (default false)")
    p.add_argument("--worker-arena-mb", type=int, default=256,
                   help="cap of each worker's shared-memory output arena, MiB: it starts at --backend-config "
                        "python,shm-default-byte-size (4 MiB) and grows with its answers (default 256)")
    p.add_argument("--broker-arena-mb", type=int, default=256,
                   help="cap of the broker's shared-memory output arena (ensembles' answers, errors, control "
                        "documents), MiB: it starts at 60 MiB and grows with its answers (default 256)")
    p.add_argument("--frontend-arena-mb", type=int, default=256,
                   help="shared-memory input arena of each HTTP frontend, MiB (lazily; default 256)")
    p.add_argument("--poll-us", type=int, default=500, metavar="N",
                   help="the most, in microseconds, a frontend or worker polls for the next message before it "
                        "sleeps: polling spares the wake-ups of requests that follow closely, at the cost of CPU; "
                        "a poller whose recent waits average longer stops, nobody polls while no core of the host is idle, "
                        "and a frontend does not poll for a model whose answers take longer on average. 0 never "
                        "polls (default 500)")
    grpc_options.add_flags(p, add_bool)
    p.add_argument("--rate-limit", default="off", metavar="MODE",
                   help="Triton's rate limiter: 'execution_count' runs an instance of a model whose instance group "
                        "has a rate_limiter only when its resources are free, in priority order; 'off' ignores "
                        "rate_limiter blocks (default off, as Triton's)")
    p.add_argument("--rate-limit-resource", action="append", default=[], metavar="NAME:COUNT[:DEVICE]",
                   help="copies of a rate-limiter resource: on DEVICE, or on every device (a global resource "
                        "takes the largest count given for its name); once one is given, a resource no flag "
                        "names has none; repeatable")
    triton_flags.add_flags(p, add_bool)
    cache_flags.add_flags(p)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    poll_secs_given = args.repository_poll_secs is not None
    if not poll_secs_given:
        args.repository_poll_secs = 15
    args.cloud_repositories = {}  # {local copy: URL}, filled once the copies are made (__main__.py)
    # The same repository named twice (a path and its alias, a prefix like --model-repo) is one:
    # else every model in it would be said to be in two repositories.
    seen: dict[str, str] = {}
    for repo in args.model_repository:
        seen.setdefault(repo if "://" in repo else os.path.realpath(repo), repo)
    args.model_repository = list(seen.values())
    for repo in args.model_repository:
        if "://" in repo:  # s3://, gs://, as://: checked here, read at start (server/broker/cloud_repository.py)
            from .broker.cloud_repository import CloudError, parse

            try:
                parse(repo)
            except CloudError as e:
                parser.error(str(e))
            if args.model_control_mode == "poll" and args.repository_poll_secs == 0:
                parser.error(f"model repository '{repo}': poll mode follows a cloud repository by polling it; "
                             f"--repository-poll-secs must be more than 0")
        elif not os.path.isdir(repo):
            parser.error(f"model repository '{repo}' does not exist or is not a directory")
    if args.http_workers < 1:
        parser.error("--http-workers must be at least 1")
    from shmserve.shm.access import parse_users

    try:
        args.local_client_users = parse_users(args.local_client_users)
    except ValueError as e:
        parser.error(f"--local-client-users: {e}")
    if not 0 <= args.exit_timeout_secs < 1e9:  # (nan fails too) a negative drain would kill the broker at once
        parser.error("--exit-timeout-secs must be a number of seconds, 0 or more")
    if args.http_max_input_size < 1 or args.http_max_tensor_elements < 1:
        parser.error("--http-max-input-size and --http-max-tensor-elements must be at least 1")
    try:
        args.notices = triton_flags.notices(args)
        args.response_cache_bytes, cache_notices = cache_flags.response_cache(args)
    except ValueError as e:
        parser.error(str(e))
    args.notices += cache_notices
    if args.metrics_address is None:
        args.metrics_address = args.http_address  # as Triton's
    for flag in ("http_port", "metrics_port", "grpc_port"):
        if not 0 <= getattr(args, flag) <= 65535:
            parser.error(f"--{flag.replace('_', '-')} must be a port number")
    collision = port_collision(args)
    if collision:
        parser.error(collision)
    try:
        from shmserve.shm.names import check_server_id

        check_server_id(args.id)
    except ValueError as e:
        parser.error(str(e))
    try:
        args.metrics_config = metrics_config(args.metrics_config)
    except ValueError as e:
        parser.error(str(e))
    try:
        from shmserve.server.edge.restrictions import parse as parse_restricted

        args.http_restricted_api = parse_restricted(args.http_restricted_api)
        compile_pattern(args.http_header_forward_pattern, HTTP_FORWARD_FLAG)
        args.grpc = grpc_options.grpc_spec(args)
    except ValueError as e:
        parser.error(str(e))
    if not 0 <= args.http_idle_timeout_secs <= 86400:
        parser.error("--http-idle-timeout-secs must lie in [0, 86400] (0: never)")
    for flag in ("http_header_timeout_secs", "http_body_timeout_secs", "http_send_timeout_secs"):
        if not 0 < getattr(args, flag) <= 86400:
            parser.error(f"--{flag.replace('_', '-')} must lie in (0, 86400]")
    if args.http_max_header_bytes < 1024:
        parser.error("--http-max-header-bytes must be at least 1024")
    if args.http_max_connections < 0:
        parser.error("--http-max-connections must be 0 (derived) or more")
    if not 1 <= args.http_max_inflight <= 65536:
        parser.error("--http-max-inflight must lie in [1, 65536]")
    if not 0 <= args.poll_us <= 1_000_000:
        parser.error("--poll-us must lie in [0, 1000000]")
    if args.metrics_interval_ms < 1:
        parser.error("--metrics-interval-ms must be at least 1")
    if args.repository_poll_secs < 0:
        parser.error("--repository-poll-secs must be 0 or more")
    if args.load_model and args.model_control_mode != "explicit":  # Triton's words
        parser.error("Use of '--load-model' requires setting '--model-control-mode=explicit' as well.")
    if poll_secs_given and args.model_control_mode != "poll":  # (Triton drops it silently)
        args.notices.append((logging.WARNING, f"--repository-poll-secs {args.repository_poll_secs} has no effect: "
                                              f"the repositories are polled only with --model-control-mode=poll"))
    if args.log_verbose < 0:
        parser.error("--log-verbose must be 0 or more")
    try:
        from shmserve.server.broker.rate_limiter import parse_mode, parse_resource

        args.rate_limit = parse_mode(args.rate_limit)
        args.rate_limit_resource = [parse_resource(item) for item in args.rate_limit_resource]
    except ValueError as e:
        parser.error(str(e))
    try:
        args.trace_config, args.trace_file_shown = trace_settings(args.trace_config)
    except ValueError as e:
        parser.error(str(e))
    args.log_file_shown = args.log_file  # (as given: Triton's logging API shows it so)
    if args.log_file:
        args.log_file = os.path.abspath(args.log_file)  # every process opens it, whatever its cwd
        try:
            os.close(os.open(args.log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
        except OSError as e:
            parser.error(f"cannot open --log-file '{args.log_file}': {e.strerror}")
    return args


def port_collision(args: argparse.Namespace) -> str | None:
    """Triton's words for two of the services served (HTTP, GRPC, metrics) given one address and
    port, as its CheckPortCollision says them at start; port 0 (any free port) collides with none."""
    served = [(name, address, port) for name, on, address, port in (
        ("HTTP", args.allow_http, args.http_address, args.http_port),
        ("GRPC", args.allow_grpc, args.grpc_address, args.grpc_port),
        ("metrics", args.allow_metrics, args.metrics_address, args.metrics_port)) if on and port]
    for i, (name, address, port) in enumerate(served):
        for other, other_address, other_port in served[i + 1:]:
            if (address, port) == (other_address, other_port):
                return (f"The server cannot listen to {name} requests and {other} requests at the same address "
                        f"and port {address}:{port}")
    return None


def log_settings(args: argparse.Namespace) -> dict:
    """The flags as Triton's logging-extension settings (what every process configures from)."""
    return {"log_file": args.log_file, "log_info": args.log_info, "log_warning": args.log_warning,
            "log_error": args.log_error, "log_verbose_level": args.log_verbose, "log_format": args.log_format}


def http_limits(args: argparse.Namespace) -> HttpLimits:
    """The HTTP connection limits each frontend keeps (server/frontend/protocol.py)."""
    return HttpLimits(idle_timeout_s=args.http_idle_timeout_secs, header_timeout_s=args.http_header_timeout_secs,
                      body_timeout_s=args.http_body_timeout_secs, send_timeout_s=args.http_send_timeout_secs,
                      max_header_bytes=args.http_max_header_bytes,
                      max_connections=args.http_max_connections)


def trace_settings(items: Sequence[str]) -> tuple[dict, str]:
    """``--trace-config`` items as the broker's initial trace settings (shm/trace.py), and the
    trace file as given (Triton's API shows it so); ValueError says what is wrong, including a
    missing OpenTelemetry SDK for mode=opentelemetry."""
    from shmserve.shm.trace import parse_config

    settings = parse_config(list(items))
    shown = settings.get("file", "")
    if settings.get("file"):
        settings["file"] = os.path.abspath(settings["file"])  # every frontend opens it, whatever its cwd
        folder = os.path.dirname(settings["file"])
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ValueError(f"--trace-config triton,file: cannot write trace files in '{folder}'")
    mode = settings.get("mode", "triton")
    if mode == "opentelemetry":
        from shmserve.server.edge.otel import missing

        why = missing()
        if why:
            raise ValueError(f"--trace-config mode=opentelemetry needs the OpenTelemetry SDK ({why}); install "
                             f"it with: pip install 'shmserve[trace]'")
    elif settings.get("level", "OFF") != "OFF" and not settings.get("file"):
        raise ValueError("--trace-config level=TIMESTAMPS needs a trace file: --trace-config triton,file=<path>")
    if settings.get("level", "OFF") != "OFF" and settings.get("count") == 0:  # (Triton samples nothing)
        raise ValueError("--trace-config count=0 traces nothing while the level is on: give -1 (no limit) or "
                         "a number of traces")
    if settings.get("level", "OFF") != "OFF" and settings.get("rate") == 0:  # (Triton samples nothing)
        raise ValueError("--trace-config rate=0 traces nothing while the level is on: give 1 (every request) or more")
    return settings, shown
