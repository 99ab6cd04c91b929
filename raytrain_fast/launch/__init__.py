"""Launching a run on Ray (`raytrain_fast.launch.trainer`): resources, storage, TorchTrainer."""

from raytrain_fast.config.resources import ResourcesConfig

__all__ = ["ResourcesConfig"]
