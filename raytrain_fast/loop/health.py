"""Divergence: what the step loop does when a window's loss or gradient norm is non-finite, spikes or
climbs (loop/divergence.py): roll back (loop/rollback.py), stop or warn, as `health.*` says.

Detection costs no host sync of its own: every step adds its loss and gradient norm into the metrics'
on-device sums, which the log step's drain all-reduces and reads once; every rank then runs the same
decision on the same numbers, so the ranks agree without another collective. The whole policy, as
users read it: docs/health.md.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

from raytrain_fast.config.train import HealthConfig
from raytrain_fast.loop.divergence import DivergenceCheck

logger = logging.getLogger("raytrain_fast.health")
RECORD_FILE = "health.json"
"""The run's rollbacks (`<run>/health.json`), beside its checkpoints: what a resume must skip again."""
_SPIKE_MIN_WINDOWS = 5
_SPIKE_MIN_RISE = 0.5  # and at least 50% above the median: a MAD near zero alone is no spike
_WARN_ADVICE = {
    "on_divergence": "Lower optim.lr or lengthen optim.warmup_steps; checkpoint.keep_best keeps the checkpoint with "
    "the lowest loss (health.on_divergence: stop ends such a run).",
}


class _WindowVerdict(Exception):
    """What the health check decided on a window, raised on every rank at the same log step."""

    def __init__(self, message: str, *, step: int, what: str, loss: float, grad_norm: float,
                 setting: str = "on_nonfinite", policy: str = "stop") -> None:
        super().__init__(message)
        self.step, self.what, self.loss, self.grad_norm = step, what, loss, grad_norm
        self.setting, self.policy = setting, policy
        """The health.* setting that decided (on_nonfinite, on_spike, on_divergence) and its value."""


class Rollback(_WindowVerdict):
    """Go back to the newest healthy checkpoint."""


class DivergenceStop(_WindowVerdict):
    """The run stops (the message says why and what to change)."""

    def record(self) -> dict[str, Any]:
        """What `<run>/health.json` keeps of the stop (the report's divergence finding)."""
        return {"step": self.step, "what": self.what, "loss": self.loss, "grad_norm": self.grad_norm,
                "setting": f"health.{self.setting}", "policy": self.policy}


@dataclass
class SpikeCheck:
    """median + k x MAD over the last windows of one value (the loss or the gradient norm)."""

    mads: float
    windows: int

    def __post_init__(self) -> None:
        self.history: deque[float] = deque(maxlen=self.windows)

    def is_spike(self, value: float) -> bool:
        spike = False
        if len(self.history) >= _SPIKE_MIN_WINDOWS and math.isfinite(value):
            median = statistics.median(self.history)
            mad = statistics.median(abs(v - median) for v in self.history)
            spike = value > median + self.mads * mad and value > median * (1 + _SPIKE_MIN_RISE)
        if not spike and math.isfinite(value):  # a spike stays out of the level it is compared with
            self.history.append(value)
        return spike


