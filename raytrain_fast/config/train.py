from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class Batch:
    """The batch arithmetic of one worker group, resolved: global batch = micro_batch x grad_accum x world_size."""

    micro_batch: int
    grad_accum: int
    world_size: int

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size


@dataclass(kw_only=True)
class TrainConfig:
    """Length of the run and the batch arithmetic: global_batch = micro_batch x grad_accum x num_workers."""

    steps: int = 300
    """Optimizer steps to train in total (a resumed run continues up to this)."""
    global_batch: int = 16
    """Sequences per optimizer step across all workers."""
    micro_batch: int | Literal["auto"] = 16
    """Sequences per forward/backward on one worker. auto = before training, measure the micro-batches
    that divide global_batch / num_workers and take the fastest whose peak memory fits the budget
    (resources.memory_budget_gb; on GPUs the device memory minus 10%); grad_accum is re-derived so
    the global batch stays. When none fits and model.activation_checkpointing is none, it measures
    again with full activation checkpointing and turns it on if that fits (and says so). The choice
    is cached in storage (`_autobatch/`), so reruns skip the search."""
    grad_accum: int | None = None
    """Micro-batches accumulated per optimizer step; null = derived from the other two."""
    seed: int = 0
    """Seed of model init and dropout."""
    log_every: int = 10
    """Read the loss back to the host, print progress, every this many steps (the only host sync)."""


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out validation during training: val/loss on a fixed set of the data's validation split."""

    enabled: bool | Literal["auto"] = "auto"
    """auto: evaluate when the prepared data has a validation split (else one line says it is off);
    true: require a split (an error before any worker starts without one); false: never evaluate."""
    every_steps: int | None = None
    """Evaluate every this many optimizer steps (on the first log step at or after each multiple), at the
    last step and before every checkpoint saved on a log step; null = checkpoint.every_steps (so each
    saved checkpoint carries a fresh val/loss), or 100 when that is 0."""
    sequences: int = 64
    """Validation sequences per evaluation, across all workers: the same, evenly spread set every time,
    so values compare over the run. With enabled=auto and a smaller split, the whole split is used."""
    micro_batch: int | None = None
    """Sequences per forward pass of an evaluation on one worker; null = train.micro_batch."""
    tasks: list[str] = field(default_factory=list)
    """Multiple-choice tasks scored at every evaluation (docs/evaluation.md): standard ones (arc_easy,
    arc_challenge, boolq, csqa, hellaswag, openbookqa, piqa, socialiqa, winogrande) and paths of your
    own .jsonl files, e.g. [arc_easy, ./mytask.jsonl] (or a comma-separated string). Each rank scores
    its share of the items; eval/<task>/acc and acc_norm join the metrics. Empty = none."""
    task_limit: int | None = 100
    """Items per task, spread evenly over it (the same ones at every evaluation); null = all of them."""


@dataclass(kw_only=True)
class HealthConfig:
    """What a diverging run does (docs/health.md): non-finite losses and gradient norms, and loss spikes."""

    on_nonfinite: Literal["rollback", "stop", "warn"] = "rollback"
    """A log window with a non-finite loss or gradient norm on any rank. rollback: load the newest
    healthy checkpoint, skip the data read since it, try again (up to max_rollbacks); stop: end the
    run with an error naming the step and what to change; warn: one warning and go on (no save while
    the state is not healthy). Either way the non-finite update itself never reaches the weights."""
    max_rollbacks: int = 3
    """Rollbacks this run may make (non-finite steps and spikes together) before it stops with an error."""
    on_spike: Literal["warn", "rollback", "stop", "off"] = "warn"
    """A window whose loss or gradient norm is far above its recent level (see spike_mads). warn: a
    warning and a health/spike record; rollback or stop: as for a non-finite window; off: not checked."""
    spike_mads: float = 10.0
    """A spike is a window value above median + spike_mads x MAD of the last spike_windows windows
    (and at least 50% above that median)."""
    spike_windows: int = 20
    """Windows of recent history the spike check compares with (it starts after 5 of them, past warm-up)."""
    on_divergence: Literal["warn", "rollback", "stop", "off"] = "warn"
    """A finite divergence after warm-up: a window loss above ln(model.vocab_size), what a uniform guess
    scores, or a climb divergence_climb of the way from the run's best window back to it, held for
    divergence_windows windows. warn: one warning per episode and a health/divergence record; rollback
    or stop: as for a non-finite window (with rollback, no checkpoint is saved while the loss is above
    that bound); off: not checked."""
    divergence_windows: int = 3
    """Log windows in a row above the climb bound that make a climb a divergence (and below it that end one)."""
    divergence_climb: float = 0.5
    """The climb bound: best + divergence_climb x (ln(vocab_size) - best), best = the run's lowest window loss."""
