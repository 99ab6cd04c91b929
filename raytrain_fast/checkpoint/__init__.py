"""Checkpoints: every rank's DeepSpeed state plus the loop's own state, saved through Ray Train,
verified by per-rank manifests, listed and exported."""

from raytrain_fast.checkpoint.checkpointing import Checkpointer
from raytrain_fast.checkpoint.download import find_resumable_checkpoint
from raytrain_fast.checkpoint.rank_manifest import write_rank_manifest
from raytrain_fast.checkpoint.runs import list_runs
from raytrain_fast.checkpoint.state import TrainState
from raytrain_fast.config.checkpoint import CheckpointConfig
