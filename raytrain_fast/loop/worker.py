"""One training worker: what the driver hands it (`LoopInputs`) and its place in the run (`Worker`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raytrain_fast.config import Config
from raytrain_fast.config.train import Batch
from raytrain_fast.loop.hooks import LoopHooks, RankHooks, WindowCallback
from raytrain_fast.plan import RunPlan

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, kw_only=True)
class LoopInputs:
    """What the driver hands every training worker (launch/trainer.py `build_trainer`); it pickles,
    and so does everything in it."""

    plan: RunPlan
    """The run's plan (raytrain_fast/plan.py): every derived setting, the data's manifests, the storage."""
    hooks: LoopHooks = field(default_factory=LoopHooks)
    """Drills, fault injection, the sequence recorder, a bench's clock; none by default."""
    on_window: WindowCallback | None = None
    """Called on every log step with the window's metrics (a sweep trial's Tune report)."""
    save_checkpoints: bool = True
    """False: a short measurement run that saves nothing."""


@dataclass(kw_only=True)
class Worker:
    """What every setup step of one worker needs: the plan, its place in the group and hooks."""

    plan: RunPlan
    rank: int
    batch: Batch
    """This group's batch split (the plan's for its size)."""
    device: torch.device
    hooks: RankHooks
    niceness: int
    """This worker's niceness after setup (0 unless lowering it was not permitted)."""

    @property
    def config(self) -> Config:
        return self.plan.config

    @property
    def world_size(self) -> int:
        return self.batch.world_size

    @property
    def grad_accum(self) -> int:
        return self.batch.grad_accum

    @property
    def tokens_per_step(self) -> int:
        return self.batch.global_batch * self.config.data.seq_len
