"""Finite divergence: a loss that stays finite while training comes apart.

Clipping can keep a blown-up run finite all the way (a learning rate far too high for its warm-up:
the loss climbs from 6.9 to 190 and never reaches NaN), so the non-finite check never fires. Two
signs name it, both judged on the log windows' loss the drain already read (no host sync of its own):

- **Worse than a uniform guess.** A loss above ln(vocabulary size), what a model that puts the same
  probability on every token scores (by more than UNIFORM_MARGIN: a model that has learned nothing
  yet sits at about that loss, a little above it from its initial weights), and no lower than the
  best window before it (a loss still falling from a poor start is learning), in two windows in a row
  (one alone is a spike's: the spike check names it) that start after warm-up, not in a fresh run's
  first window. During warm-up too, once a window reaches FAR_ABOVE_UNIFORM times that loss: no
  learning-rate schedule makes such a loss healthy, and blow-ups happen most often while the rate is
  still rising (real warm-ups are thousands of steps).
- **A sustained climb.** A loss more than `climb` of the way back from the run's best window to that
  uniform-guess loss, for `windows` log windows in a row: the run lost that share of what it learned.

An episode starts when either holds and ends after `windows` windows in a row below the climb bound;
each episode is reported once. The same check runs in the loop (loop/health.py, every rank on the
same all-reduced numbers) and in the report over a run's recorded losses (report/findings/finite_divergence.py).

The judgement starts over with each worker process (a resume, possibly with another learning rate
or other data, sets a new best): the check compares a run with its own recent progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

UNIFORM_MARGIN = 0.05
"""How far (relative) above ln(vocabulary size) a window loss must be to be worse than a uniform guess."""
UNIFORM_WINDOWS = 2
"""Windows in a row above it that make a divergence (at most health.divergence_windows)."""
FAR_ABOVE_UNIFORM = 2.0
"""A window loss this many times the uniform-guess loss starts windows in a row that count in warm-up
too (and in a fresh run's first window)."""


@dataclass(frozen=True)
class Diverged:
    """The start of a divergence episode: what `DivergenceCheck.observe` returns once per episode."""

    step: int
    """The log step whose window made it a divergence."""
    loss: float
    best: float
    """The lowest window loss the check had seen (math.inf when none)."""
    best_step: int
    uniform: float
    """ln(vocabulary size): the loss of a uniform guess."""
    bound: float
    """The climb bound at that step: best + climb x (uniform - best)."""
    since: int
    """The first log step of the windows in a row above the climb bound that led to it."""
    kind: str
    """uniform (above the uniform-guess loss) or climb (a sustained climb above the bound)."""

    def describe(self) -> str:
        best = f"the run's best window: {self.best:.4g} at step {self.best_step}" if math.isfinite(self.best) else "no better window before it"
        if self.kind == "uniform":
            return (f"loss {self.loss:.4g}, above the {self.uniform:.4g} that a uniform guess over the vocabulary scores "
                    f"(ln of model.vocab_size) ({best})")
        return f"loss {self.loss:.4g}, above {self.bound:.4g} since step {self.since} ({best}; a uniform guess: {self.uniform:.4g})"

    def record(self) -> dict[str, float]:
        """The health/divergence* metrics of the episode's first step."""
        return {"health/divergence": 1.0, "health/divergence_loss": self.loss, "health/divergence_best": self.best,
                "health/divergence_bound": self.bound, "health/divergence_since": float(self.since)}


@dataclass
class DivergenceCheck:
    """Window by window: whether the loss has diverged (see the module docstring)."""

    uniform: float
    """ln(vocabulary size)."""
    warmup_steps: int
    windows: int = 3
    climb: float = 0.5
    start_step: int = 0
    """The step this process started at (0 for a fresh run): its first window starts there."""

    def __post_init__(self) -> None:
        self.best, self.best_step = math.inf, 0
        self.previous_step = self.start_step
        self.above_since: int | None = None
        self.above, self.below, self.over_uniform, self.blown = 0, 0, 0, 0
        self.in_episode = False

    @classmethod
    def for_vocabulary(cls, vocab_size: int, **settings) -> DivergenceCheck:
        return cls(uniform=math.log(max(2, vocab_size)), **settings)

    def bound(self) -> float:
        """The climb bound: `climb` of the way from the best window back to the uniform-guess loss."""
        if not math.isfinite(self.best) or self.best >= self.uniform:
            return self.uniform
        return self.best + self.climb * (self.uniform - self.best)

    @property
    def suspect(self) -> bool:
        """The latest window is above the climb bound (diverging, or on the way to being called so)."""
        return self.above > 0

    def observe(self, step: int, loss: float) -> Diverged | None:
        """The window ending at `step` had mean loss `loss`. Returns the episode's start once, else None."""
        window_start, self.previous_step = self.previous_step, step
        if not math.isfinite(loss):
            return None  # the non-finite check's
        judged = window_start >= self.warmup_steps and window_start > 0
        bound = self.bound()
        over_uniform = loss > self.uniform * (1 + UNIFORM_MARGIN)
        over_bound = bound < self.uniform and loss > bound  # a climb needs a best below the uniform guess
        not_falling = loss >= self.best
        self.over_uniform = self.over_uniform + 1 if judged and over_uniform else 0
        # Windows above the uniform guess in a row since one at FAR_ABOVE_UNIFORM times it, warm-up or not.
        self.blown = self.blown + 1 if over_uniform and (self.blown or loss > FAR_ABOVE_UNIFORM * self.uniform) else 0
        if (judged and (over_bound or over_uniform)) or self.blown:
            self.above += 1
            self.above_since = self.above_since if self.above_since is not None else step
            self.below = 0
        else:
            self.above, self.above_since = 0, None
            self.below += 1
            if self.in_episode and self.below >= self.windows:
                self.in_episode = False
        if loss < self.best and not self.in_episode:
            self.best, self.best_step = loss, step
        uniform_breach = max(self.over_uniform, self.blown) >= min(UNIFORM_WINDOWS, self.windows) and not_falling
        if self.in_episode or not (uniform_breach or (over_bound and self.above >= self.windows)):
            return None
        self.in_episode = True
        return Diverged(step=step, loss=loss, best=self.best, best_step=self.best_step, uniform=self.uniform, bound=bound,
                        since=self.above_since or step, kind="uniform" if uniform_breach else "climb")

    def restart(self, step: int) -> None:
        """A rollback went back to `step`: the episode ends there, the best so far stays."""
        self.previous_step, self.above, self.above_since, self.below, self.in_episode = step, 0, None, 0, False
        self.over_uniform = self.blown = 0
