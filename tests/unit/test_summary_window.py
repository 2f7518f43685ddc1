"""The latency summaries' window: quantiles forget what is older than a minute, as Triton's do."""
from __future__ import annotations

import numpy as np
import pytest

from shmserve.server.broker.summary_window import MAX_AGE_S, SummaryWindow, summary_quantiles

KEY = ("m", 1, 1.0)  # (model, version, generation)


def hist(*counts: int) -> np.ndarray:
    return np.array([list(counts)], dtype=np.uint64)


def test_the_first_scrape_sees_everything_and_later_ones_only_the_last_minute():
    window = SummaryWindow()
    assert window.recent({KEY: hist(5, 0)}, 0.0)[KEY].tolist() == [[5, 0]]
    assert window.recent({KEY: hist(5, 2)}, 30.0)[KEY].tolist() == [[5, 2]]  # nothing a minute old yet
    # at 61 s the snapshot of 0 s is the base: the 5 fast ones aged out, the 2 slow ones stay
    assert window.recent({KEY: hist(5, 2)}, 61.0)[KEY].tolist() == [[0, 2]]
    # at 95 s the snapshot of 30 s is the base: nothing new since, an empty window (NaN quantiles)
    assert window.recent({KEY: hist(5, 2)}, 95.0)[KEY].tolist() == [[0, 0]]
    assert window.recent({KEY: hist(5, 3)}, 95.0 + MAX_AGE_S)[KEY].tolist() == [[0, 1]]


def test_a_reloaded_version_counts_afresh():
    """A version loaded again is a new generation: its counts are its own, even where they pass
    the old generation's in every bucket; counts that went down (a worker replaced) are taken as
    they are."""
    window = SummaryWindow()
    window.recent({KEY: hist(2, 2)}, 0.0)
    reloaded = ("m", 1, 2.0)
    assert window.recent({reloaded: hist(5, 5)}, 70.0)[reloaded].tolist() == [[5, 5]]
    window.recent({KEY: hist(9, 9)}, 100.0)
    assert window.recent({KEY: hist(1, 0)}, 170.0)[KEY].tolist() == [[1, 0]]


@pytest.mark.parametrize("text, quantiles", [("", ()), ("0.5:0.05", (0.5,)), ("0.5:0.05, 0.99:0.001", (0.5, 0.99))])
def test_summary_quantiles_reads_tritons_pairs(text, quantiles):
    assert summary_quantiles(text) == quantiles


@pytest.mark.parametrize("text", ["0.5", "x:0.1", "1.5:0.01", "0.5:y"])
def test_summary_quantiles_refuses_what_is_not_a_pair(text):
    with pytest.raises(ValueError, match="is not QUANTILE:ERROR"):
        summary_quantiles(text)
