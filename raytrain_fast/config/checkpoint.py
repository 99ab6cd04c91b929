from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


CHANGE_GROUPS = ("data", "tokenizer", "model")
"""What checkpoint.allow_changes can name (the keys of each: launch/run_changes.py)."""


def allowed_groups(allow_changes: str) -> tuple[set[str], list[str]]:
    """checkpoint.allow_changes as a set of groups, and the problems with it (unknown names)."""
    names = {n.strip() for n in allow_changes.split(",") if n.strip() and n.strip() != "none"}
    unknown = sorted(names - set(CHANGE_GROUPS))
    problems = [
        f"checkpoint.allow_changes: unknown {', '.join(map(repr, unknown))}; use a comma-separated list of "
        f"{', '.join(CHANGE_GROUPS)} (e.g. --set checkpoint.allow_changes=data)"
    ] if unknown else []
    return names & set(CHANGE_GROUPS), problems


@dataclass(kw_only=True)
class CheckpointConfig:
    """When checkpoints are written, how they are uploaded, how many are kept, and resume policy."""

    every_steps: int = 100
    """Save every this many optimizer steps (and always at the end). 0 = only by time / at the end."""
    every_minutes: float = 0.0
    """Also save when this many minutes passed since the last save (checked on log steps). 0 = off."""
    upload: Literal["async", "sync"] = "async"
    """async: training continues while the checkpoint uploads (the next save waits for it); sync: wait."""
    write: Literal["background", "inline"] = "background"
    """background: a save copies DeepSpeed's state into host memory reserved at start (on a GPU pinned, the
    copies overlapping the next step) and a background thread writes the files, so training waits for
    neither the copy nor the disk; inline: training waits while torch.save writes them."""
    keep_last: int = 3
    """Keep the newest this many checkpoints in storage (the newest is never deleted)."""
    keep_best: int = 1
    """Also keep the best this many checkpoints by `best_metric`, however old (a run that diverged
    keeps the one from before it). 0 = off."""
    best_metric: str = "auto"
    """Metric that ranks checkpoints for keep_best (any metric the loop emits, e.g. train/loss);
    auto = val/loss when evaluation is on (eval section), else train/loss (and train/loss while no
    checkpoint has a val/loss)."""
    best_mode: Literal["min", "max"] = "min"
    """Whether lower (min) or higher (max) best_metric is better."""
    resume: Literal["auto", "must", "never"] | int = "auto"
    """auto: continue the run if it has a complete checkpoint; must: fail if it has none; never: fail if it has one;
    a step (e.g. 200): continue from that checkpoint, its later ones moved aside, kept (docs/checkpoints.md#resume-from-a-step)."""
    allow_changes: str = ""
    """A resume whose data, tokenizer or model settings differ from the checkpoint's run config is refused;
    name what may change, comma-separated: data, tokenizer, model (e.g. `--set checkpoint.allow_changes=data`,
    which also lets a mixture's weights and sources change: each source goes on where it stood)."""
    init_from: str | None = None
    """Start a NEW run from the model weights (not optimizer or step) of this checkpoint directory
    (local path or s3:// URI of a `checkpoint_<step>` dir), or of a Hugging Face directory of a Llama,
    Mistral, Qwen2 or Qwen3 model (config.json + safetensors; its config must match the model section,
    docs/models.md). Only used when the run has no checkpoint yet."""
    upload_attempts: int = 3
    """Tries per checkpoint upload before training fails with an error."""
