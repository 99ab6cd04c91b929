"""One training worker's place in the run: its config, rank, group size and hooks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from raytrain_fast.config import Config
from raytrain_fast.loop.hooks import RankHooks


@dataclass(kw_only=True)
class Worker:
    """What every setup step of one worker needs: its config, place in the group and hooks."""

    config: Config
    rank: int
    world_size: int
    grad_accum: int
    device: torch.device
    hooks: RankHooks
    niceness: int
    """This worker's niceness after setup (0 unless lowering it was not permitted)."""
    manifest: Any
    """The prepared data's manifest (training shards and the validation split)."""

    @property
    def tokens_per_step(self) -> int:
        train = self.config.train
        return train.micro_batch * self.grad_accum * self.world_size * self.config.data.seq_len

    @property
    def run_uri(self) -> str:
        return f"{self.config.storage.uri.rstrip('/')}/{self.config.name}"
