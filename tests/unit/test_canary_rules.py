"""Canary releases on their own: which versions the split names, what promotion and rollback
change, and when the evidence of a window (real statistics counters, snapshotted at times passed
in) rolls a canary back."""
from __future__ import annotations

import pytest

from shmserve.server.broker.canary import P99_MIN_SAMPLES, Canary, CanaryPolicy, Split
from shmserve.shm.stats import VersionTotals

MS = 1_000_000  # ns


def canary(**policy) -> Canary:
    c = Canary("m")
    c.configured = CanaryPolicy().updated({"fraction": 0.25, **policy})
    return c


# -- the policy ---------------------------------------------------------------------------------


def test_policy_settings_are_checked_and_converted():
    p = CanaryPolicy().updated({"fraction": "0.5", "min_requests": "7", "window_s": 2})
    assert (p.fraction, p.min_requests, p.window_s) == (0.5, 7, 2.0) and isinstance(p.min_requests, int)
    with pytest.raises(ValueError, match="unknown canary setting 'speed'"):
        CanaryPolicy().updated({"speed": 1})
    with pytest.raises(ValueError, match="canary setting 'window_s' must be a number, got 'soon'"):
        CanaryPolicy().updated({"window_s": "soon"})
    with pytest.raises(ValueError, match=r"fraction must lie in \[0, 1\], got 1.5"):
        CanaryPolicy().updated({"fraction": 1.5})
    for bad in ({"window_s": 0}, {"min_requests": 0}, {"error_margin": -0.1}, {"p99_margin": -1},
                {"p99_min_delta_ms": -1}):
        with pytest.raises(ValueError, match="window_s must be > 0"):
            CanaryPolicy().updated(bad)
    assert CanaryPolicy().fraction == 0.0  # updated() returns a copy


def test_policy_from_config_parameters_names_the_parameter_in_its_errors():
    p = CanaryPolicy.from_parameters({"canary_fraction": "0.1", "canary_window_s": "5", "unrelated": "x"})
    assert (p.fraction, p.window_s, p.min_requests) == (0.1, 5.0, 50)
    with pytest.raises(ValueError, match=r"parameter 'canary_fraction': canary fraction must lie in \[0, 1\]"):
        CanaryPolicy.from_parameters({"canary_fraction": "2"})
    with pytest.raises(ValueError, match="parameter 'canary_min_requests': canary setting 'min_requests' must be"):
        CanaryPolicy.from_parameters({"canary_min_requests": "1.5"})


def test_a_run_time_override_wins_over_the_configured_policy():
    c = canary(window_s=10)
    c.override = {"fraction": 0.5}
    assert (c.policy.fraction, c.policy.window_s) == (0.5, 10.0)
    c.override = {}
    assert c.policy.fraction == 0.25


# -- the split ----------------------------------------------------------------------------------


def test_the_newest_ready_version_is_the_canary_and_the_next_one_stable():
    c = canary()
    assert c.split([]) is None
    assert c.split([3]) == Split(stable=3)
    assert c.split([1, 3, 2]) == Split(stable=2, canary=3, fraction=0.25)
    assert c.split([1, 3, 2]).doc() == {"stable": 2, "canary": 3, "fraction": 0.25}


def test_without_a_fraction_everything_goes_to_the_newest_version():
    assert Canary("m").split([1, 2]) == Split(stable=2)


def test_promotion_makes_the_canary_stable_for_the_next_one():
    c = canary()
    d = c.decide("promote", c.split([1, 2]), "manual", "by hand")
    assert (d.action, d.version, d.stable, d.trigger) == ("promote", 2, 1, "manual")
    assert c.promoted == 2 and c.split([1, 2]) == Split(stable=2)
    # The promoted version stays stable under a newer canary, even with another version between.
    assert c.split([1, 2, 3, 4]) == Split(stable=2, canary=4, fraction=0.25)
    assert c.split([1, 3, 4]) == Split(stable=3, canary=4, fraction=0.25)  # promoted 2 gone: the next below


def test_rollback_sends_everything_to_the_stable_version_until_the_canary_is_loaded_again():
    c = canary()
    c.decide("rollback", c.split([1, 2]), "manual", "by hand")
    assert c.rejected == {2} and c.promoted == 1
    assert c.split([1, 2]) == Split(stable=1)
    assert c.split([2]) is None  # a rolled-back version alone is not served unversioned
    c.forget_version(2)
    assert c.split([1, 2]) == Split(stable=1, canary=2, fraction=0.25)
    assert c.counts[(2, "rollback", "manual")] == 1
    status = c.status(c.split([1, 2]))
    assert status["rolled_back"] == [] and status["promoted"] == 1
    assert status["decisions"][0]["action"] == "rollback" and status["split"]["canary"] == 2


# -- automatic rollback -------------------------------------------------------------------------


