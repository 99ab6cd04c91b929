"""The per-worker training loop (`raytrain_fast.loop.train_loop`)."""

from raytrain_fast.config.train import TrainConfig

__all__ = ["TrainConfig"]
