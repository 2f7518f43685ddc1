"""``shmserve-analyzer``: model-analyzer's job for shmserve. Given a repository and a model, it
tries instance counts, max batch sizes, preferred batch sizes and queue delays, serves each
configuration with a server of its own (from a temporary copy of the repository), measures it
with shmserve-perf over a concurrency sweep, and writes a report folder: report.html,
results.csv and the best config.pbtxt. See docs/tools.md.

    shmserve-analyzer --model-repository model_repository -m digits --latency-budget-ms 20
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from shmserve.tools.analyzer import report
from shmserve.tools.analyzer.configs import apply, read_config
from shmserve.tools.analyzer.runner import Goal, Outcome, Setup, evaluate, triton_missing
from shmserve.tools.analyzer.space import Bounds, Candidate, brute, powers_of_two, quick
from shmserve.tools.perf.progress import Bar, Quiet


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmserve-analyzer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", type=Path, required=True, help="the repository holding the model")
    p.add_argument("-m", "--model", "--profile-models", dest="model", required=True, help="the model to size")
    g = p.add_argument_group("the search")
    g.add_argument("--run-config-search-mode", choices=("quick", "brute"), default="quick",
                   help="quick: climb from the smallest configuration to the best neighbour until none is better; "
                        "brute: every combination within the bounds (default quick)")
    g.add_argument("--run-config-search-min-instance-count", type=int, default=1, help="fewest instances (default 1)")
    g.add_argument("--run-config-search-max-instance-count", type=int, default=3, help="most instances (default 3)")
    g.add_argument("--run-config-search-min-model-batch-size", type=int, default=1,
                   help="smallest max_batch_size tried (default 1; powers of two from here)")
    g.add_argument("--run-config-search-max-model-batch-size", type=int, default=64,
                   help="largest max_batch_size tried (default 64; 0: keep the model unbatched)")
    g.add_argument("--run-config-search-max-preferred-batch-size", type=int, default=8,
                   help="largest preferred batch size tried, besides none (default 8; 1: never a preference)")
    g.add_argument("--queue-delays", default="0,500,2000", metavar="US,US,...",
                   help="the dynamic batcher's max_queue_delay_microseconds values tried (default 0,500,2000)")
    g.add_argument("--run-config-search-max-concurrency", type=int, default=16,
                   help="each configuration is swept at concurrency 1, 2, 4 ... up to this (default 16)")
    g = p.add_argument_group("the goal")
    g.add_argument("--latency-budget-ms", type=float,
                   help="the best configuration gives the most throughput within this latency")
    g.add_argument("--min-throughput", type=float, metavar="INFER_PER_S",
                   help="the best configuration gives the lowest latency at this throughput or more")
    g.add_argument("--latency-percentile", type=int, choices=(50, 90, 95, 99), default=99,
                   help="the latency the goal means (default 99: p99)")
    g = p.add_argument_group("measuring")
    g.add_argument("-p", "--measurement-interval", type=int, default=2000, metavar="MS",
                   help="shmserve-perf's measurement window (default 2000)")
    g.add_argument("-r", "--max-trials", type=int, default=5, help="shmserve-perf's most windows per level (default 5)")
    g.add_argument("--perf-args", default="", metavar="'FLAGS'",
                   help="more shmserve-perf flags for every sweep, e.g. '--shape INPUT0:16 -b 2' "
                        "(see shmserve-perf -h)")
    g.add_argument("--triton", action="store_true",
                   help="serve each configuration with tritonserver instead of shmserve (needs tritonserver on PATH)")
    g = p.add_argument_group("output")
    g.add_argument("-e", "--export-path", type=Path,
                   help="the report folder (default $XDG_DATA_HOME/shmserve-analyzer/MODEL, that is "
                        "~/.local/share/shmserve-analyzer/MODEL: outside any checkout); server logs go to its logs/")
    g.add_argument("--top", type=int, default=3, help="how many configurations the terminal shows (default 3)")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def bounds_of(args: argparse.Namespace, batching: bool) -> Bounds:
    instances = tuple(range(args.run_config_search_min_instance_count, args.run_config_search_max_instance_count + 1))
    if not instances:
        raise ValueError("needs --run-config-search-min-instance-count <= --run-config-search-max-instance-count")
    batches: tuple[int, ...] = ()
    if batching and args.run_config_search_max_model_batch_size > 0:
        batches = tuple(powers_of_two(args.run_config_search_min_model_batch_size,
                                      args.run_config_search_max_model_batch_size))
    delays = tuple(int(d) for d in args.queue_delays.split(","))
    return Bounds(instances, batches, delays, args.run_config_search_max_preferred_batch_size)


def default_export_path(model: str) -> Path:
    """Where reports go unless ``-e`` says: the user's data folder (XDG), so that a run from a
    checkout does not leave an untracked folder in it."""
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "shmserve-analyzer" / model


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = args.model_repository / args.model
    try:
        if args.triton and (reason := triton_missing()):
            raise ValueError(reason)
        if args.latency_budget_ms is not None and args.min_throughput is not None:
            raise ValueError("give --latency-budget-ms or --min-throughput, not both")
        base = read_config(model_dir)
        bounds = bounds_of(args, batching=base.max_batch_size > 0 and not base.HasField("sequence_batching"))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    goal = Goal(args.latency_budget_ms, args.min_throughput, args.latency_percentile)
    export = args.export_path or default_export_path(args.model)
    (export / "logs").mkdir(parents=True, exist_ok=True)
    levels = ",".join(map(str, powers_of_two(1, args.run_config_search_max_concurrency)))
    perf_flags = ["--concurrency-range", levels, "-p", str(args.measurement_interval), "-r", str(args.max_trials),
                  "--percentile", str(args.latency_percentile), *shlex.split(args.perf_args)]
    server = "tritonserver" if args.triton else "shmserve"
    print(f"# {args.model}: {args.run_config_search_mode} search, goal: {goal.describe()}; each configuration "
          f"served by {server} and swept at concurrency {levels}", flush=True)
    with tempfile.TemporaryDirectory(prefix="shmserve-analyzer-") as work:
        setup = Setup(model_dir, perf_flags, Path(work), export / "logs", args.triton)
        outcomes = search(args, setup, (base, bounds, goal))
    return finish(args, export, outcomes, goal)


def search(args: argparse.Namespace, setup: Setup, plan: tuple[Any, Bounds, Goal]) -> list[Outcome]:
    """The model's own config first, then the search; each configuration tried once."""
    base, bounds, goal = plan
    outer = _ConfigBar(len(list(brute(bounds))) + 1 if args.run_config_search_mode == "brute" else None, args.quiet)
    outcomes: dict[Candidate | None, Outcome] = {}

    def trial(name: str, candidate: Candidate | None, config: Any) -> Outcome:
        inner = Quiet() if args.quiet else Bar(len(powers_of_two(1, args.run_config_search_max_concurrency)),
                                               args.max_trials, "concurrency", position=1)
        try:
            outer.note(f"trying {name}")
            outcome = evaluate(setup, name, candidate, config, goal, inner)
        finally:
            inner.close()
        outer.done(outcome)
        outcomes[candidate] = outcome
        return outcome

    try:
        trial("default", None, base)
        score: Callable[[Candidate], float | None] = lambda c: (
            outcomes[c] if c in outcomes else trial(c.name, c, apply(base, c))).score
        if args.run_config_search_mode == "brute":
            for candidate in brute(bounds):
                score(candidate)
        else:
            quick(bounds, score)
    finally:
        outer.close()
    return list(outcomes.values())


