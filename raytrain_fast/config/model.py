from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the decoder-only model: the GPT (GPT-2 design) or the Llama family."""

    architecture: Literal["gpt", "llama"] = "gpt"
    """gpt: LayerNorm, GELU MLP, learned or rotary positions (exports as GPT-2 with learned
    positions). llama: RMSNorm, SwiGLU MLP, grouped-query attention, rotary positions with
    `rope_theta`, no biases (exports as LlamaForCausalLM); `positions` is ignored."""
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
    num_kv_heads: int = 0
    """llama: key/value heads of grouped-query attention; must divide num_heads. 0 = num_heads
    (plain multi-head attention)."""
    mlp_hidden: int = 0
    """llama: hidden width of the SwiGLU MLP. 0 = Llama's rule: 2/3 * mlp_ratio * d_model, rounded
    up to a multiple of `mlp_multiple_of` (d_model 4096 -> 11008)."""
    mlp_multiple_of: int = 256
    """llama: the multiple the SwiGLU hidden width is rounded up to when `mlp_hidden` is 0."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (Llama 2: 10000, Llama 3: 500000)."""
    norm_eps: float = 1e-5
    """llama: epsilon of RMSNorm."""
    positions: Literal["learned", "rotary"] = "learned"
    """Position encoding: a learned table added to the embeddings, or rotary (RoPE) inside attention."""
    tie_embeddings: bool = True
    """Share the token embedding matrix with the output projection (the llama presets set false,
    as Llama does)."""
    dropout: float = 0.0
    """Dropout probability (0 for pretraining at scale)."""
    init_std: float = 0.02
    """Std of the normal init of linear and embedding weights."""
    activation_checkpointing: Literal["none", "full", "every_n"] = "none"
    """Recompute activations in the backward pass instead of keeping them: `full` = every block,
    `every_n` = every `activation_checkpointing_n`-th block (non-reentrant torch.utils.checkpoint per
    block). Costs about one more forward pass (20-30% more compute) for far less activation memory,
    so a larger micro-batch fits; `train.micro_batch: auto` turns it on by itself only when no
    micro-batch fits without it."""
    activation_checkpointing_n: int = 2
    """With `activation_checkpointing: every_n`: checkpoint blocks 0, n, 2n, ..."""
    chunked_loss: Literal["auto", "on", "off"] = "auto"
    """Compute the output layer and cross-entropy in chunks of rows, with their gradients, so the
    full-vocabulary logits (and their fp32 copy) never exist at once: about 3.3 GB less at gpt-124m,
    micro-batch 16, seq 1024, at no extra FLOPs. auto = on when vocab_size >= 8192 (the tiny
    preset's 320-row vocabulary gains nothing)."""


def llama_mlp_hidden(config: ModelConfig) -> int:
    """The SwiGLU hidden width: `mlp_hidden`, or Llama's rule (2/3 of mlp_ratio * d_model, rounded
    up to a multiple of `mlp_multiple_of`; Touvron et al. 2023, facebookresearch/llama model.py)."""
    if config.mlp_hidden > 0:
        return config.mlp_hidden
    multiple = max(1, config.mlp_multiple_of)
    hidden = int(2 * config.mlp_ratio * config.d_model / 3)
    return multiple * ((hidden + multiple - 1) // multiple)


def kv_heads(config: ModelConfig) -> int:
    """Key/value heads: `num_kv_heads`, or num_heads when 0 (and always for the GPT)."""
    if config.architecture == "llama" and config.num_kv_heads > 0:
        return config.num_kv_heads
    return config.num_heads
