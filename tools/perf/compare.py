"""``--compare``: the same plan against several servers, measured in alternating slices so that
both see the same host.

The hosts these tools run on have fast and slow phases (the same code measures up to 2x apart
minutes later), so two runs one after the other compare the phases as much as the servers. Here
the same client processes take turns on both: A B B A, A B B A, ... with slices of
``--measurement-interval`` after ``--warmup`` unmeasured, and each pair of neighbouring
slices gives one ratio (the compared server over the first). The median of the ratios is the
figure; their range shows how far the host moved. Each slice also reads what one request cost:
the clients' CPU, the server's (its process tree, found by the listening port, for HTTP and gRPC
targets) and the waits for a core."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

from shmserve.tools import proc_cpu
from shmserve.tools.perf.measure import GRACE_S, Edge, LevelResult, Session, read_edge, window_figures
from shmserve.tools.perf.pool import jobs
from shmserve.tools.perf.windows import Figures, Record, figures, server_sum

COST_KEYS = ("client_cpu_us", "server_cpu_us", "idle", "client_wait_us", "server_wait_us")


def slice_order(pairs: int) -> list[tuple[int, int]]:
    """The roles (0: the first server, 1: the compared one) of each pair in running order, A B B A:
    a steady drift of the host shifts both members of a pair alike, and alternating which goes
    first cancels what remains."""
    return [(0, 1) if p % 2 == 0 else (1, 0) for p in range(pairs)]


def run_slice(session: Session, target: int, level: float) -> tuple[LevelResult, list[Record], dict]:
    """One slice: the level's load on ``target``, warm-up, then one measured window."""
    session.pool.start(jobs(session.load, level, target, session.processes))
    records: list[Record] = []
    try:
        time.sleep(session.measurement.warmup_ms / 1000)
        a = read_edge(session, target)
        time.sleep(session.measurement.interval_ms / 1000)
        b = read_edge(session, target)
        time.sleep(GRACE_S)
    finally:
        records.extend(session.pool.collect())
        clients = session.pool.stop(session.requests.timeout_s)
        records.extend(session.pool.collect())
    measured = [r for r in records if a.at <= r.end < b.at]
    fig = window_figures(session, measured, a, b)
    row = slice_row(session.targets[target].name, fig, (a, b), [(c.cpu_us, c.waited_us, c.requests) for c in clients])
    result = LevelResult(session.targets[target].name, session.load.mode, level, fig, [fig], True, records,
                         [a.at, b.at], clients, row.get("server_cpu_us"))
    return result, measured, row


def slice_row(name: str, fig: Figures, edges: tuple[Edge, Edge], clients: list[tuple[float, float, int]]) -> dict:
    """A slice's figures as the comparison reports them (µs per request)."""
    a, b = edges
    used = b.server - a.server
    duration = (b.at - a.at) / 1e9
    busy = [c for c in clients if c[2]]
    row: dict[str, Any] = {
        "target": name, "rps": round(fig.requests / duration, 1), "throughput": round(fig.throughput, 1),
        "p50_us": round(fig.p50_us, 1), "p99_us": round(fig.p99_us, 1),
        "client_cpu_us": round(statistics.median(c[0] / c[2] for c in busy), 1) if busy else None,
        "idle": round((b.ticks[0] - a.ticks[0]) / max(b.ticks[1] - a.ticks[1], 1), 3)}
    if proc_cpu.WAITS_KNOWN and busy:
        row["client_wait_us"] = round(statistics.median(c[1] / c[2] for c in busy), 1)
    if used.cpu_us > 0 and fig.requests:
        row["server_cpu_us"] = round(used.cpu_us / fig.requests, 1)
        row["server_switches"] = round((used.voluntary + used.involuntary) / fig.requests, 2)
        if proc_cpu.WAITS_KNOWN:
            row["server_wait_us"] = round(used.waited_us / fig.requests, 1)
    return row


