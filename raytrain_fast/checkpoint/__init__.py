"""Checkpoints: every rank's DeepSpeed state plus the loop's own state, saved through Ray Train,
verified by per-rank manifests, listed and exported."""

from raytrain_fast.checkpoint.checkpointing import Checkpointer
from raytrain_fast.checkpoint.download import find_resumable_checkpoint
from raytrain_fast.checkpoint.export import export_checkpoint, load_exported
from raytrain_fast.checkpoint.rank_manifest import write_rank_manifest
from raytrain_fast.checkpoint.runs import format_runs_table, list_runs
from raytrain_fast.checkpoint.state import TrainState
from raytrain_fast.config.checkpoint import CheckpointConfig

__all__ = [
    "CheckpointConfig",
    "Checkpointer",
    "TrainState",
    "export_checkpoint",
    "find_resumable_checkpoint",
    "format_runs_table",
    "list_runs",
    "load_exported",
    "write_rank_manifest",
]
