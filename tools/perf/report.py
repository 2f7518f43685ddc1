"""What a run tells: perf_analyzer's text (settings, a block per level, the closing lines), its
``-f`` CSV layout, its ``--profile-export-file`` JSON, and our ``--summary-json``."""
from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path
from typing import Any

from shmserve.tools.perf.measure import LevelResult
from shmserve.tools.perf.plan import Load, Measurement, Requests, Target

CSV_COLUMNS = ["Inferences/Second", "Client Send", "Network+Server Send/Recv", "Server Queue",
               "Server Compute Input", "Server Compute Infer", "Server Compute Output", "Client Recv",
               "p50 latency", "p90 latency", "p95 latency", "p99 latency"]
VERBOSE_COLUMNS = ["Avg latency", "request/response", "response wait"]
STREAM_COLUMNS = ["Avg Time To First Response", "Avg Time Between Responses", "Responses/Second"]
LEVEL_HEADING = {"concurrency": "Concurrency", "request_rate": "Request Rate"}


def settings_text(req: Requests, load: Load, meas: Measurement, target: Target) -> str:
    stabilizing = f"p{meas.percentile} latency" if meas.percentile else "average latency"
    lines = ["*** Measurement Settings ***", f"  Batch size: {req.batch}",
             f"  Service Kind: KServe v2 over {target.protocol} ({target.address})",
             '  Using "time_windows" mode for stabilization', f"  Measurement window: {meas.interval_ms} msec",
             f"  Stabilizing using {stabilizing}"]
    if load.mode == "request_rate":
        lines.append(f"  Using {load.distribution} request intervals, up to {load.threads} requests in flight")
    if req.decoupled:
        lines.append("  Streaming: each response timed (decoupled model)")
    return "\n".join(lines)


def server_parts(r: LevelResult) -> dict[str, float]:
    """The server's share of the average latency (µs per request), and what is left to the
    network and both sides' send and receive: the Python clients do not time their own send
    and receive apart, so ``Client Send`` and ``Client Recv`` are 0 and that time is here."""
    s = r.figures.server
    parts = {"queue": 0.0, "compute_input": 0.0, "compute_infer": 0.0, "compute_output": 0.0, "request": 0.0}
    if s is not None:
        parts = {p: s.average_us(p) for p in ("queue", "compute_input", "compute_infer", "compute_output")}
        parts["request"] = s.average_us("success")
    parts["network"] = max(0.0, r.figures.avg_us - sum(parts[p] for p in ("queue", "compute_input", "compute_infer",
                                                                           "compute_output")))
    return parts


def level_text(r: LevelResult) -> str:
    f = r.figures
    head = (f"Request concurrency: {r.level:g}" if r.mode == "concurrency"
            else f"Request Rate: {r.level:g} inference requests per seconds")
    lines = [head + ("" if r.stable else "  [not stable within --max-trials: the last three windows]"),
             "  Client:", f"    Request count: {f.requests}", f"    Throughput: {f.throughput:.2f} infer/sec",
             f"    Avg latency: {f.avg_us:.0f} usec (standard deviation {f.std_us:.0f} usec)",
             *(f"    p{q} latency: {getattr(f, f'p{q}_us'):.0f} usec" for q in (50, 90, 95, 99))]
    if f.first_response_us is not None:
        between = "-" if f.between_responses_us is None else f"{f.between_responses_us:.0f}"
        lines.append(f"    Avg time to first response: {f.first_response_us:.0f} usec, between responses: "
                     f"{between} usec ({f.responses_per_s:.1f} responses/sec)")
    if f.errors:
        lines.append(f"    Failed requests: {f.errors}")
    if f.delayed > (f.requests + f.errors) / 100:
        lines.append(f"    [WARNING] {f.delayed / max(f.requests + f.errors, 1):.1%} of the requests were sent "
                     "late: the clients could not keep up with the rate (raise --max-threads)")
    if f.server is not None:
        p = server_parts(r)
        overhead = max(0.0, p["request"] - p["queue"] - p["compute_input"] - p["compute_infer"] - p["compute_output"])
        # A decoupled request lasts until its stream ends; its phases are those of the execution
        # that started it, and what follows is the model's streaming, not the server's overhead.
        rest = "streaming after execute returned" if f.first_response_us is not None else "overhead"
        lines += ["  Server:", f"    Inference count: {f.server.inference_count}",
                  f"    Execution count: {f.server.execution_count}",
                  f"    Successful request count: {f.server.success_count}",
                  f"    Avg request latency: {p['request']:.0f} usec ({rest} {overhead:.0f} usec + queue "
                  f"{p['queue']:.0f} usec + compute input {p['compute_input']:.0f} usec + compute infer "
                  f"{p['compute_infer']:.0f} usec + compute output {p['compute_output']:.0f} usec)"]
    if r.server_cpu_us is not None:
        lines.append(f"    CPU of the server's processes: {r.server_cpu_us:.0f} usec per request")
    return "\n".join(lines)


