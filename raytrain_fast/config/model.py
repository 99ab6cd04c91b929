from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of the decoder-only model: the GPT (GPT-2 design) or the Llama family."""

    architecture: Literal["gpt", "llama"] = "gpt"
    """gpt: LayerNorm, GELU MLP, learned or rotary positions (exports as GPT-2 with learned
    positions). llama: RMSNorm, SwiGLU MLP, grouped-query attention, rotary positions with
    `rope_theta`, the options of its `family` (exports as that family's class); `positions` is ignored."""
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
    family: Literal["llama", "mistral", "qwen2", "qwen3"] = "llama"
    """llama: the Hugging Face family the weights belong to, which `checkpoint.init_from` reads and
    the export writes (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM).
    qwen2 has `qkv_bias`, qwen3 `qk_norm`; llama and mistral neither (docs/models.md)."""
    head_dim: int = 0
    """llama: the width of each attention head. 0 = d_model / num_heads (Qwen3 sets it apart:
    128 at d_model 1024 with 16 heads)."""
    qkv_bias: bool = False
    """llama: biases on the query, key and value projections (Qwen2)."""
    qk_norm: bool = False
    """llama: an RMSNorm over each head's queries and keys, before rotary (Qwen3)."""
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    """llama: scaling of the rotary frequencies for long contexts: linear divides every frequency by
    `rope_factor`; llama3 (Llama 3.1 and 3.2) divides the low ones by it and blends the middle band,
    with `rope_low_freq_factor`, `rope_high_freq_factor` and `rope_original_max_seq_len`."""
    rope_factor: float = 8.0
    """llama: the rotary scaling factor (`rope_scaling` linear or llama3)."""
    rope_low_freq_factor: float = 1.0
    """llama: `rope_scaling: llama3`'s low-frequency factor."""
    rope_high_freq_factor: float = 4.0
    """llama: `rope_scaling: llama3`'s high-frequency factor."""
    rope_original_max_seq_len: int = 8192
    """llama: `rope_scaling: llama3`'s original context length (original_max_position_embeddings)."""
    sliding_window: int = 0
    """mistral: the sliding window of the config.json it came from, written back by the export.
    0 = none. Attention here is full causal, which is the sliding window's for sequences up to its
    length, so data.seq_len above it is refused."""
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


def head_size(config: ModelConfig) -> int:
    """The width of each attention head: `head_dim`, or d_model / num_heads when 0."""
    return config.head_dim or config.d_model // config.num_heads


def kv_heads(config: ModelConfig) -> int:
    """Key/value heads: `num_kv_heads`, or num_heads when 0 (and always for the GPT)."""
    if config.architecture == "llama" and config.num_kv_heads > 0:
        return config.num_kv_heads
    return config.num_heads


FAMILY_OPTIONS = {"qwen2": (True, False), "qwen3": (False, True)}
"""(qkv_bias, qk_norm) of each family's Hugging Face class; llama and mistral have neither."""


def llama_option_problems(config: ModelConfig, *, seq_len: int) -> list[str]:
    """What is wrong with the llama options (family, head_dim, q/k/v biases and norms, RoPE scaling,
    sliding window) of `config`, trained on sequences of `seq_len`."""
    defaults = ModelConfig(architecture=config.architecture)
    names = ("family", "head_dim", "qkv_bias", "qk_norm", "rope_scaling", "sliding_window")
    if config.architecture != "llama":
        return [f"model.{n} applies to model.architecture=llama" for n in names if getattr(config, n) != getattr(defaults, n)]
    problems = []
    bias, norm = FAMILY_OPTIONS.get(config.family, (False, False))
    if (config.qkv_bias, config.qk_norm) != (bias, norm):
        problems.append(
            f"model.family={config.family} has {'biases' if bias else 'no biases'} on q/k/v and {'a' if norm else 'no'} "
            f"per-head q/k norm: set model.qkv_bias={str(bias).lower()} and model.qk_norm={str(norm).lower()}"
        )
    if config.head_dim < 0:
        problems.append(f"model.head_dim must be >= 0 (0 = d_model / num_heads), got {config.head_dim}")
    if min(config.rope_factor, config.rope_low_freq_factor, config.rope_original_max_seq_len) <= 0 or (
        config.rope_scaling == "llama3" and config.rope_high_freq_factor <= config.rope_low_freq_factor
    ):
        problems.append("model.rope_factor, rope_low_freq_factor and rope_original_max_seq_len must be > 0, and "
                        "rope_high_freq_factor > rope_low_freq_factor")
    if config.sliding_window and config.family != "mistral":
        problems.append("model.sliding_window applies to model.family=mistral")
    elif 0 < config.sliding_window < seq_len:
        problems.append(
            f"model.sliding_window ({config.sliding_window}) is shorter than data.seq_len ({seq_len}): attention here is "
            f"full causal, which is the sliding window's only up to its length; set data.seq_len <= {config.sliding_window}"
        )
    return problems
