"""The live line on stderr: one bar over the planned windows of the run, its text the last
window's figures. ``-q`` (or ``Quiet``) says nothing; the analyzer nests it under its own bar."""
from __future__ import annotations

import sys
from typing import Any

from shmserve.tools.perf.windows import Figures


class Quiet:
    """Progress that says nothing (``-q``)."""

    def window(self, target: str, level: float, trial: int, fig: Figures) -> None:
        pass

    def level_done(self, windows: int) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


class Bar(Quiet):
    """A tqdm bar over the windows the run may take (``levels`` x ``max_trials``), shortened as
    each level ends early; at ``position`` (0: the top line)."""

    def __init__(self, levels: int, max_trials: int, unit_name: str, position: int = 0) -> None:
        from tqdm import tqdm

        self.unit_name, self.max_trials = unit_name, max_trials
        self.bar: Any = tqdm(total=levels * max_trials, unit="window", position=position, leave=position == 0,
                             file=sys.stderr, dynamic_ncols=True)

    def window(self, target: str, level: float, trial: int, fig: Figures) -> None:
        self.bar.set_description_str(f"{target} {self.unit_name} {level:g} window {trial}: "
                                     f"{fig.throughput:,.1f} infer/s, p50 {fig.p50_us:,.0f} us", refresh=False)
        self.bar.update(1)

    def level_done(self, windows: int) -> None:
        self.bar.total -= self.max_trials - windows
        self.bar.refresh()

    def note(self, text: str) -> None:
        self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()
