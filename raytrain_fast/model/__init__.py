"""The GPT model and its FLOPs formula."""

from raytrain_fast.model.config import ModelConfig
from raytrain_fast.model.gpt import GPT, build_model, flops_per_token
from raytrain_fast.model.loss import chunked_cross_entropy

__all__ = ["GPT", "ModelConfig", "build_model", "chunked_cross_entropy", "flops_per_token"]
