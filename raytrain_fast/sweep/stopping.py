"""Which sweep trials stop early: only those clearly behind, never for a gap inside timing noise.

ASHA compares one window's value at a rung and stops anything in the worse half: on a shared 2-core
machine it stopped a trial at its second window for being 6% slower, while windows of one trial
there differ by about 10%. This scheduler compares what the results table compares (the median of a
trial's windows after the first, warm-up, one) and stops a trial only when, after a grace period of
half its windows, that median is more than NOISE_MARGIN behind the best earlier trial's at the same
window.
"""

from __future__ import annotations

import statistics
from typing import Any, Literal

from ray.tune.schedulers import FIFOScheduler, TrialScheduler

NOISE_MARGIN = 0.10
"""How far behind (relative) a trial must be to stop: above the ~10% window-to-window spread
measured on a busy 2-core machine; a real micro-batch difference is usually larger."""


def grace_windows(num_windows: int) -> int:
    """Windows a trial always runs: half of them (at least 2: the first is warm-up, left out)."""
    return max(2, num_windows // 2)


class NoiseAwareStopper(FIFOScheduler):
    """Tune scheduler: stop a trial whose median objective over its windows after the first is more
    than `margin` behind the best trial's at the same window, once it has run `grace` windows."""

    def __init__(self, *, metric: str, mode: Literal["max", "min"], grace: int) -> None:
        super().__init__()
        self._objective, self._direction, self.grace, self.margin = metric, mode, grace, NOISE_MARGIN
        self._windows: dict[str, list[float]] = {}
        self._best: dict[int, float] = {}
        """Best score seen at each window (training_iteration) over all trials so far."""

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        value, window = result.get(self._objective), result.get("training_iteration")
        if value is None or window is None or value != value:  # NaN: no value this window
            return TrialScheduler.CONTINUE
        windows = self._windows.setdefault(trial.trial_id, [])
        windows.append(float(value))
        if window < self.grace:
            return TrialScheduler.CONTINUE
        score = statistics.median(windows[1:])  # the first window is warm-up, as in the results table
        best, higher = self._best.get(window), self._direction == "max"
        if best is None or (score > best if higher else score < best):
            self._best[window] = score
            return TrialScheduler.CONTINUE
        behind = score < best * (1 - self.margin) if higher else score > best * (1 + self.margin)
        return TrialScheduler.STOP if behind else TrialScheduler.CONTINUE

    def debug_string(self) -> str:
        return f"NoiseAwareStopper: grace {self.grace} windows, margin {self.margin:.0%}"
