"""Histogram bounds in the ``le`` label as Triton's prometheus-cpp writes them (``std::to_chars``):
Prometheus keys a series on the label's text, so ``le="1.0"`` or ``le="100000"`` would be other
series than the ones a dashboard written for Triton asks for."""
from __future__ import annotations

import math

import pytest

from shmserve.shm.latency_histograms import format_le


@pytest.mark.parametrize("bound, text", [
    (1.0, "1"), (2.5, "2.5"), (0.1, "0.1"), (0.001, "0.001"), (100.0, "100"), (10000.0, "10000"),
    (100000.0, "1e+05"), (0.0001, "1e-04"), (123456.5, "123456.5"), (1e15, "1e+15"), (math.inf, "+Inf")])
def test_bounds_are_written_as_std_to_chars_writes_them(bound, text):
    assert format_le(bound) == text
