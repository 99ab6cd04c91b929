from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the decoder-only GPT."""

    vocab_size: int = 320
    """Embedding rows. Must be >= the tokenizer's vocabulary (byte tokenizer: 257); a multiple of 64 is fastest."""
    max_seq_len: int = 128
    """Longest sequence the model accepts (learned position table size; rotary has no table)."""
    num_layers: int = 4
    """Number of transformer blocks."""
    num_heads: int = 4
    """Attention heads per block; d_model must divide evenly by it."""
    d_model: int = 128
    """Width of the residual stream."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of d_model."""
    positions: Literal["learned", "rotary"] = "learned"
    """Position encoding: a learned table added to the embeddings, or rotary (RoPE) inside attention."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output projection."""
    dropout: float = 0.0
    """Dropout probability (0 for pretraining at scale)."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""
