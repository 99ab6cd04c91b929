from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class CheckpointConfig:
    """When checkpoints are written, how they are uploaded, how many are kept, and resume policy."""

    every_steps: int = 100
    """Save every this many optimizer steps (and always at the end). 0 = only by time / at the end."""
    every_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (checked on log steps). 0 = off."""
    upload: Literal["async", "sync"] = "async"
    """async: training continues while the checkpoint uploads (the next save waits for it); sync: wait."""
    keep_last: int = 3
    """Keep the newest this many checkpoints in storage (the newest is never deleted)."""
    keep_best: int = 0
    """Also keep the best this many checkpoints by `best_metric`. 0 = off."""
    best_metric: str = "auto"
    """Metric that ranks checkpoints for keep_best (any metric the loop emits, e.g. train/loss);
    auto = val/loss when evaluation is on (eval section), else train/loss."""
    best_mode: Literal["min", "max"] = "min"
    """Whether lower (min) or higher (max) best_metric is better."""
    resume: Literal["auto", "must", "never"] = "auto"
    """auto: continue the run if it has a complete checkpoint; must: fail if it has none; never: fail if it has one."""
    init_from: str | None = None
    """Start a NEW run from the model weights (not optimizer or step) of this checkpoint directory
    (local path or s3:// URI of a `checkpoint_<step>` dir), or of a Hugging Face Llama-family directory
    (config.json + safetensors; its config must match the model section). Only used when the run has no checkpoint yet."""
    upload_attempts: int = 3
    """Tries per checkpoint upload before training fails with an error."""
