"""The one training step: the step loop, `train.micro_batch: auto`'s probe, `bench model`, the bare
bench loops and `bench checkpoint` all call `train_step`, so each times the step that trains.

A baseline that must differ from the product on purpose passes the difference in: the benches'
`bare` loops pass a `TorchEngine` (plain PyTorch: autocast, torch's optimizer, clipping) instead of
DeepSpeed's engine, and leave out the loop's on-device metrics by passing no recorder.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class StepRecorder(Protocol):
    """What a step reports as it goes (the loop's `TrainMetrics`, the probe's `StepAccumulators`):
    host clock laps and detached device tensors, never a host sync."""

    def begin_step(self) -> None: ...
    def lap(self, phase: str) -> None: ...
    def add_loss(self, loss: torch.Tensor) -> None: ...
    def add_grad_norm(self, grad_norm: torch.Tensor | float | None) -> None: ...


class _NoRecorder(StepRecorder):
    """The protocol's own methods, which do nothing."""


NO_RECORDER: StepRecorder = _NoRecorder()
"""Records nothing: a bench baseline without the loop's metrics."""


def train_step(
    engine: Any, batches: Iterator[tuple[torch.Tensor, Any]], *, grad_accum: int, metrics: StepRecorder = NO_RECORDER,
    on_batch: Callable[[Any], None] | None = None, on_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One optimizer step: `grad_accum` micro-batches of forward + backward, then the engine's step.

    `batches` yields (tokens (B, T + 1), sequence ids); `engine` is DeepSpeed's or a `TorchEngine`.
    The detached loss and grad norm go to `metrics`: no host sync here. `on_batch` / `on_loss`: a
    drill's (loop/hooks.py), or None. Returns the last micro-batch's loss (a bench's clock syncs on it)."""
    metrics.begin_step()
    for _ in range(grad_accum):
        tokens, seq_ids = next(batches)
        metrics.lap("data")
        if on_batch is not None:
            on_batch(seq_ids)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        if on_loss is not None:
            loss = on_loss(loss)
        metrics.lap("forward")
        engine.backward(loss)
        metrics.lap("backward")
        engine.step()  # applies the optimizer only at the accumulation boundary
        metrics.lap("optimizer")
        metrics.add_loss(loss)
    metrics.add_grad_norm(engine.get_global_grad_norm())
    return loss


class TorchEngine:
    """The calls `train_step` makes of DeepSpeed's engine, in plain PyTorch: the fp32 model under
    `torch.autocast` (bf16 when `precision` is), the loss scaled by 1 / grad_accum in backward, and at
    the accumulation boundary clipping, the optimizer's step and zeroed gradients. The benches' `bare`
    baseline. `guard_nonfinite`: the loop's device-side skip of a non-finite update (`bench health`)."""

    def __init__(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, precision: str, grad_accum: int = 1,
        grad_clip: float = 0.0, guard_nonfinite: bool = False,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.grad_accum, self.grad_clip, self.guard_nonfinite = grad_accum, grad_clip, guard_nonfinite
        device_type = next(model.parameters()).device.type
        self.autocast: Callable[[], Any] = (
            (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
        )
        self._micro_batches = 0
        self._grad_norm: torch.Tensor | None = None

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with self.autocast():
            return self.model(inputs, targets)

    def backward(self, loss: torch.Tensor) -> None:
        (loss / self.grad_accum if self.grad_accum > 1 else loss).backward()

    def step(self) -> None:
        self._micro_batches += 1
        if self._micro_batches % self.grad_accum:
            return
        if self.grad_clip > 0:
            self._grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
            if self.guard_nonfinite:
                from raytrain_fast.engine.deepspeed_compat import skip_nonfinite_update

                skip_nonfinite_update(self.optimizer, self._grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_global_grad_norm(self) -> torch.Tensor | None:
        return self._grad_norm
