"""``--plot``: latency percentiles against throughput over the sweep, one curve per percentile
and server, each point labelled with its level. PNG through matplotlib, HTML through plotly
(self-contained: plotly.js inside, so the file opens without a network)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from shmserve.tools.perf.measure import LevelResult

PERCENTILES = ("p50", "p90", "p95", "p99")
STYLES = {"p50": "-", "p90": "--", "p95": "-.", "p99": ":"}
DASHES = {"p50": "solid", "p90": "dash", "p95": "dashdot", "p99": "dot"}


def check_plot_path(path: Path) -> None:
    """Refuse before measuring what could not be drawn at the end."""
    module = {".png": "matplotlib", ".html": "plotly"}.get(path.suffix.lower())
    if module is None:
        raise ValueError(f"--plot {path}: the name must end in .png or .html")
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"--plot {path} needs {module}, in the plots extra: from the checkout, "
                         ".venv/bin/pip install -e '.[plots]'")


def in_level_order(levels: list[LevelResult]) -> list[LevelResult]:
    """A curve's points by concurrency (or request rate), whatever order they were measured or
    listed in (the CSV's rows go by throughput): where throughput falls at a higher level, the
    line turns back, which is what it should show."""
    return sorted(levels, key=lambda r: r.level)


def curves(results: list[LevelResult]) -> dict[str, list[LevelResult]]:
    """Each server's levels, in level order."""
    out: dict[str, list[LevelResult]] = {}
    for r in results:
        out.setdefault(r.target, []).append(r)
    return {name: in_level_order(rs) for name, rs in out.items()}


def plot(path: Path, results: list[LevelResult], title: str) -> None:
    if path.suffix.lower() == ".png":
        _png(path, results, title)
    else:
        _html(path, results, title)


def _png(path: Path, results: list[LevelResult], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, rs) in enumerate(curves(results).items()):
        x = [r.figures.throughput for r in rs]
        for q in PERCENTILES:
            y = [getattr(r.figures, f"{q}_us") / 1000 for r in rs]
            ax.plot(x, y, STYLES[q], marker="o", markersize=3, color=colors[i % len(colors)], label=f"{name} {q}")
        for r in rs:
            ax.annotate(f"{r.level:g}", (r.figures.throughput, r.figures.p50_us / 1000), fontsize=7,
                        textcoords="offset points", xytext=(3, -9))
    ax.set_xlabel("throughput (inferences/s)")
    ax.set_ylabel("latency (ms)")
    unit = results[0].mode.replace("_", " ")
    ax.set_title(f"{title}: latency against throughput (points labelled with their {unit})")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _html(path: Path, results: list[LevelResult], title: str) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    for i, (name, rs) in enumerate(curves(results).items()):
        for q in PERCENTILES:
            fig.add_trace(go.Scatter(
                x=[r.figures.throughput for r in rs], y=[getattr(r.figures, f"{q}_us") / 1000 for r in rs],
                mode="lines+markers", name=f"{name} {q}", text=[f"{r.mode} {r.level:g}" for r in rs],
                line={"color": palette[i % len(palette)], "dash": DASHES[q]},
                hovertemplate="%{text}<br>%{x:.1f} infer/s<br>%{y:.3f} ms"))
    fig.update_layout(title=f"{title}: latency against throughput", xaxis_title="throughput (inferences/s)",
                      yaxis_title="latency (ms)", template="plotly_white")
    fig.write_html(path, include_plotlyjs=True, full_html=True)
