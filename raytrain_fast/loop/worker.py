"""One training worker: what the driver hands it (`LoopInputs`) and its place in the run (`Worker`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain_fast.config import Config
from raytrain_fast.loop.hooks import LoopHooks, RankHooks, WindowCallback

if TYPE_CHECKING:
    import torch

    from raytrain_fast.data.manifest import Manifest


@dataclass(frozen=True, kw_only=True)
class LoopInputs:
    """What the driver hands every training worker (launch/trainer.py `build_trainer`); it pickles,
    and so does everything in it."""

    config: Config
    """The run's config, resolved on the driver (resources, precision, micro-batch)."""
    data_uri: str
    """The prepared data's manifest: its tokenizer and validation split (a mixture's first source)."""
    data_uris: list[str]
    """A mixture's prepared sources (data.sources), in order; else [data_uri]."""
    max_sequences: int | None = None
    """Sequences of the data to read at most (None: all)."""
    hooks: LoopHooks = field(default_factory=LoopHooks)
    """Drills, fault injection, the sequence recorder, a bench's clock; none by default."""
    on_window: WindowCallback | None = None
    """Called on every log step with the window's metrics (a sweep trial's Tune report)."""
    save_checkpoints: bool = True
    """False: a short measurement run that saves nothing."""
    tasks: Any = None
    """eval.tasks, encoded on the driver for the data's tokenizer (downstream/in_loop.py `RunTasks`,
    which the loop does not import: `raytrain-fast evaluate` reads the report, which reads the loop), or None."""
    s3_filesystem: Any = None
    """The driver's S3 filesystem (credentials inside) for s3:// storage: workers read the data and
    write the metrics with it, whatever their own environment holds."""


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
    manifest: Manifest
    """The prepared data's manifest (training shards and the validation split)."""

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step across the group."""
        return int(self.config.train.micro_batch) * self.grad_accum * self.world_size

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.config.data.seq_len

    @property
    def run_uri(self) -> str:
        return f"{self.config.storage.uri.rstrip('/')}/{self.config.name}"