def closing_text(results: list[LevelResult], meas: Measurement) -> str:
    what = f"Client p{meas.percentile} Batch Latency" if meas.percentile else "Client Average Batch Latency"
    lines = [f"Inferences/Second vs. {what}"]
    for r in results:
        name = LEVEL_HEADING[r.mode]
        prefix = f"{r.target}: " if len({x.target for x in results}) > 1 else ""
        lines.append(f"{prefix}{name}: {r.level:g}, throughput: {r.figures.throughput:.2f} infer/sec, "
                     f"latency {r.figures.stabilizing_us:.0f} usec")
    return "\n".join(lines)


def write_csv(path: Path, results: list[LevelResult], verbose: bool, several: bool) -> None:
    """perf_analyzer's ``-f`` layout, rows by increasing throughput; a ``Server`` column first
    when several servers were measured, streaming columns for decoupled models."""
    streaming = any(r.figures.first_response_us is not None for r in results)
    header = ([LEVEL_HEADING[results[0].mode]] if results else ["Concurrency"]) + CSV_COLUMNS
    header = (["Server"] if several else []) + header + (VERBOSE_COLUMNS if verbose else []) + \
        (STREAM_COLUMNS if streaming else [])
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(header)
        for r in sorted(results, key=lambda x: x.figures.throughput):
            f, p = r.figures, server_parts(r)
            row: list[Any] = ([r.target] if several else []) + [f"{r.level:g}", round(f.throughput, 2), 0,
                                                                  round(p["network"]), round(p["queue"]),
                                                                  round(p["compute_input"]), round(p["compute_infer"]),
                                                                  round(p["compute_output"]), 0]
            row += [round(f.p50_us), round(f.p90_us), round(f.p95_us), round(f.p99_us)]
            if verbose:
                row += [round(f.avg_us), 0, round(f.avg_us)]
            if streaming:
                row += [_round(f.first_response_us), _round(f.between_responses_us), _round(f.responses_per_s)]
            out.writerow(row)


def _round(value: float | None) -> Any:
    return "" if value is None else round(value, 1)


def write_profile_export(path: Path, results: list[LevelResult], req: Requests) -> None:
    """perf_analyzer's profile export: per experiment (a level on a server) every successful
    request's send time and response times, and the window edges, as wall-clock nanoseconds."""
    offset = time.time_ns() - time.monotonic_ns()
    experiments = []
    for r in results:
        good = [x for x in r.records if not x.error]
        experiments.append({
            "experiment": {"mode": r.mode, "value": r.level},
            "server": r.target,
            "requests": [{"timestamp": x.start + offset, "sequence_id": x.sequence_id,
                          "response_timestamps": [t + offset for t in x.responses]} for x in good],
            "window_boundaries": [b + offset for b in r.boundaries],
            "failed_requests": len(r.records) - len(good),
        })
    doc = {"experiments": experiments, "version": "shmserve-perf 1", "service_kind": "triton",
           "endpoint": "", "model": req.model, "batch_size": req.batch}
    path.write_text(json.dumps(doc) + "\n")


def level_summary(r: LevelResult) -> dict[str, Any]:
    """One level in ``--summary-json``: the figures, server share and CPU per request."""
    used = [c for c in r.clients if c.requests]
    return {"server": r.target, "mode": r.mode, "level": r.level, "stable": r.stable, "windows": len(r.windows),
            **r.figures.as_dict(), "server_parts_us": server_parts(r), "server_cpu_us": r.server_cpu_us,
            "client_cpu_us": statistics.median(c.cpu_us / c.requests for c in used) if used else None}


def write_summary(path: Path, results: list[LevelResult], req: Requests, extra: dict[str, Any]) -> None:
    doc = {"model": req.model, "version": req.version, "batch_size": req.batch, "shared_memory": req.shared_memory,
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "levels": [level_summary(r) for r in results], **extra}
    path.write_text(json.dumps(doc, indent=1) + "\n")
