"""The Llama-family decoder (`model.architecture: llama`): RMSNorm, a SwiGLU MLP, grouped-query
attention, rotary positions with a configurable base, no biases, untied embeddings in the presets.

A subclass of the GPT (model/gpt.py) that swaps the blocks, the final norm and the rotary tables:
the forward pass, activation checkpointing, the chunked loss, FLOPs counting and regional compile
(each of `blocks`) are the GPT's. The numerics follow Hugging Face's LlamaForCausalLM, so an
export (checkpoint/hf.py) gives the same logits: rotary in the "rotate half" layout (the first and
second halves of each head are the pairs, not adjacent channels), tables computed in fp32 and cast,
RMSNorm in fp32. The projections are fused (q|k|v in one matrix, gate|up in another: one matmul
each instead of three and two); the export splits them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_fast.config.model import ModelConfig, kv_heads, llama_mlp_hidden
from raytrain_fast.model.documents import attend
from raytrain_fast.model.gpt import GPT


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


class GroupedQueryAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, kv_heads(config)
        self.head_dim = config.d_model // config.num_heads
        self.kv_width = self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(config.d_model, config.d_model + 2 * self.kv_width, bias=False)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=False)
        self.dropout = config.dropout

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, mask: Any = None
    ) -> torch.Tensor:
        batch, seq, width = x.shape  # (B, T, d)
        q, k, v = self.qkv(x).split((width, self.kv_width, self.kv_width), dim=-1)
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k, v = (t.view(batch, seq, self.num_kv_heads, self.head_dim).transpose(1, 2) for t in (k, v))  # (B, Hkv, T, hd)
        assert cos is not None and sin is not None  # llama is always rotary: Llama._rotary makes them
        # cos/sin: (T, hd), or (B, 1, T, hd) at positions inside each document (document masking)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if self.num_kv_heads != self.num_heads:
            # Query head i reads key/value head i // group (Hugging Face's repeat_kv). An explicit
            # copy rather than SDPA's enable_gqa: every kernel and the FLOP counter take it.
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = attend(q, k, v, mask, dropout_p=self.dropout if self.training else 0.0)  # mask: documents, or None
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


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


class LlamaBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm_attn = RMSNorm(config.d_model, config.norm_eps)
        self.attn = GroupedQueryAttention(config)
        self.norm_mlp = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = SwiGLU(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, mask: Any = None
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm_attn(x), cos, sin, mask))
        return x + self.drop(self.mlp(self.norm_mlp(x)))


class Llama(GPT):
    """The Llama-family model; see the module docstring. Parameter names: token_emb, blocks.<i>.
    {norm_attn, attn.qkv, attn.proj, norm_mlp, mlp.gate_up, mlp.down}, norm_out, lm_head."""

    def _learned_positions(self) -> bool:
        return False

    def _make_block(self, config: ModelConfig) -> nn.Module:
        return LlamaBlock(config)

    def _make_norm(self, config: ModelConfig) -> nn.Module:
        return RMSNorm(config.d_model, config.norm_eps)

    def _make_rotary_tables(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return _llama_rotary_tables(seq, self.config.d_model // self.config.num_heads, device, self.config.rope_theta)
