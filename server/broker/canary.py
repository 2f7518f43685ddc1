"""Canary releases: a fraction of a model's unversioned traffic goes to its newest version while
the rest stays on the stable one, and the canary is rolled back on its own evidence.

Which versions: the canary is the highest READY version that was not rolled back; the stable one
is the last promoted version if it is still ready, else the next highest. Versions are chosen per
request (by the local client library for direct routes, by the broker otherwise) from the split
the broker publishes with its routes. The broker snapshots both versions' cumulative statistics
every half second and judges the last ``window_s`` seconds: error rate and p99 latency of the
canary against the stable version's, plus margins. Every decision is logged and counted.
"""
from __future__ import annotations

import collections
import dataclasses
import difflib
import logging
import time
from typing import Any, Iterable

import numpy as np

from shmserve.shm.stats import VersionTotals, quantile_ns

log = logging.getLogger("shmserve.canary")

PARAMETERS = {  # config.pbtxt parameter key -> policy field
    "canary_fraction": "fraction",
    "canary_window_s": "window_s",
    "canary_min_requests": "min_requests",
    "canary_max_error_rate_margin": "error_margin",
    "canary_max_p99_margin": "p99_margin",
    "canary_min_p99_delta_ms": "p99_min_delta_ms",
}


def unknown_parameters(parameters: dict[str, str]) -> list[str]:
    """Warnings for keys of ``parameters`` in the canary's namespace that name no setting (a typo
    would leave the canary off, silently), each with the setting it is closest to."""
    out = []
    for key in sorted(k for k in parameters if k.startswith("canary_") and k not in PARAMETERS):
        near = difflib.get_close_matches(key, PARAMETERS, n=1)
        out.append(f"parameter '{key}' is no canary setting and is ignored" +
                   (f" (did you mean '{near[0]}'?)" if near else f" (canary settings: {', '.join(PARAMETERS)})"))
    return out


P99_MIN_SAMPLES = 100  # per version in the window: fewer, and the "p99" is just the slowest one
SNAPSHOT_EVERY_S = 0.5


@dataclasses.dataclass
class CanaryPolicy:
    fraction: float = 0.0  # of unversioned requests sent to the canary; 0 disables canaries
    window_s: float = 30.0  # the evidence judged: this many recent seconds
    min_requests: int = 50  # per version in the window before any automatic decision
    error_margin: float = 0.05  # roll back when canary error rate > stable's + this (absolute)
    p99_margin: float = 0.5  # roll back when canary p99 > stable p99 * (1 + this)
    p99_min_delta_ms: float = 1.0  # ... and exceeds it by at least this much (host noise is not a regression)

    def updated(self, changes: dict[str, Any]) -> "CanaryPolicy":
        """A copy with ``changes`` (policy field names) applied and checked."""
        fields = {f.name: f.type for f in dataclasses.fields(self)}
        values = dataclasses.asdict(self)
        for key, raw in changes.items():
            if key not in fields:
                raise ValueError(f"unknown canary setting '{key}' (known: {', '.join(fields)})")
            try:
                values[key] = int(raw) if key == "min_requests" else float(raw)
            except (TypeError, ValueError):
                raise ValueError(f"canary setting '{key}' must be a number, got {raw!r}") from None
        out = CanaryPolicy(**values)
        if not 0.0 <= out.fraction <= 1.0:
            raise ValueError(f"canary fraction must lie in [0, 1], got {out.fraction}")
        if out.window_s <= 0 or out.min_requests < 1 or out.error_margin < 0 or out.p99_margin < 0 \
                or out.p99_min_delta_ms < 0:
            raise ValueError("canary window_s must be > 0, min_requests >= 1 and margins >= 0")
        return out

    @classmethod
    def from_parameters(cls, parameters: dict[str, str]) -> "CanaryPolicy":
        """The policy a config.pbtxt asks for; errors name the parameter as written there."""
        policy = cls()
        for key, field in PARAMETERS.items():
            if key in parameters:
                try:
                    policy = policy.updated({field: parameters[key]})
                except ValueError as e:
                    raise ValueError(f"parameter '{key}': {e}") from None
        return policy


@dataclasses.dataclass
class Split:
    """Where unversioned requests of one model go."""

    stable: int
    canary: int | None = None
    fraction: float = 0.0

    def doc(self) -> dict[str, Any]:
        return {"stable": self.stable, "canary": self.canary, "fraction": self.fraction}


@dataclasses.dataclass
class Decision:
    at: float  # wall clock
    action: str  # "promote" or "rollback"
    version: int  # the canary
    stable: int
    trigger: str  # "manual", "error_rate" or "p99_latency"
    detail: str