class Versions:
    """Both versions' cumulative counters, as the broker hands them to ``observe``."""

    def __init__(self) -> None:
        self.totals = {1: ("v1", VersionTotals()), 2: ("v2", VersionTotals())}

    def serve(self, version: int, ok: int = 0, failed: int = 0, ns: int = MS) -> None:
        st = self.totals[version][1]
        for _ in range(ok):
            st.succeed(ns)
        st.fail("BACKEND", failed)


SPLIT = Split(stable=1, canary=2, fraction=0.25)


def test_a_canary_failing_more_than_the_margin_is_rolled_back():
    c, v = canary(min_requests=10, error_margin=0.05), Versions()
    v.serve(1, ok=500, failed=500)  # before the first snapshot: not in any window
    assert c.observe(1.0, SPLIT, v.totals) is None
    v.serve(1, ok=40, failed=1)
    v.serve(2, ok=8, failed=4)
    d = c.observe(1.5, SPLIT, v.totals)
    assert d is not None and (d.action, d.trigger, d.version, d.stable) == ("rollback", "error_rate", 2, 1)
    assert "error rate 0.333 over 12 requests" in d.detail
    assert c.rejected == {2} and c.split([1, 2]) == Split(stable=1)


def test_errors_within_the_margin_or_too_few_requests_decide_nothing():
    c, v = canary(min_requests=10, error_margin=0.05), Versions()
    c.observe(1.0, SPLIT, v.totals)
    v.serve(1, ok=90, failed=10)  # stable: 10 %
    v.serve(2, ok=86, failed=14)  # canary: 14 %, within 10 % + 5 %
    assert c.observe(1.5, SPLIT, v.totals) is None
    c2, v2 = canary(min_requests=10), Versions()
    c2.observe(1.0, SPLIT, v2.totals)
    v2.serve(2, failed=9)  # all failed, but fewer than min_requests
    assert c2.observe(1.5, SPLIT, v2.totals) is None and not c2.decisions


def test_snapshots_are_taken_at_most_every_half_second():
    c, v = canary(min_requests=10), Versions()
    c.observe(1.0, SPLIT, v.totals)
    v.serve(2, failed=20)
    assert c.observe(1.4, SPLIT, v.totals) is None  # too soon: not even looked at
    assert c.observe(1.5, SPLIT, v.totals) is not None


def test_only_the_last_window_counts():
    def run(window_s: float):
        c, v = canary(min_requests=10, window_s=window_s), Versions()
        c.observe(0.5, SPLIT, v.totals)
        v.serve(2, failed=6)
        c.observe(1.0, SPLIT, v.totals)
        v.serve(2, failed=6)
        return c.observe(2.0, SPLIT, v.totals)  # 12 failures since 0.5, but only 6 since 1.0

    assert run(window_s=1.0) is None
    assert run(window_s=10.0) is not None


def test_a_version_reloaded_within_the_window_waits_for_a_clean_window():
    c, v = canary(min_requests=10), Versions()
    c.observe(1.0, SPLIT, v.totals)
    v.totals[2] = ("v2-reloaded", VersionTotals())
    v.serve(2, failed=50)
    assert c.observe(1.5, SPLIT, v.totals) is None


def test_a_slower_canary_is_rolled_back_on_p99_with_enough_samples():
    c, v = canary(min_requests=10, p99_margin=0.5, p99_min_delta_ms=1.0), Versions()
    c.observe(1.0, SPLIT, v.totals)
    v.serve(1, ok=P99_MIN_SAMPLES, ns=1 * MS)
    v.serve(2, ok=P99_MIN_SAMPLES, ns=10 * MS)
    d = c.observe(1.5, SPLIT, v.totals)
    assert d is not None and d.trigger == "p99_latency" and "p99" in d.detail


@pytest.mark.parametrize("stable_ns, canary_ns, samples", [
    (1 * MS, 12 * MS // 10, P99_MIN_SAMPLES),  # 20 % slower: within the 50 % margin
    (100_000, 800_000, P99_MIN_SAMPLES),  # 8 times slower, but by less than 1 ms
    (1 * MS, 10 * MS, P99_MIN_SAMPLES - 1),  # too few samples for a p99
])
def test_p99_within_its_margins_or_with_too_few_samples_decides_nothing(stable_ns, canary_ns, samples):
    c, v = canary(min_requests=10, p99_margin=0.5, p99_min_delta_ms=1.0), Versions()
    c.observe(1.0, SPLIT, v.totals)
    v.serve(1, ok=samples, ns=stable_ns)
    v.serve(2, ok=samples, ns=canary_ns)
    assert c.observe(1.5, SPLIT, v.totals) is None


def test_no_canary_no_observation():
    c, v = canary(), Versions()
    assert c.observe(1.0, Split(stable=1), v.totals) is None
