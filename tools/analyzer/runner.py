"""One configuration tried: written into a temporary repository, served by a server of its own
(shmserve, or tritonserver with ``--triton``), measured by shmserve-perf's internals over the
concurrency sweep, its memory read from /proc (and nvidia-smi, where there is one), and the
server stopped. The goal (a latency budget
or a throughput to reach) turns the sweep into the configuration's score."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shmserve.server.broker.config import ModelConfig
from shmserve.tools.analyzer.configs import config_text, write_repository
from shmserve.tools.analyzer.space import Candidate
from shmserve.tools.harness import ServerProcess, free_port, gpu_memory_mib, memory_kb
from shmserve.tools.perf.cli import measure
from shmserve.tools.perf.measure import LevelResult


class TritonProcess(ServerProcess):
    """tritonserver (from PATH) in place of shmserve, on free loopback ports."""

    def command(self, repos: list[Path | str], flags: tuple[str, ...]) -> list[str]:
        return ["tritonserver", *[f"--model-repository={r}" for r in repos], f"--http-port={self.port}",
                f"--metrics-port={self.metrics_port}", *flags]


def triton_missing() -> str | None:
    """Why ``--triton`` cannot run here, or None."""
    if shutil.which("tritonserver") is None:
        return "--triton starts tritonserver, and there is none on PATH: install Triton, or leave --triton out"
    return None


@dataclass(frozen=True)
class Goal:
    """What makes one configuration better than another: the most throughput whose latency
    percentile stays within ``latency_budget_ms``, or the least latency reaching
    ``min_throughput``; without either, the most throughput."""

    latency_budget_ms: float | None
    min_throughput: float | None
    percentile: int = 99

    def latency_ms(self, level: LevelResult) -> float:
        return getattr(level.figures, f"p{self.percentile}_us") / 1000

    def meets(self, level: LevelResult) -> bool:
        f = level.figures
        within = self.latency_budget_ms is None or self.latency_ms(level) <= self.latency_budget_ms
        return bool(f.requests) and within and (self.min_throughput is None or f.throughput >= self.min_throughput)

    def pick(self, levels: list[LevelResult]) -> tuple[LevelResult | None, float | None]:
        """The level that meets the goal best, and the configuration's score (higher is better)."""
        good = [lv for lv in levels if self.meets(lv)]
        if self.min_throughput is not None:
            best = min(good, key=self.latency_ms, default=None)
            return best, (-self.latency_ms(best) if best else None)
        best = max(good, key=lambda lv: lv.figures.throughput, default=None)
        return best, (best.figures.throughput if best else None)

    def describe(self) -> str:
        if self.min_throughput is not None:
            return f"the lowest p{self.percentile} latency at {self.min_throughput:g} infer/s or more"
        if self.latency_budget_ms is not None:
            return f"the most throughput with p{self.percentile} latency within {self.latency_budget_ms:g} ms"
        return "the most throughput"


@dataclass
class Outcome:
    """A configuration's result: its sweep, the level chosen by the goal, memory, or its error."""

    name: str
    candidate: Candidate | None  # None: the model's own config
    config: str
    levels: list[LevelResult]
    chosen: LevelResult | None
    score: float | None
    memory_mb: float | None
    error: str | None = None
    gpu_memory_mb: float | None = None  # where nvidia-smi answers


@dataclass(frozen=True)
class Setup:
    """What every trial shares: the model's folder, the shmserve-perf flags of its sweep, where
    logs go, and which server to start."""

    model_dir: Path
    perf_flags: list[str]
    work: Path
    logs: Path
    triton: bool = False


def evaluate(setup: Setup, name: str, candidate: Candidate | None, config: ModelConfig, goal: Goal,
             progress: Any) -> Outcome:
    """Serve ``config``, sweep it, read the memory, stop; errors become the outcome's."""
    text = config_text(config)
    repo = write_repository(setup.work / "repository", setup.model_dir, config)
    kind = TritonProcess if setup.triton else ServerProcess
    try:
        server = kind([repo], f"--grpc-port={free_port()}", log=setup.logs / f"{name}.log")
    except RuntimeError as exc:
        return Outcome(name, candidate, text, [], None, None, None, f"the server did not start: {exc}")
    try:
        levels = measure(["-m", setup.model_dir.name, "-u", server.url, *setup.perf_flags], progress)
        memory, gpu = _memory_mb(server.tree()), gpu_memory_mib(server.tree())
    except Exception as exc:  # noqa: BLE001 - this configuration failed; the search goes on
        return Outcome(name, candidate, text, [], None, None, None, f"{type(exc).__name__}: {exc}")
    finally:
        server.stop()
    chosen, score = goal.pick(levels)
    return Outcome(name, candidate, text, levels, chosen, score, memory,
                   gpu_memory_mb=float(sum(gpu.values())) if gpu is not None else None)


def _memory_mb(pids: list[int]) -> float:
    """Proportional set size of the server's processes (shared pages split between them)."""
    total = 0
    for pid in pids:
        try:
            total += memory_kb(pid)["pss"]
        except OSError:
            continue  # gone meanwhile
    return total / 1024