class Canary:
    """One model's canary state: its policy, what was promoted or rolled back, and its evidence."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.configured = CanaryPolicy()
        self.override: dict[str, Any] = {}  # set through the API; wins over config.pbtxt until restart
        self.promoted: int | None = None
        self.rejected: set[int] = set()  # rolled-back versions (until they are loaded again)
        self.decisions: collections.deque[Decision] = collections.deque(maxlen=50)
        self.counts: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self._snapshots: collections.deque[tuple[float, dict[Any, tuple[int, int, np.ndarray]]]] = \
            collections.deque()
        self._last_snapshot = 0.0

    @property
    def policy(self) -> CanaryPolicy:
        return self.configured.updated(self.override) if self.override else self.configured

    def split(self, ready: Iterable[int]) -> Split | None:
        """The split over the READY versions, or None when none is ready."""
        candidates = sorted(v for v in ready if v not in self.rejected)
        if not candidates:
            return None
        top = candidates[-1]
        fraction = self.policy.fraction
        if fraction <= 0 or len(candidates) < 2 or top == self.promoted:
            return Split(stable=top)
        below = [v for v in candidates if v < top]
        stable = self.promoted if self.promoted in below else below[-1]
        return Split(stable=stable, canary=top, fraction=fraction)

    def forget_version(self, version: int) -> None:
        """A version loaded anew gets a fresh chance."""
        self.rejected.discard(version)

    # -- decisions ----------------------------------------------------------------------------
    def decide(self, action: str, split: Split, trigger: str, detail: str) -> Decision:
        assert split.canary is not None
        if action == "promote":
            self.promoted = split.canary
        else:
            self.rejected.add(split.canary)
            self.promoted = split.stable
        d = Decision(time.time(), action, split.canary, split.stable, trigger, detail)
        self.decisions.append(d)
        self.counts[(split.canary, action, trigger)] += 1
        self._snapshots.clear()
        (log.warning if action == "rollback" else log.info)(
            "canary of '%s': %s version %d (stable %d), %s: %s", self.model, action, split.canary,
            split.stable, trigger, detail)
        return d

    def observe(self, now: float, split: Split, totals: dict[int, tuple[Any, VersionTotals]]) -> Decision | None:
        """Snapshot both versions' counters; roll back when the window's evidence says so."""
        if split.canary is None or now - self._last_snapshot < SNAPSHOT_EVERY_S:
            return None
        self._last_snapshot = now
        policy = self.policy
        snap = {}
        for v in (split.stable, split.canary):
            key, st = totals[v]
            # Errors clients saw: an error response a model returned is a success in Triton's counts
            errors = st.get("error_responses")
            snap[key] = (st.get("success") - errors, st.get("failure") + errors, st.hist[0].copy())
        self._snapshots.append((now, snap))
        while self._snapshots and now - self._snapshots[0][0] > policy.window_s:
            self._snapshots.popleft()
        first = self._snapshots[0][1]
        window = {}
        for v in (split.stable, split.canary):
            key = totals[v][0]
            if key not in first:
                return None  # a version reloaded within the window: wait for a clean window
            s0, f0, h0 = first[key]
            s1, f1, h1 = snap[key]
            window[v] = (s1 - s0, f1 - f0, h1 - h0)
        (cs, cf, ch), (ss, sf, sh) = window[split.canary], window[split.stable]
        if cs + cf < policy.min_requests:
            return None
        canary_err = cf / (cs + cf)
        stable_err = sf / (ss + sf) if ss + sf else 0.0
        if canary_err > stable_err + policy.error_margin:
            return self.decide("rollback", split, "error_rate",
                               f"error rate {canary_err:.3f} over {cs + cf} requests exceeds the stable "
                               f"version's {stable_err:.3f} + margin {policy.error_margin}")
        enough = max(policy.min_requests, P99_MIN_SAMPLES)
        if cs >= enough and ss >= enough:
            cp99, sp99 = quantile_ns(ch, 0.99), quantile_ns(sh, 0.99)
            if cp99 > sp99 * (1.0 + policy.p99_margin) and cp99 - sp99 > policy.p99_min_delta_ms * 1e6:
                return self.decide("rollback", split, "p99_latency",
                                   f"p99 {cp99 / 1e3:.0f} us exceeds the stable version's {sp99 / 1e3:.0f} us "
                                   f"x (1 + {policy.p99_margin}) by more than {policy.p99_min_delta_ms} ms")
        return None

    def status(self, split: Split | None) -> dict[str, Any]:
        return {
            "model": self.model,
            "policy": dataclasses.asdict(self.policy),
            "split": split.doc() if split is not None else None,
            "promoted": self.promoted,
            "rolled_back": sorted(self.rejected),
            "decisions": [dataclasses.asdict(d) for d in self.decisions],
        }