class _ConfigBar:
    """The bar across the whole search: one step per configuration (no total in quick mode);
    nothing with ``-q``."""

    def __init__(self, total: int | None, quiet: bool) -> None:
        from tqdm import tqdm

        self.bar: Any = tqdm(total=total, unit="config", position=0, file=sys.stderr, dynamic_ncols=True,
                             disable=quiet)

    def note(self, text: str) -> None:
        self.bar.set_description_str(text)

    def done(self, outcome: Outcome) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def finish(args: argparse.Namespace, export: Path, outcomes: list[Outcome], goal: Goal) -> int:
    """The report folder and the top configurations; 1 when none met the goal."""
    order = report.ranked(outcomes)
    best = order[0] if order and order[0].score is not None else None
    report.write_csv(export / "results.csv", outcomes, best, goal)
    report.write_html(export / "report.html", outcomes, best, goal, f"shmserve-analyzer: {args.model}")
    if best is not None:
        (export / "config.pbtxt").write_text(best.config)
    print(f"Top {min(args.top, len(order))} of {len(order)} configuration(s) ({goal.describe()}):")
    for i, o in enumerate(order[:args.top], 1):
        print(report.summary_line(i, o, goal))
    default = next((o for o in outcomes if o.candidate is None), None)
    if best is not None and default is not None and default.score and best is not default:
        what = "throughput" if goal.min_throughput is None else f"p{goal.percentile} latency"
        print(f"The best's {what} is {best.score / default.score:.2f}x the model's own config's")
    elif default is not None and default.score is None:
        print("The model's own config did not meet the goal")
    print(f"Report: {export / 'report.html'}; results: {export / 'results.csv'}"
          + (f"; best config: {export / 'config.pbtxt'}" if best else "; no configuration met the goal"))
    return 0 if best is not None else 1


if __name__ == "__main__":
    sys.exit(main())
