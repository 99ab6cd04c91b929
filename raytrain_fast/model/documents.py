"""Document masking (`data.document_masking`): attention stays inside each document of a packed row.

A packed row holds documents back to back, each ended by the end-of-document id (docs/data.md). With
masking on, the model reads the document boundaries from its own input tokens (an EOD id is the last
token of its document), so it needs nothing from the data pipeline but that id:
- attention is block-causal: a token attends to the earlier tokens of its own document only
  (torchtitan's `block_causal`, Megatron's `--reset-attention-mask`);
- positions (learned or rotary) restart at 0 at each document's first token (`--reset-position-ids`);
- optionally, no loss on the target after an EOD input: the next document's first token, which the
  masked model would have to guess from the previous document (`--eod-mask-loss`).

The attention kernel per device: on CUDA, flex attention with a BlockMask (torch >= 2.5; blocks of
128 x 128 that lie outside every document are skipped, so the cost shrinks with the documents); on
the CPU, SDPA with a boolean (B, 1, T, T) mask, which runs torch's fused CPU flash kernel.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from raytrain_fast.config.data import DataConfig
from raytrain_fast.model.loss import IGNORE_INDEX



@dataclass(frozen=True, kw_only=True)
class DocumentMasking:
    """What the model needs to mask documents: the data's end-of-document id and the loss rule."""

    eod_id: int
    """The tokenizer's end-of-document id (the manifest's tokenizer.eod_id; the byte tokenizer's is 256)."""
    mask_loss_after_eod: bool = True
    """No loss on targets whose input is an EOD id (the next document's first token)."""


def document_masking(data: DataConfig, *, eod_id: int) -> DocumentMasking | None:
    """The masking of a run from its `data` config section and its manifest's end-of-document id;
    None when `data.document_masking` is off. The loop: `build_model(config.model, device,
    documents=document_masking(config.data, eod_id=manifest.tokenizer.eod_id))`."""
    if not data.document_masking:
        return None
    return DocumentMasking(eod_id=int(eod_id), mask_loss_after_eod=bool(data.mask_loss_after_eod))


@dataclass(frozen=True)
class DocumentLayout:
    """One packed batch's documents, computed once per forward and handed to every block."""

    positions: torch.Tensor
    """(B, T) int64: each token's position inside its document."""
    mask: Any
    """The attention mask: a flex-attention BlockMask on CUDA, elsewhere a (B, 1, T, T) additive mask
    (0 inside a document, -inf outside) in the activations' dtype."""


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """(B, T) -> (B, T) int64: document i of the row for every token; an EOD id ends its document."""
    ends = (tokens == eod_id).to(torch.int64)
    return torch.cumsum(ends, dim=1) - ends  # EODs strictly before each token


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, T): the index of each token within its document (0 at each document's start)."""
    index = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    start_of = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return index - start_of


def dense_block_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) -> (B, 1, T, T) bool, True where query q may attend to key k: same document, k <= q."""
    seq = doc_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=doc_ids.device).tril()
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # (B, T, T)
    return (same & causal).unsqueeze(1)


def flex_attention_available() -> bool:
    """torch >= 2.5 has flex attention."""
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def flex_block_causal_mask(doc_ids: torch.Tensor) -> Any:
    """A BlockMask for flex attention: the same rule as `dense_block_causal_mask`, kept as 128 x 128
    blocks (a block wholly outside every document is skipped by the kernel)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b, h, q, kv):
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    batch, seq = doc_ids.shape
    return create_block_mask(same_document_causal, batch, None, seq, seq, device=doc_ids.device)


def document_layout(tokens: torch.Tensor, masking: DocumentMasking, *, dtype: torch.dtype) -> DocumentLayout:
    """The positions and attention mask of a packed batch `tokens` (B, T), for activations of `dtype`."""
    doc_ids = document_ids(tokens, masking.eod_id)
    if tokens.device.type == "cuda" and flex_attention_available():  # torch < 2.5 has none: the driver refuses that
        mask = flex_block_causal_mask(doc_ids)
    else:
        # Additive, made once per forward for every block: SDPA would convert a bool mask in each call
        # (bool measured 1.1-1.25x the additive mask's attention time at the tiny shape on 2 cores).
        allowed = dense_block_causal_mask(doc_ids)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=tokens.device).masked_fill_(~allowed, float("-inf"))
    return DocumentLayout(positions=document_positions(doc_ids), mask=mask)


def masked_targets(tokens: torch.Tensor, targets: torch.Tensor, masking: DocumentMasking) -> torch.Tensor:
    """`targets` with IGNORE_INDEX where the input token is an EOD id (when the rule asks for it)."""
    if not masking.mask_loss_after_eod:
        return targets
    return targets.masked_fill(tokens == masking.eod_id, IGNORE_INDEX)


@functools.cache
def _compiled_flex_attention():
    # flex attention is only fast compiled (eager runs an unfused reference): torch's advice is one
    # torch.compile of the function, for blocks that are not compiled themselves.
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, *, dropout_p: float) -> torch.Tensor:
    """Causal attention of q, k, v (B, H, T, hd): plain causal SDPA when `mask` is None, else
    within documents (a dense bool mask through SDPA, or a BlockMask through flex attention)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
    assert dropout_p == 0.0, "flex attention has no dropout; validation refuses model.dropout > 0 with masking on a GPU"
    if torch.compiler.is_compiling():  # inside a compiled block (engine.compile): that compile takes flex in
        from torch.nn.attention.flex_attention import flex_attention

        return flex_attention(q, k, v, block_mask=mask)
    return _compiled_flex_attention()(q, k, v, block_mask=mask)
