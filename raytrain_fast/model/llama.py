"""The Llama-family decoder (`model.architecture: llama`): RMSNorm, a SwiGLU MLP, grouped-query
attention, rotary positions with a configurable base, no biases, untied embeddings in the presets.

A subclass of the GPT (model/gpt.py) that swaps the attention, the MLP, the norms and the rotary tables:
the forward pass, activation checkpointing, the chunked loss, FLOPs counting and regional compile
(each of `blocks`) are the GPT's. The numerics follow Hugging Face's LlamaForCausalLM, so an
export (checkpoint/hf.py) gives the same logits: rotary in the "rotate half" layout (the first and
second halves of each head are the pairs, not adjacent channels), tables computed in fp32 and cast,
RMSNorm in fp32. The projections are fused (q|k|v in one matrix, gate|up in another: one matmul
each instead of three and two); the export splits them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_fast.config.model import ModelConfig, llama_mlp_hidden
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


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _llama_rotary_tables(seq_len: int, head_dim: int, device: torch.device, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    # cos/sin (T, hd): the hd/2 frequencies twice, for the rotate-half layout.
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class GroupedQueryAttention(CausalSelfAttention):
    """The GPT's attention with grouped-query heads (`kv_heads`) and rotary in the rotate-half layout;
    cos/sin: (T, hd), or (B, 1, T, hd) at positions inside each document (document masking)."""

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin


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
    {norm_attn, attn.qkv, attn.proj, norm_mlp, mlp.gate_up, mlp.down}, norm_out, lm_head."""

    attention_class = GroupedQueryAttention
    mlp_class = SwiGLU

    def _learned_positions(self) -> bool:
        return False

    def _make_norm(self, config: ModelConfig) -> nn.Module:
        return RMSNorm(config.d_model, config.norm_eps)

    def _make_rotary_tables(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return _llama_rotary_tables(seq, self.config.d_model // self.config.num_heads, device, self.config.rope_theta)
