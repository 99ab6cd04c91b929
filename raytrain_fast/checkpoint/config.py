from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class CheckpointConfig:
    """When checkpoints are written and how many are kept."""

    every_steps: int = 100
    """Save every this many optimizer steps (and always at the end)."""
    keep_last: int = 3
    """Checkpoints kept in storage; older ones are deleted (the latest is never deleted)."""
