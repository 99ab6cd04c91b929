"""Checkpoints: every rank's DeepSpeed state plus the loop's own state, saved through Ray Train."""

from raytrain_fast.checkpoint.checkpointing import TrainState, checkpoint_dir_name, restore_checkpoint, save_checkpoint
from raytrain_fast.checkpoint.config import CheckpointConfig

__all__ = ["CheckpointConfig", "TrainState", "checkpoint_dir_name", "restore_checkpoint", "save_checkpoint"]
