"""``shmserve-perf``: perf_analyzer's command line for any KServe v2 server (HTTP or gRPC) and
for shmserve's local client. See docs/tools.md.

    shmserve-perf -m add_sub -u 127.0.0.1:8000 --concurrency-range 1:4 -f perf.csv
    shmserve-perf -m add_sub -u 127.0.0.1:18000 --name triton --compare shmserve=127.0.0.1:18600 --plot both.png
"""
from __future__ import annotations

import argparse
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shmserve.tools.perf import inputs, report
from shmserve.tools.perf.describe import ModelInfo, describe
from shmserve.tools.perf.measure import LevelResult, Session, sweep
from shmserve.tools.perf.plan import (DEFAULT_URLS, PROTOCOLS, Load, Measurement, Requests, Target, parse_range,
                                      parse_target)
from shmserve.tools.perf.plot import check_plot_path
from shmserve.tools.perf.pool import Pool, process_count
from shmserve.tools.perf.progress import Bar, Quiet
from shmserve.tools.perf.server_stats import StatsReader
from shmserve.tools.perf.shm_regions import cuda_available

LEVEL_HEADING_SHORT = {"concurrency": "concurrency", "request_rate": "rate"}  # the progress line's word


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmserve-perf", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and server")
    g.add_argument("-m", dest="model", required=True, help="the model to measure")
    g.add_argument("-x", dest="version", default="", help="its version (default: the server's choice, the latest)")
    g.add_argument("-u", dest="url", help="the server: HOST:PORT for http and grpc (default localhost:8000, "
                   "localhost:8001), the server's --id for local (default shmserve)")
    g.add_argument("-i", dest="protocol", choices=PROTOCOLS, default="http",
                   help="http or grpc (KServe v2, any server), or local: shmserve's shared-memory client, no network")
    g.add_argument("--name", help="what to call the -u server in the output (default: its address)")
    g.add_argument("--allow-remote", action="store_true",
                   help="load a server that is not on this machine (refused without it: this is a load generator)")
    g = p.add_argument_group("what each request carries")
    g.add_argument("-b", dest="batch", type=int, default=1, help="batch size of each request (default 1)")
    g.add_argument("--shape", action="append", default=[], metavar="NAME:D1,D2",
                   help="shape of an input with variable dims, without the batch dim (repeatable)")
    g.add_argument("--input-data", default="random", metavar="zero|random|FILE.json",
                   help="zeros, random values (made once; the default), or perf_analyzer's JSON data file: "
                        '{"data": [{"INPUT0": [...]}, ...]}, a list of lists for sequence streams, values as '
                        'flat lists, {"b64": ...} or {"content": ..., "shape": [...]}')
    g.add_argument("--string-length", type=int, default=128, help="length of random strings for BYTES inputs")
    g.add_argument("--string-data", help="the string every BYTES input element holds (instead of random ones)")
    g.add_argument("--shared-memory", choices=("none", "system", "cuda"), default="none",
                   help="tensors in the body (none), in system shared-memory regions registered with the server, "
                        "or in CUDA regions (needs a GPU here); local: system puts inputs in a client region")
    g.add_argument("--output-shared-memory-size", type=int, default=102400, metavar="BYTES",
                   help="region size for an output whose size the model's metadata does not fix (default 102400)")
    g.add_argument("--sequence-length", type=int,
                   help="requests per sequence for a sequence model (default 20, or a JSON stream's length)")
    g.add_argument("--sequence-length-variation", type=float, default=20.0, metavar="PCT",
                   help="sequence lengths vary by up to this percentage (default 20)")
    g.add_argument("--streaming", action="store_true",
                   help="accepted as perf_analyzer has it; decoupled models always stream (gRPC or local) and "
                        "their time to first response and between responses is reported")
    g = p.add_argument_group("load")
    g.add_argument("--concurrency-range", default=None, metavar="START:END:STEP",
                   help="closed loops: this many requests in flight, from START to END (default 1); or a "
                        "comma list of levels")
    g.add_argument("--request-rate-range", default=None, metavar="START:END:STEP",
                   help="open loop: requests per second, from START to END (or a comma list), sent on time "
                        "whatever the answers")
    g.add_argument("--request-distribution", choices=("constant", "poisson"), default="constant",
                   help="intervals of the open loop: even, or Poisson (exponential gaps)")
    g.add_argument("--max-threads", type=int, default=16,
                   help="open loop: the most requests in flight at once (default 16)")
    g.add_argument("--client-processes", type=int, default=0,
                   help="client processes (default: one per concurrent request up to 16; one per core for "
                        "an open loop)")
    g = p.add_argument_group("measurement")
    g.add_argument("-p", "--measurement-interval", type=int, default=5000, metavar="MS",
                   help="length of a measurement window (default 5000)")
    g.add_argument("--percentile", type=int, help="stabilize on this latency percentile (default: the average)")
    g.add_argument("-s", "--stability-percentage", type=float, default=10.0,
                   help="the last three windows must agree within this percentage (default 10)")
    g.add_argument("--warmup", type=int, metavar="MS",
                   help="unmeasured load before each level's first window, and before each --compare slice "
                        "(default 0, and 300 with --compare)")
    g.add_argument("-r", "--max-trials", type=int, default=10, help="most windows per level (default 10)")
    g.add_argument("-l", "--latency-threshold", type=float, default=0.0, metavar="MS",
                   help="stop the sweep once a level's latency passes this (default 0: no limit)")
    g = p.add_argument_group("several servers (--compare)")
    g.add_argument("--compare", action="append", default=[], metavar="[NAME=][http:|grpc:|local:]ADDRESS",
                   help="also measure this server, in alternating slices with the -u one (A B B A ...), and "
                        "print throughput and p50 ratios with their ranges (repeatable)")
    g.add_argument("--pairs", type=int, default=10, help="--compare: pairs of slices per level (default 10)")
    g = p.add_argument_group("output")
    g.add_argument("-f", dest="csv", type=Path, help="write perf_analyzer's CSV here")
    g.add_argument("--verbose-csv", action="store_true", help="add the average latency columns to the CSV")
    g.add_argument("--profile-export-file", type=Path, help="write every request's timestamps here (JSON)")
    g.add_argument("--summary-json", type=Path, help="write every level's figures here (and --compare's ratios)")
    g.add_argument("--plot", type=Path, metavar="FILE.png|FILE.html",
                   help="latency percentiles against throughput over the sweep (PNG with matplotlib, HTML with "
                        "plotly: the plots extra)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    return p


def make_targets(args: argparse.Namespace) -> list[Target]:
    url = args.url or DEFAULT_URLS[args.protocol]
    base = parse_target(f"{args.protocol}:{url}", args.protocol, args.allow_remote)
    targets = [Target(args.name or base.address, base.protocol, base.address)]
    targets += [parse_target(c, args.protocol, args.allow_remote) for c in args.compare]
    if len({t.name for t in targets}) != len(targets):
        raise ValueError("every server needs its own name (NAME=... in --compare, --name for -u)")
    return targets


def make_requests(args: argparse.Namespace, info: ModelInfo) -> Requests:
    if args.batch < 1 or (info.max_batch_size == 0 and args.batch > 1):
        raise ValueError(f"-b {args.batch}: the model takes batches of 1 to {max(info.max_batch_size, 1)}")
    if info.max_batch_size and args.batch > info.max_batch_size:
        raise ValueError(f"-b {args.batch} is over the model's max_batch_size {info.max_batch_size}")
    shapes = inputs.parse_shapes(args.shape)
    specs = inputs.tensor_specs(info.inputs, args.batch, info.max_batch_size, shapes)
    outputs = inputs.tensor_specs(info.outputs, args.batch, info.max_batch_size, {}, unknown=-1)
    if args.input_data in ("zero", "random"):
        data = ((inputs.generated(specs, args.input_data, args.string_data, args.string_length),),)
    else:
        data = inputs.from_json(Path(args.input_data), specs, args.batch, info.max_batch_size > 0)
    length = args.sequence_length if args.sequence_length is not None else (
        20 if args.input_data in ("zero", "random") else 0)
    return Requests(args.model, args.version, args.batch, specs, outputs, data, args.shared_memory,
                    args.output_shared_memory_size, info.sequence, length, args.sequence_length_variation,
                    decoupled=info.decoupled)


def make_load(args: argparse.Namespace) -> Load:
    if args.concurrency_range and args.request_rate_range:
        raise ValueError("give --concurrency-range or --request-rate-range, not both")
    if args.request_rate_range:
        return Load("request_rate", parse_range(args.request_rate_range, integer=False), args.request_distribution,
                    args.max_threads)
    return Load("concurrency", parse_range(args.concurrency_range or "1", integer=True))


def check_flags(args: argparse.Namespace, targets: list[Target]) -> None:
    """Refuse up front what the flags alone rule out, with the reason."""
    if args.measurement_interval < 50 or args.max_trials < 1 or args.pairs < 1:
        raise ValueError("needs --measurement-interval >= 50, --max-trials >= 1 and --pairs >= 1")
    if args.plot:
        check_plot_path(args.plot)
    if args.shared_memory == "system" and len(targets) > 1 and any(t.protocol == "grpc" for t in targets):
        raise ValueError("--compare with --shared-memory system is for http and local servers")
    if args.shared_memory == "cuda":
        if any(t.protocol == "local" for t in targets):
            raise ValueError("--shared-memory cuda is for http and grpc; the local client takes system")
        reason = cuda_available()
        if reason:
            raise ValueError(f"--shared-memory cuda needs a CUDA GPU on this machine and tritonclient's CUDA "
                             f"support (cuda-python); here: {reason}")


@dataclass(frozen=True)
class Prepared:
    """A run, ready to go: the servers, the requests, the load and the measurement."""

    targets: list[Target]
    requests: Requests
    load: Load
    measurement: Measurement


def prepare(args: argparse.Namespace) -> Prepared:
    """Everything a run needs, from the flags and the model's description; ValueError (bad
    flags), RuntimeError (model not ready) or the client's error (server unreachable)."""
    targets = make_targets(args)
    check_flags(args, targets)
    info = describe(targets[0], args.model, args.version)
    if info.decoupled and any(t.protocol == "http" for t in targets):
        raise ValueError(f"{args.model} is decoupled (streaming): measure it with -i grpc or -i local")
    warmup = args.warmup if args.warmup is not None else (300 if args.compare else 0)
    meas = Measurement(args.measurement_interval, args.percentile, args.stability_percentage, args.max_trials, warmup)
    return Prepared(targets, make_requests(args, info), make_load(args), meas)


def measure(argv: list[str], progress: Any = None) -> list[LevelResult]:
    """shmserve-perf's measurement without its printing, for the tools that run it (the
    analyzer, the benchmarks): the flags as on the command line, the results per level."""
    args = build_parser().parse_args(argv)
    return run(args, prepare(args), progress or Quiet(), lambda result: None)[0]


def fixed_window(flags: list[str], clients: int, seconds: float, warmup_s: float) -> dict[str, Any]:
    """One window of ``seconds`` at ``clients`` concurrent requests after ``warmup_s`` unmeasured
    (``flags`` name the model and server): the row the benchmark tools print."""
    [result] = measure([*flags, "--concurrency-range", str(clients), "-p", str(int(seconds * 1000)), "-r", "1",
                        "--warmup", str(int(warmup_s * 1000))])
    f = result.figures
    errors = [r.error for r in result.records if r.error]
    return {"clients": clients, "requests": f.requests, "throughput_rps": round(f.requests / f.duration_s, 1),
            "p50_us": round(f.p50_us, 1), "p99_us": round(f.p99_us, 1), "errors": len(errors),
            "first_error": errors[0] if errors else None}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # `timeout` stops the client processes too
    try:
        prepared = prepare(args)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the server's answer (tritonclient's, the local client's)
        print(f"error: cannot reach {args.model} at {args.protocol}:{args.url or DEFAULT_URLS[args.protocol]}: {exc}",
              file=sys.stderr)
        return 2
    req, load, meas = prepared.requests, prepared.load, prepared.measurement
    print(report.settings_text(req, load, meas, prepared.targets[0]), flush=True)
    windows = meas.max_trials if not args.compare else 2 * args.pairs * (len(prepared.targets) - 1)
    progress = Quiet() if args.quiet else Bar(len(load.levels), windows, LEVEL_HEADING_SHORT[load.mode])
    try:
        results, extra = run(args, prepared, progress, _print_level)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(report.closing_text(results, meas))
    if "compare" in extra:
        from shmserve.tools.perf.compare import compare_text

        print(compare_text(extra, req.model))
    write_outputs(args, results, req, extra)
    failed = [x.error for r in results for x in r.records if x.error]
    if failed:
        print(f"{len(failed)} request(s) failed; the first: {failed[0]}", file=sys.stderr)
    return 1 if failed or not results or not all(r.figures.requests for r in results) else 0


def run(args: argparse.Namespace, prepared: Prepared, progress: Any, report_level: Callable[[LevelResult], None]
        ) -> tuple[list[LevelResult], dict[str, Any]]:
    """The sweep (or the paired comparison) with the client processes up for all of it."""
    targets, req = prepared.targets, prepared.requests
    processes = process_count(prepared.load, args.client_processes)
    pool = Pool(targets, req, processes)
    readers: list[StatsReader] = []
    try:
        readers = [StatsReader(t, req.model, req.version) for t in targets]
        session = Session(pool, targets, readers, prepared.load, prepared.measurement, req, processes, progress)
        if args.compare:
            from shmserve.tools.perf.compare import compare

            return compare(session, args.pairs, report_level)
        return sweep(session, 0, args.latency_threshold, report_level), {}
    finally:
        pool.close()
        for r in readers:
            r.close()


def _print_level(result: LevelResult) -> None:
    print(report.level_text(result), flush=True)


def write_outputs(args: argparse.Namespace, results: list[LevelResult], req: Requests, extra: dict[str, Any]) -> None:
    several = len({r.target for r in results}) > 1
    if args.csv:
        report.write_csv(args.csv, results, args.verbose_csv, several)
    if args.profile_export_file:
        report.write_profile_export(args.profile_export_file, results, req)
    if args.summary_json:
        report.write_summary(args.summary_json, results, req, extra)
    if args.plot:
        from shmserve.tools.perf.plot import plot

        plot(args.plot, results, f"{req.model}, batch {req.batch}")


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
