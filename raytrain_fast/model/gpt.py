"""A decoder-only GPT: pre-norm blocks, causal SDPA attention (flash kernels on GPU), learned or
rotary positions, optional weight tying.

For real sizes: per-block activation checkpointing (`model.activation_checkpointing`), a chunked
output layer + loss that never holds the full-vocabulary logits (`model.chunked_loss`, see
model/loss.py), rotary tables built once per (length, device, dtype), and `build_model` to build the
weights directly on their device. Blocks are the unit `engine.compile` compiles (engine/compile.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from raytrain_fast.config.model import ModelConfig, head_size, kv_heads, llama_mlp_hidden
from raytrain_fast.model.documents import DocumentLayout, DocumentMasking, attend, document_layout, masked_targets
from raytrain_fast.model.loss import chunked_cross_entropy

CHUNKED_LOSS_MIN_VOCAB = 8192
"""`chunked_loss: auto` turns on from this vocabulary size."""


class CausalSelfAttention(nn.Module):
    """Causal self-attention, q|k|v in one matrix, with `kv_heads(config)` key/value heads (grouped-query
    when fewer than num_heads: llama only) of `head_size(config)`; rotary positions where the caller
    passes the tables."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, kv_heads(config)
        self.head_dim = head_size(config)
        self.q_width, self.kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv = nn.Linear(config.d_model, self.q_width + 2 * self.kv_width, bias=config.qkv_bias)
        self.proj = nn.Linear(self.q_width, config.d_model, bias=False)
        self.dropout = config.dropout

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: (B, H, T, hd); cos/sin: (T, hd/2), or (B, 1, T, hd/2) with document masking
        x1, x2 = x[..., 0::2], x[..., 1::2]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return rotated.flatten(-2)

    def _normalize(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # (B, T, H, hd): the llama's per-head norms (qk_norm) go here

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, mask: Any = None
    ) -> torch.Tensor:
        batch, seq, _ = x.shape  # (B, T, d)
        q, k, v = self.qkv(x).split((self.q_width, self.kv_width, self.kv_width), dim=-1)
        q, k, v = (t.view(batch, seq, -1, self.head_dim) for t in (q, k, v))  # (B, T, H or Hkv, hd)
        q, k = self._normalize(q, k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, T, hd), (B, Hkv, T, hd)
        if cos is not None and sin is not None:  # rotary positions: the tables come from GPT.forward
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        if self.num_kv_heads != self.num_heads:
            # Query head i reads key/value head i // group (Hugging Face's repeat_kv). An explicit
            # copy rather than SDPA's enable_gqa: every kernel and the FLOP counter take it.
            group = self.num_heads // self.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        y = attend(q, k, v, mask, dropout_p=self.dropout if self.training else 0.0)  # (B, H, T, hd); mask: documents
        return self.proj(y.transpose(1, 2).reshape(batch, seq, self.q_width))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.up = nn.Linear(config.d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, config.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """A pre-norm residual block of the model's norm, attention and MLP classes (the GPT's or llama's)."""

    def __init__(self, config: ModelConfig, norm: Callable[[ModelConfig], nn.Module], attention: type[nn.Module],
                 mlp: type[nn.Module]) -> None:
        super().__init__()
        self.norm_attn = norm(config)
        self.attn = attention(config)
        self.norm_mlp = norm(config)
        self.mlp = mlp(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None, mask: Any = None
    ) -> torch.Tensor:
        x = x + self.drop(self.attn(self.norm_attn(x), cos, sin, mask))  # pre-norm residual
        return x + self.drop(self.mlp(self.norm_mlp(x)))


class GPT(nn.Module):
    def __init__(self, config: ModelConfig, documents: DocumentMasking | None = None) -> None:
        super().__init__()
        self.config = config
        self.documents = documents
        """Document masking (model/documents.py), or None: plain causal attention over the whole row."""
        self.token_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.max_seq_len, config.d_model) if self._learned_positions() else None
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, self._make_norm, self.attention_class, self.mlp_class)
                                    for _ in range(config.num_layers))
        self.norm_out = self._make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_emb.weight
        self.apply(self._init_weights)
        # GPT-2 scaling of residual projections: std / sqrt(2 * num_layers).
        for name, param in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.down.weight")):
                nn.init.normal_(param, std=config.init_std / math.sqrt(2 * config.num_layers))
        self._rotary_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.checkpointing = config.activation_checkpointing != "none"
        """Recompute checkpointed blocks in backward (training only); off while FLOPs are counted."""
        chunked = config.chunked_loss
        self.chunked_loss = chunked == "on" or (chunked == "auto" and config.vocab_size >= CHUNKED_LOSS_MIN_VOCAB)

    # The parts a subclass (model/llama.py) replaces; forward, checkpointing and the loss are shared.
    attention_class: type[nn.Module] = CausalSelfAttention
    mlp_class: type[nn.Module] = MLP

    def _learned_positions(self) -> bool:
        return self.config.positions == "learned"

    def _make_norm(self, config: ModelConfig) -> nn.Module:
        return nn.LayerNorm(config.d_model)

    def _make_rotary_tables(self, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        # RoPE (Su et al. 2021): rotate channel pairs by position * theta_i, theta_i = base^(-2i/head_dim).
        head_dim, base = head_size(self.config), self.config.rope_theta
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)  # (T, hd/2)
        return angles.cos(), angles.sin()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.init_std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None, layout: DocumentLayout | None = None) -> torch.Tensor:
        """tokens: (B, T) int64. Returns logits (B, T, V), or the mean cross-entropy if targets are given
        (over the targets that count: with document masking, none after an end-of-document id).
        `layout`: each token's position and the attention mask, given by the caller (the downstream
        scorer reads a context once for all its choices); None = causal, or document masking's."""
        seq = tokens.shape[1]
        x = self.token_emb(tokens)  # (B, T, d)
        if layout is None and self.documents is not None:
            layout = document_layout(tokens, self.documents, dtype=x.dtype)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(seq, device=tokens.device) if layout is None else layout.positions)
        x = self.drop(x)
        cos, sin = self._rotary_for(seq, x, layout) if self.pos_emb is None else (None, None)
        mask = None if layout is None else layout.mask
        for index, block in enumerate(self.blocks):
            if self._checkpointed(index):
                x = checkpoint(block, x, cos, sin, mask, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask)
        hidden = self.norm_out(x)  # (B, T, d)
        if targets is None:
            return self.lm_head(hidden)  # (B, T, V)
        if self.documents is not None:
            targets = masked_targets(tokens, targets, self.documents)
        if self.chunked_loss:
            return chunked_cross_entropy(hidden.flatten(0, 1), self.lm_head.weight, targets.flatten())
        return F.cross_entropy(self.lm_head(hidden).flatten(0, 1).float(), targets.flatten())

    def _checkpointed(self, index: int) -> bool:
        if not (self.checkpointing and self.training and torch.is_grad_enabled()):
            return False
        return self.config.activation_checkpointing == "full" or index % max(1, self.config.activation_checkpointing_n) == 0

    def _rotary_for(self, seq: int, x: torch.Tensor, layout: DocumentLayout | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary tables for this batch in x's dtype: (T, hd/2) shared by every row, or with document
        masking (B, 1, T, hd/2) gathered at each token's position inside its document. The (T, hd/2)
        tables are built once per (length, device, dtype), then reused by every block of every step."""
        key = (seq, x.device, x.dtype)
        if key not in self._rotary_cache:
            cos, sin = self._make_rotary_tables(seq, x.device)
            self._rotary_cache[key] = (cos.to(x.dtype), sin.to(x.dtype))
        cos, sin = self._rotary_cache[key]
        if layout is None:
            return cos, sin
        return cos[layout.positions].unsqueeze(1), sin[layout.positions].unsqueeze(1)

    @contextlib.contextmanager
    def counting_flops(self) -> Iterator[None]:
        """The model as the FLOPs convention counts it: no recomputation from activation checkpointing."""
        saved, self.checkpointing = self.checkpointing, False
        try:
            yield
        finally:
            self.checkpointing = saved

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token; see `flops_per_token`."""
        return flops_per_token(self.config, seq_len)


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_matmul + 12 * L * d * T (GPT and llama).

    Source: Kaplan et al. 2020 (Scaling Laws, sec. 2.1) and PaLM (Chowdhury et al. 2022, app. B).
    - N_matmul: weights used in matrix products per token: per block 4*d^2 (qkv + out proj)
      + 2*r*d^2 (MLP) for the GPT, 2*d*d_q + 2*d*d_kv + 3*d*h (grouped-query attention with
      query width d_q = heads * head_dim, SwiGLU of hidden width h) for llama, plus V*d for the output
      projection (counted even when tied, since the product is computed; the embedding lookup itself
      is a gather, 0 FLOPs).
    - 6 = 2 FLOPs per multiply-add in the forward pass x 3 (backward costs twice the forward).
    - 12*L*d_q*T: attention scores QK^T and the weighted sum AV, 2*T*d_q FLOPs each per token and
      layer forward, x3 for backward (d_q = d but for a llama with head_dim set apart). Counted for
      the full T x T square, as FlopCounterMode and the usual MFU convention do, although causal
      kernels skip half of it.
    Norms, biases, softmax, GELU, SiLU and rotary are elementwise and left out. FlopCounterMode counts
    a bit more (+2% on the tiny preset): its attention backward includes recomputing the scores.
    """
    d, num_layers = config.d_model, config.num_layers
    q_width = config.num_heads * head_size(config)
    if config.architecture == "llama":
        # llama: q and o projections d * q_width each, k and v d * kv_width each (grouped-query), and
        # the SwiGLU MLP's three matrices (gate, up, down) of d * hidden.
        kv_width = kv_heads(config) * head_size(config)
        per_block = 2 * d * q_width + 2 * d * kv_width + 3 * d * llama_mlp_hidden(config)
    else:
        per_block = (4 + 2 * config.mlp_ratio) * d * d
    n_matmul = num_layers * per_block + config.vocab_size * d
    return 6.0 * n_matmul + 12.0 * num_layers * q_width * seq_len
