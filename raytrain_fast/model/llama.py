"""The Llama-family decoder (`model.architecture: llama`): RMSNorm, a SwiGLU MLP, grouped-query
attention, rotary positions with a configurable base, and the options of the families built on it
(`model.family`): biases on q/k/v (Qwen2), an RMSNorm over each head's queries and keys and a
head width set apart from d_model / num_heads (Qwen3), RoPE scaling (Llama 3.1/3.2's `llama3`, or
`linear`).

A subclass of the GPT (model/gpt.py) that swaps the attention, the MLP, the norms and the rotary tables:
the forward pass, activation checkpointing, the chunked loss, FLOPs counting and regional compile
(each of `blocks`) are the GPT's. The numerics follow Hugging Face's LlamaForCausalLM, so an
export (model/hf.py) gives the same logits: rotary in the "rotate half" layout (the first and
second halves of each head are the pairs, not adjacent channels), frequencies computed (and scaled)
in fp32 as transformers' `modeling_rope_utils` does, tables cast, RMSNorm in fp32. The
projections are fused (q|k|v in one matrix, gate|up in another: one matmul each instead of three
and two); the export splits them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_fast.config.model import ModelConfig, head_size, llama_mlp_hidden
from raytrain_fast.model.gpt import GPT, CausalSelfAttention


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as LlamaRMSNorm does)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_frequencies(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """The hd/2 rotary frequencies of `config`, scaled as `model.rope_scaling` says, in the order of
    operations of transformers' `_compute_default/linear_scaling/llama3_parameters` (same fp32 values)."""
    dim = head_size(config)
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.int64).float() / dim))
    if config.rope_scaling == "linear":
        return inv_freq / config.rope_factor
    if config.rope_scaling != "llama3":
        return inv_freq
    # llama3: wavelengths above original / low_freq_factor slowed by `factor`, below original /
    # high_freq_factor kept, the band between blended smoothly (Llama 3.1's reference code).
    factor, low, high, original = (config.rope_factor, config.rope_low_freq_factor, config.rope_high_freq_factor,
                                   config.rope_original_max_seq_len)
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, smoothed, scaled)


class GroupedQueryAttention(CausalSelfAttention):
    """The GPT's attention with grouped-query heads (`kv_heads`), rotary in the rotate-half layout
    (cos/sin: (T, hd), or (B, 1, T, hd) at positions inside each document: document masking), and
    with `qk_norm` an RMSNorm of each head's queries and keys (`q_norm`, `k_norm`: one hd-wide
    weight each, shared by the heads)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        if config.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, config.norm_eps), RMSNorm(self.head_dim, config.norm_eps)

    def _normalize(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(self, "q_norm"):
            return q, k
        return self.q_norm(q), self.k_norm(k)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        first, second = x.chunk(2, dim=-1)  # rotate half: each channel's pair is in the other half
        return x * cos + torch.cat((-second, first), dim=-1) * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)) (Shazeer 2020), gate and up in one matrix (gate rows first)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.hidden = llama_mlp_hidden(config)
        self.gate_up = nn.Linear(config.d_model, 2 * self.hidden, bias=False)
        self.down = nn.Linear(self.hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.hidden, dim=-1)
        return self.down(F.silu(gate) * up)


class Llama(GPT):
    """The Llama-family model; see the module docstring. Parameter names: token_emb, blocks.<i>.
    {norm_attn, attn.qkv (its bias with qkv_bias), attn.q_norm and attn.k_norm (with qk_norm),
    attn.proj, norm_mlp, mlp.gate_up, mlp.down}, norm_out, lm_head."""

    attention_class = GroupedQueryAttention
    mlp_class = SwiGLU

    def _learned_positions(self) -> bool:
        return False

    def _make_norm(self, config: ModelConfig) -> nn.Module:
        return RMSNorm(config.d_model, config.norm_eps)

    def _make_rotary_tables(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # cos/sin (T, hd): the hd/2 frequencies twice, for the rotate-half layout.
        positions = torch.arange(seq, device=device, dtype=torch.float32)
        angles = torch.outer(positions, rotary_frequencies(self.config, device))
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos(), angles.sin()