class HealthMonitor:
    """One per worker; the same decisions on every rank (they read the same all-reduced values)."""

    def __init__(
        self, config: HealthConfig, *, rank: int, warmup_steps: int, rollbacks: list[dict[str, Any]],
        vocab_size: int | None = None, start_step: int = 0,
    ) -> None:
        self.config, self.rank, self.warmup_steps = config, rank, warmup_steps
        self.rollbacks = list(rollbacks)
        """The run's rollbacks so far (from health.json / the restored state)."""
        self.window_finite = True
        """Whether the last drained window was finite (what a save on a log step checks)."""
        self.last: dict[str, float] = {}
        self._loss = SpikeCheck(config.spike_mads, config.spike_windows)
        self._grad = SpikeCheck(config.spike_mads, config.spike_windows)
        self.divergence = None if vocab_size is None or config.on_divergence == "off" else DivergenceCheck.for_vocabulary(
            vocab_size, warmup_steps=warmup_steps, windows=config.divergence_windows, climb=config.divergence_climb,
            start_step=start_step,
        )
        """The finite-divergence check (loop/divergence.py); None when off."""

    def check_window(self, step: int, values: dict[str, float], metrics: Any) -> None:
        """After a drain: decide on its loss and grad norm (`values`, the same on every rank).
        Raises `Rollback` / `DivergenceStop`, or warns; a health/* record goes to the sinks."""
        loss, grad = values.get("train/loss", 0.0), values.get("train/grad_norm", 0.0)
        self.window_finite = math.isfinite(loss) and math.isfinite(grad)
        self.last = {"loss": loss, "grad_norm": grad}
        if not self.window_finite:
            metrics.emit(step, {"health/nonfinite": 1.0})
            metrics.mark_health("non-finite window", step)
            self._act("on_nonfinite", step=step, what="a non-finite loss or gradient norm", loss=loss, grad=grad)
            return
        found = self.divergence.observe(step, loss) if self.divergence is not None else None
        if found is not None:  # a finite divergence (loop/divergence.py), once per episode
            metrics.emit(step, found.record())
            metrics.mark_health("divergence", step)
            self._act("on_divergence", step=step, what=f"a finite divergence: {found.describe()}", loss=loss, grad=grad)
        if self.config.on_spike == "off" or step <= self.warmup_steps:
            return
        spiked = [name for name, check, value in (("loss", self._loss, loss), ("gradient norm", self._grad, grad))
                  if check.is_spike(value)]
        if spiked:
            metrics.emit(step, {"health/spike": 1.0, "health/spike_loss": loss, "health/spike_grad_norm": grad})
            metrics.mark_health("spike", step)
            what = f"a {' and '.join(spiked)} spike (median + {self.config.spike_mads:g} x MAD of the last windows)"
            self._act("on_spike", step=step, what=what, loss=loss, grad=grad)

    def restart_at(self, step: int) -> None:
        """A rollback went back to the checkpoint at `step`: the divergence episode ends there."""
        if self.divergence is not None:
            self.divergence.restart(step)

    def _act(self, setting: str, *, step: int, what: str, loss: float, grad: float) -> None:
        policy = getattr(self.config, setting)
        if policy == "warn":
            if self.rank == 0:
                numbers = "" if setting == "on_divergence" else f" (loss {loss:.4g}, grad norm {grad:.4g})"
                logger.warning("Step %d: %s%s; going on (health.%s: warn). %s", step, what, numbers, setting,
                               _WARN_ADVICE.get(setting, ""))
            return
        if policy == "rollback" and len(self.rollbacks) < self.config.max_rollbacks:
            raise Rollback(f"{what} at step {step}", step=step, what=what, loss=loss, grad_norm=grad, setting=setting,
                           policy=policy)
        raise DivergenceStop(self.stop_message(step=step, what=what, loss=loss, grad=grad, setting=setting),
                             step=step, what=what, loss=loss, grad_norm=grad, setting=setting, policy=policy)

    def may_save(self, step: int, metrics: Any, *, logged: bool) -> bool:
        """Whether the state may be saved now: every step since the last log step was finite. On a
        log step the drain told (no read); otherwise one collective and one host read (saves are rare)."""
        if self.config.on_divergence == "rollback" and self.divergence is not None and self.divergence.suspect:
            if self.rank == 0:  # a rollback must never land on a checkpoint of the climb it rolls back from
                logger.warning("Step %d: not saving a checkpoint: the loss is above the divergence bound "
                               "(health.on_divergence: rollback).", step)
            return False
        healthy = self.window_finite if logged else metrics.window_finite()
        if not healthy and self.rank == 0:
            logger.warning("Step %d: not saving a checkpoint: a step since the last log step was not finite.", step)
        return healthy

    def stop_message(self, *, step: int, what: str, loss: float, grad: float, setting: str, no_checkpoint: bool = False) -> str:
        """Why the run stops, what was tried (`no_checkpoint`: a rollback found nothing to go back to) and what to change."""
        policy = getattr(self.config, setting)
        tried = "; ".join(
            f"rolled back from step {r['detected_step']} to {r['to_step']} and skipped {r['skip_sequences']:,} sequences"
            for r in self.rollbacks
        )
        if no_checkpoint:
            tried = (tried + "; then " if tried else "") + "no rollback: no checkpoint was saved before it"
        elif not tried:
            tried = f"nothing (health.{setting}: {policy})" if policy != "rollback" else \
                f"nothing (health.max_rollbacks={self.config.max_rollbacks})"
        kept = ("The update of a non-finite step never reached the weights, and every checkpoint saved is healthy"
                if setting != "on_divergence" else "Every checkpoint saved holds finite weights, and checkpoint.keep_best keeps "
                "the one with the lowest loss")
        return (
            f"Training diverged: {what} in the window ending at step {step} (loss {loss:.4g}, grad norm {grad:.4g}). "
            f"Tried: {tried}. {kept}: the newest one is what a rerun resumes from. To change: lower optim.lr, "
            "lengthen optim.warmup_steps, tighten optim.grad_clip, or skip the data window (a rerun after a rollback "
            f"skips it again); health.max_rollbacks={self.config.max_rollbacks} allows more tries."
        )

    def state_record(self) -> dict[str, Any]:
        """What a checkpoint saved now records (TrainState.health)."""
        return {"finite": self.window_finite, **self.last, "rollbacks": self.rollbacks}


def read_health(filesystem: Any, run_path: str) -> dict[str, Any]:
    """`<run>/health.json`: {"rollbacks": [...], "stopped": {...} when the run stopped on a divergence}
    ({} when there is none)."""
    try:
        with filesystem.open_input_stream(f"{run_path.rstrip('/')}/{RECORD_FILE}") as stream:
            return dict(json.loads(stream.read()))
    except (FileNotFoundError, OSError, ValueError):
        return {}


def write_records(filesystem: Any, run_path: str, rollbacks: list[dict[str, Any]], *, stopped: dict[str, Any] | None = None) -> None:
    record: dict[str, Any] = {"rollbacks": rollbacks, **({"stopped": stopped} if stopped else {})}
    with filesystem.open_output_stream(f"{run_path.rstrip('/')}/{RECORD_FILE}") as stream:
        stream.write(json.dumps(record, indent=2).encode())


def skip_position(rollbacks: list[dict[str, Any]], *, step: int, position: dict[str, Any] | None) -> dict[str, Any] | None:
    """The data position to resume at from a checkpoint at `step` whose saved position is
    `position`: past the skip a rollback to that checkpoint recorded (the newest such), else `position`."""
    for record in reversed(rollbacks):
        if record["to_step"] == step and record["position"] == position:
            return record["resume_position"]
    return position
