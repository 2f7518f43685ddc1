"""The configurations the analyzer tries: instance count, max batch size, preferred batch sizes
and the dynamic batcher's queue delay, within the user's bounds. Brute force tries every
combination; the quick search climbs from the smallest one, one step at a time along one knob,
to the best neighbour until none is better (model-analyzer's two modes)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator


@dataclass(frozen=True)
class Candidate:
    """One configuration to try. ``max_batch_size`` 0 keeps the model unbatched (no dynamic
    batcher); ``preferred`` empty leaves the batcher free to send any size."""

    instances: int
    max_batch_size: int
    preferred: tuple[int, ...] = ()
    queue_delay_us: int = 0

    @property
    def name(self) -> str:
        if self.max_batch_size == 0:
            return f"instances{self.instances}"
        pref = f"_pref{'-'.join(map(str, self.preferred))}" if self.preferred else ""
        return f"instances{self.instances}_batch{self.max_batch_size}{pref}_delay{self.queue_delay_us}us"


@dataclass(frozen=True)
class Bounds:
    """What the search may try; ``batch_sizes`` empty: the model does not batch."""

    instances: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    delays_us: tuple[int, ...]
    max_preferred: int

    def preferred_options(self, max_batch_size: int) -> list[tuple[int, ...]]:
        """No preference, or one preferred size (powers of two up to the batch and the bound)."""
        sizes = powers_of_two(2, min(max_batch_size, self.max_preferred))
        return [()] + [(s,) for s in sizes]


def powers_of_two(low: int, high: int) -> list[int]:
    """The powers of two from ``low`` to ``high``, and ``high`` itself."""
    out, value = [], 1
    while value < high:
        if value >= low:
            out.append(value)
        value *= 2
    return out + [high] if high >= low else out


def brute(bounds: Bounds) -> Iterator[Candidate]:
    """Every combination within the bounds."""
    for instances in bounds.instances:
        if not bounds.batch_sizes:
            yield Candidate(instances, 0)
            continue
        for mbs in bounds.batch_sizes:
            for preferred in bounds.preferred_options(mbs):
                for delay in bounds.delays_us:
                    yield Candidate(instances, mbs, preferred, delay)


def neighbours(c: Candidate, bounds: Bounds) -> list[Candidate]:
    """The candidates one step away along one knob."""
    out = []
    for axis, values in (("instances", list(bounds.instances)), ("max_batch_size", list(bounds.batch_sizes)),
                         ("queue_delay_us", list(bounds.delays_us))):
        current = getattr(c, axis)
        if current in values:
            i = values.index(current)
            for j in (i - 1, i + 1):
                if 0 <= j < len(values):
                    out.append(_with(c, axis, values[j], bounds))
    if c.max_batch_size:
        options = bounds.preferred_options(c.max_batch_size)
        i = options.index(c.preferred) if c.preferred in options else 0
        for j in (i - 1, i + 1):
            if 0 <= j < len(options):
                out.append(Candidate(c.instances, c.max_batch_size, options[j], c.queue_delay_us))
    return out


def _with(c: Candidate, axis: str, value: int, bounds: Bounds) -> Candidate:
    values = {"instances": c.instances, "max_batch_size": c.max_batch_size, "queue_delay_us": c.queue_delay_us,
              axis: value}
    preferred = c.preferred if c.preferred in bounds.preferred_options(values["max_batch_size"]) else ()
    return Candidate(values["instances"], values["max_batch_size"], preferred, values["queue_delay_us"])


def quick(bounds: Bounds, score: Callable[[Candidate], float | None]) -> None:
    """Hill climbing from the smallest candidate: move to the best-scoring neighbour while it
    beats the current one (``score`` None: the candidate failed or missed the goal)."""
    current = Candidate(bounds.instances[0], bounds.batch_sizes[0] if bounds.batch_sizes else 0,
                        (), bounds.delays_us[0] if bounds.batch_sizes else 0)
    best = score(current)
    seen = {current}
    while True:
        tried = [(score(n), n) for n in neighbours(current, bounds) if n not in seen]
        seen.update(n for _, n in tried)
        scored = [(s, n) for s, n in tried if s is not None]
        if not scored:
            return
        top_score, top = max(scored, key=lambda x: x[0])
        if best is not None and top_score <= best:
            return
        current, best = top, top_score