def compare(session: Session, pairs: int, report_level: Callable[[LevelResult], None]
            ) -> tuple[list[LevelResult], dict[str, Any]]:
    """Every level: each further server against the first, ``pairs`` pairs of slices; per server
    the slices merged into one result, and per level the slices, ratios and costs."""
    results, levels = [], []
    names = [t.name for t in session.targets]
    for level in session.load.levels:
        slices: list[dict] = []
        parts: dict[int, list[tuple[LevelResult, list[Record]]]] = {i: [] for i in range(len(names))}
        ratios: dict[str, list[dict[str, float]]] = {n: [] for n in names[1:]}
        for other in range(1, len(names)):
            for order in slice_order(pairs):
                rows = {}
                for role in order:
                    target = other if role else 0
                    result, measured, row = run_slice(session, target, level)
                    parts[target].append((result, measured))
                    slices.append(row)
                    rows[role] = row
                    session.progress.window(names[target], level, len(slices), result.figures)
                ratios[names[other]].append(_ratios(rows[0], rows[1]))
        session.progress.level_done(len(slices))
        for target, got in parts.items():
            results.append(merged(session, got))
            report_level(results[-1])
        levels.append({"level": level, "slices": slices, "vs_baseline": summarize(ratios),
                       "costs": {n: costs(slices, n) for n in names}})
    return results, {"compare": {"baseline": names[0], "pairs": pairs, "slice_ms": session.measurement.interval_ms,
                                 "levels": levels}}


def _ratios(base: dict, cand: dict) -> dict[str, float]:
    nan = float("nan")
    return {"rps_ratio": cand["rps"] / base["rps"] if base["rps"] else nan,
            "p50_ratio": cand["p50_us"] / base["p50_us"] if base["p50_us"] else nan}


def summarize(ratios: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Median and range of each compared server's per-pair ratios."""
    out = {}
    for name, pairs in ratios.items():
        rps = sorted(p["rps_ratio"] for p in pairs)
        p50 = sorted(p["p50_ratio"] for p in pairs)
        out[name] = {"rps_ratio_median": statistics.median(rps), "rps_ratio_min": rps[0], "rps_ratio_max": rps[-1],
                     "p50_ratio_median": statistics.median(p50), "p50_ratio_min": p50[0], "p50_ratio_max": p50[-1],
                     "pairs": len(pairs)}
    return out


def costs(slices: list[dict], name: str) -> dict[str, float | None]:
    """Medians over a server's slices of what one request cost (None where not read)."""
    rows = [r for r in slices if r["target"] == name]
    out: dict[str, float | None] = {}
    for key in COST_KEYS:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = statistics.median(values) if values else None
    return out


def merged(session: Session, parts: list[tuple[LevelResult, list[Record]]]) -> LevelResult:
    """A server's slices at one level as one result (the CSV's and the plot's row)."""
    first = parts[0][0]
    measured = [r for _, m in parts for r in m]
    fig = figures(measured, sum(p.figures.duration_s for p, _ in parts), session.requests.batch,
                  server_sum([p.figures.server for p, _ in parts]), session.measurement.percentile,
                  session.requests.decoupled)
    cpu = [p.server_cpu_us for p, _ in parts if p.server_cpu_us is not None]
    return LevelResult(first.target, first.mode, first.level, fig, [p.figures for p, _ in parts], True,
                       [r for p, _ in parts for r in p.records], [b for p, _ in parts for b in p.boundaries],
                       [c for p, _ in parts for c in p.clients], statistics.median(cpu) if cpu else None)


def compare_text(extra: dict[str, Any], model: str) -> str:
    """The ratios and costs per level, as the terminal shows them."""
    doc = extra["compare"]
    lines = []
    for lvl in doc["levels"]:
        lines.append(f"# {model} at {lvl['level']:g}: {doc['pairs']} pairs of {doc['slice_ms']} ms slices")
        for name, s in lvl["vs_baseline"].items():
            lines.append(f"{name} / {doc['baseline']}: throughput {s['rps_ratio_median']:.2f}x "
                         f"(pairs {s['rps_ratio_min']:.2f}-{s['rps_ratio_max']:.2f}), p50 {s['p50_ratio_median']:.2f}x "
                         f"(pairs {s['p50_ratio_min']:.2f}-{s['p50_ratio_max']:.2f}), {s['pairs']} pairs")
        for name, c in lvl["costs"].items():
            server = f"server {c['server_cpu_us']:.0f} us" if c["server_cpu_us"] is not None else \
                "server not measured (no port to find it by, or its processes are not readable)"
            waits = ""
            if c["client_wait_us"] is not None:
                waits = f"; waits for a core: a client {c['client_wait_us']:.0f} us"
                if c["server_wait_us"] is not None:
                    waits += f", the server {c['server_wait_us']:.0f} us"
            client = "-" if c["client_cpu_us"] is None else f"{c['client_cpu_us']:.0f}"
            lines.append(f"{name} per request (medians of its slices): a client {client} us, {server}, "
                         f"machine idle {c['idle']:.0%}{waits}")
    return "\n".join(lines)
