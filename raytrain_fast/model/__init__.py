"""The GPT model and its FLOPs formula."""

from raytrain_fast.model.config import ModelConfig
from raytrain_fast.model.gpt import GPT, flops_per_token

__all__ = ["GPT", "ModelConfig", "flops_per_token"]
