"""The output layer and cross-entropy, chunked over rows so the full-vocabulary logits never exist.

The plain loss `F.cross_entropy(lm_head(h).float(), t)` holds the (N, V) logits in the model's dtype
and their fp32 copy until the backward pass: at gpt-124m, micro-batch 16, seq 1024 (N = 16,384,
V = 50,304) that is 3.3 GB of fp32 alone. Here each chunk of rows computes its logits, its loss and
at once the gradients they send back (to the hidden states and to the output weight), then frees
them: memory is one chunk's logits, and the FLOPs are those of the plain loss (nothing is
recomputed, unlike checkpointing the loss). The same idea as Liger Kernel's fused linear
cross-entropy, in plain torch.

Targets equal to IGNORE_INDEX (-100, as in torch) count for nothing: the mean is over the others
(document masking's loss mask, model/documents.py).

Numerics: the logits are the same matmul in the model's dtype, the softmax and loss run in fp32 as
in the plain path, and the weight gradient is summed over chunks in fp32 before one cast.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Targets that add no loss and no gradient (torch's default `ignore_index`)."""

CHUNK_ROWS = 1024
"""Rows (tokens) per chunk: at V = 50,304 one chunk's fp32 logits are 0.2 GB."""


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        # hidden (N, d), weight (V, d), targets (N,). Returns the mean loss over the rows whose target
        # is not IGNORE_INDEX (fp32). `rows` stays a device tensor: no host sync.
        rows = (targets != IGNORE_INDEX).sum()
        want_grads = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if want_grads else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_grads else None
        for start in range(0, hidden.shape[0], chunk_rows):
            h = hidden[start:start + chunk_rows]
            t = targets[start:start + chunk_rows]
            logits = (h @ weight.t()).float()  # (n, V): this chunk only
            total += F.cross_entropy(logits, t, reduction="sum", ignore_index=IGNORE_INDEX)
            if not want_grads:
                continue
            # d(mean loss)/d(logits) = (softmax - onehot) / N, in fp32, then in the model's dtype
            # for the two matmuls (as autograd does through the plain path's .float()).
            grad_logits = torch.softmax(logits, dim=-1)
            counted = t != IGNORE_INDEX
            grad_logits[torch.arange(t.shape[0], device=t.device), t.clamp(min=0)] -= 1.0
            grad_logits = (grad_logits * (counted.unsqueeze(1) / rows)).to(hidden.dtype)  # ignored rows: 0
            grad_hidden[start:start + chunk_rows] = grad_logits @ weight
            grad_weight += (grad_logits.t() @ h).float()
        if want_grads:
            ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return total / rows

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_output.to(grad_hidden.dtype)
        return grad_hidden * scale, grad_weight * scale, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, chunk_rows: int = CHUNK_ROWS
) -> torch.Tensor:
    """mean(cross_entropy(hidden @ weight.T, targets)) for hidden (N, d), weight (V, d), targets (N,),
    without the (N, V) logits. Equal to the plain loss up to the order of fp32 sums (see tests).
    Without gradients (evaluation, torch.no_grad) only the loss is computed: the autograd Function
    cannot see grad mode (its forward always runs with it off), so it gets inputs that need no gradient."""
    if not torch.is_grad_enabled():
        hidden, weight = hidden.detach(), weight.detach()
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_rows)
