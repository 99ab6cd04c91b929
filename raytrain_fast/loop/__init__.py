"""The per-worker training loop (`raytrain_fast.loop.train_loop`)."""

from raytrain_fast.loop.config import TrainConfig

__all__ = ["TrainConfig"]
