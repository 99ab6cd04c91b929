from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class TrainConfig:
    """Length of the run and the batch arithmetic: global_batch = micro_batch x grad_accum x num_workers."""

    steps: int = 300
    """Optimizer steps to train in total (a resumed run continues up to this)."""
    global_batch: int = 16
    """Sequences per optimizer step across all workers."""
    micro_batch: int = 16
    """Sequences per forward/backward on one worker."""
    grad_accum: int | None = None
    """Micro-batches accumulated per optimizer step; null = derived from the other two."""
    seed: int = 0
    """Seed of model init and dropout."""
    log_every: int = 10
    """Read the loss back to the host, print progress, every this many steps (the only host sync)."""
