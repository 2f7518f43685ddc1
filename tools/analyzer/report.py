"""The analyzer's report folder: ``results.csv`` (a row per configuration and concurrency),
``config.pbtxt`` (the best configuration, ready to copy into the repository) and ``report.html``
(the ranking, throughput against latency per configuration with the chosen one highlighted, and
each configuration's memory), and the top configurations as the terminal shows them."""
from __future__ import annotations

import csv
import html
import importlib.util
from pathlib import Path

from shmserve.tools.analyzer.runner import Goal, Outcome
from shmserve.tools.perf.plot import in_level_order

COLUMNS = ["config", "instances", "max_batch_size", "preferred_batch_size", "max_queue_delay_us", "concurrency",
           "inferences_per_second", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "server_queue_us",
           "server_compute_infer_us", "memory_mb", "gpu_memory_mb", "meets_goal", "chosen", "error"]


def ranked(outcomes: list[Outcome]) -> list[Outcome]:
    """Best first; configurations that failed or missed the goal last."""
    return sorted(outcomes, key=lambda o: (o.score is None, -(o.score or 0.0)))


def knobs(o: Outcome) -> list[str]:
    if o.candidate is None:
        return ["(the model's own)", "", "", ""]
    c = o.candidate
    return [str(c.instances), str(c.max_batch_size), " ".join(map(str, c.preferred)), str(c.queue_delay_us)]


def write_csv(path: Path, outcomes: list[Outcome], best: Outcome | None, goal: Goal) -> None:
    with path.open("w", newline="") as fh:
        out = csv.writer(fh)
        out.writerow(COLUMNS)
        for o in ranked(outcomes):
            if o.error:
                out.writerow([o.name, *knobs(o), *[""] * 12, o.error])
            for lv in o.levels:
                f, s = lv.figures, lv.figures.server
                out.writerow([o.name, *knobs(o), f"{lv.level:g}", round(f.throughput, 2),
                              *(round(getattr(f, f"p{q}_us") / 1000, 3) for q in (50, 90, 95, 99)),
                              round(s.average_us("queue")) if s else "",
                              round(s.average_us("compute_infer")) if s else "",
                              _mb(o.memory_mb), _mb(o.gpu_memory_mb), "yes" if goal.meets(lv) else "",
                              "yes" if o is best and lv is o.chosen else "", ""])


def _mb(value: float | None) -> str:
    return "" if value is None else f"{value:.0f}"


def summary_line(rank: int, o: Outcome, goal: Goal) -> str:
    if o.chosen is None:
        why = o.error or "no concurrency met the goal"
        return f"{rank}. {o.name}: {why}"
    f = o.chosen.figures
    return (f"{rank}. {o.name}: {f.throughput:,.1f} infer/s at concurrency {o.chosen.level:g}, "
            f"p{goal.percentile} {goal.latency_ms(o.chosen):.2f} ms, p50 {f.p50_us / 1000:.2f} ms, "
            f"memory {_mb(o.memory_mb)} MB" + (f", GPU {_mb(o.gpu_memory_mb)} MB" if o.gpu_memory_mb else ""))


def write_html(path: Path, outcomes: list[Outcome], best: Outcome | None, goal: Goal, title: str) -> None:
    order = ranked(outcomes)
    rows = "\n".join(
        f"<tr{' class=best' if o is best else ''}><td>{i}</td><td>{html.escape(o.name)}</td>"
        + "".join(f"<td>{html.escape(k)}</td>" for k in knobs(o))
        + f"<td>{html.escape(summary_line(i, o, goal).split(': ', 1)[1])}</td></tr>"
        for i, o in enumerate(order, 1))
    plots = _plots(outcomes, best, goal)
    best_text = html.escape(best.config) if best else "no configuration met the goal"
    path.write_text(f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px}} tr.best{{background:#fff3bf;font-weight:bold}}</style></head>
<body><h1>{html.escape(title)}</h1>
<p>Goal: {html.escape(goal.describe())}. The chosen configuration is highlighted.</p>
<table><tr><th>rank</th><th>configuration</th><th>instances</th><th>max batch</th><th>preferred</th>
<th>queue delay (us)</th><th>result</th></tr>
{rows}</table>
{plots}
<h2>The chosen config.pbtxt</h2><pre>{best_text}</pre>
</body></html>
""")


def _plots(outcomes: list[Outcome], best: Outcome | None, goal: Goal) -> str:
    """Throughput against latency per configuration, and memory per configuration (plotly)."""
    if importlib.util.find_spec("plotly") is None:
        return "<p>(No plots: plotly is not installed: the plots extra, from the checkout .venv/bin/pip install -e '.[plots]'.)</p>"
    import plotly.graph_objects as go

    curves = go.Figure()
    for o in ranked(outcomes):
        if not o.levels:
            continue
        chosen, levels = o is best, in_level_order(o.levels)
        curves.add_trace(go.Scatter(
            x=[lv.figures.throughput for lv in levels], y=[goal.latency_ms(lv) for lv in levels],
            mode="lines+markers", name=o.name + (" (chosen)" if chosen else ""),
            text=[f"concurrency {lv.level:g}" for lv in levels],
            line={"width": 4 if chosen else 1.5, "color": "#d62728" if chosen else None},
            opacity=1.0 if chosen else 0.6))
    if goal.latency_budget_ms is not None:
        curves.add_hline(y=goal.latency_budget_ms, line_dash="dash", annotation_text="latency budget")
    curves.update_layout(title="Throughput against latency, per configuration", template="plotly_white",
                         xaxis_title="throughput (inferences/s)", yaxis_title=f"p{goal.percentile} latency (ms)")
    measured = [o for o in ranked(outcomes) if o.memory_mb is not None]
    memory = go.Figure(go.Bar(x=[o.name for o in measured], y=[o.memory_mb for o in measured], name="CPU (PSS)",
                              marker_color=["#d62728" if o is best else "#1f77b4" for o in measured]))
    if any(o.gpu_memory_mb is not None for o in measured):
        memory.add_trace(go.Bar(x=[o.name for o in measured], y=[o.gpu_memory_mb or 0 for o in measured], name="GPU",
                                marker_color="#2ca02c"))
    memory.update_layout(title="Memory of the server's processes per configuration: CPU (PSS, from /proc), and "
                         "GPU (nvidia-smi) where there is one", template="plotly_white", yaxis_title="MB")
    return (curves.to_html(full_html=False, include_plotlyjs=True)
            + memory.to_html(full_html=False, include_plotlyjs=False))
