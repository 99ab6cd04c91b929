"""The decoder-only models (GPT, Llama family) and their FLOPs formula."""

from raytrain_fast.config.model import ModelConfig
from raytrain_fast.model.build import build_model, model_class
from raytrain_fast.model.documents import DocumentMasking, document_masking
from raytrain_fast.model.gpt import GPT, flops_per_token
from raytrain_fast.model.loss import chunked_cross_entropy
