"""Counted FLOPs (torch's FlopCounterMode), with the CPU attention kernels it misses.

torch 2.13's FlopCounterMode has formulas for the CUDA flash / efficient / cuDNN SDPA kernels but
not for `aten._scaled_dot_product_flash_attention_for_cpu` (and its backward), so on CPU every
attention FLOP would be missing from the count. We register the same formulas torch uses for the
CUDA kernels (full T x T attention, causal masking not subtracted).
"""

from __future__ import annotations

import torch
from torch.utils import flop_counter

_CPU_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _register_cpu_attention_formulas() -> None:
    registry = flop_counter.flop_registry
    if _CPU_FORWARD is not None and _CPU_FORWARD not in registry:

        @flop_counter.register_flop_formula(_CPU_FORWARD)
        def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    if _CPU_BACKWARD is not None and _CPU_BACKWARD not in registry:

        @flop_counter.register_flop_formula(_CPU_BACKWARD)
        def _cpu_sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
            return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


_register_cpu_attention_formulas()


def count_training_flops_per_token(model: torch.nn.Module, tokens: torch.Tensor) -> float:
    """FLOPs of one forward + backward of `model` on `tokens` (B, T), divided by B*T.

    Gradients produced here are cleared afterwards, so the model is left as it was. Activation
    checkpointing is off while counting: recomputation is not useful work in the MFU convention.
    """
    import contextlib

    plain = model.counting_flops() if hasattr(model, "counting_flops") else contextlib.nullcontext()
    with plain, flop_counter.FlopCounterMode(display=False) as counter:
        loss = model(tokens, tokens)
        loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / tokens.numel()
