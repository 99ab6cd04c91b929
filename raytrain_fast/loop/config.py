from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    the global batch stays. The choice is cached in storage (`_autobatch/`), so reruns skip the search."""
    grad_accum: int | None = None
    """Micro-batches accumulated per optimizer step; null = derived from the other two."""
    seed: int = 0
    """Seed of model init and dropout."""
    log_every: int = 10
    """Read the loss back to the host, print progress, every this many steps (the only host sync)."""
