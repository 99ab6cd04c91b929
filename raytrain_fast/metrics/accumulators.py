"""The step loop's hot path of metrics: detached tensors added into on-device sums (loss, gradient
norm) and the host clock read around each phase. No host sync here: the sums are read once per log
window, by the drain (metrics/agreement.py)."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

PHASES = ("data", "forward", "backward", "optimizer")
SUMS = 2  # on-device sums: loss, grad norm


class StepAccumulators:
    """One window's sums and phase times, on one rank.

    Phase times (forward, backward, optimizer) are sampled every `profile_every` steps: with CUDA
    events on GPU (read at the next drain, when they are complete: no extra sync) and with the host
    clock on CPU, where ops run synchronously. Data wait is the host time in `next(data)`, every step."""

    def __init__(self, *, device: torch.device, profile_every: int, start_step: int) -> None:
        self.device, self.profile_every = device, profile_every
        self._cuda = device.type == "cuda"
        self.sums = torch.zeros(SUMS, dtype=torch.float32, device=device)
        """[loss sum, grad-norm sum] of the window, on the device; views below avoid re-indexing per step."""
        self._loss_sum, self._grad_norm_sum = self.sums[0], self.sums[1]
        self.step = start_step
        self._lap_t = time.perf_counter()
        self._profiling = False
        self._events: list[tuple[str | None, Any]] = []
        self._pending_events: list[list[tuple[str | None, Any]]] = []
        self.reset()

    def reset(self) -> None:
        """A new window: the sums and counters start over."""
        self.sums.zero_()
        self.num_losses = 0
        self.num_grad_norms = 0
        self.data_wait_s = 0.0
        self._phase_sum = {phase: 0.0 for phase in PHASES}
        self._num_profiled = 0

    def begin_step(self) -> None:
        """Start the clock of the next step (and its phase sampling on profile steps)."""
        self._lap_t = time.perf_counter()
        self._profiling = self.profile_every > 0 and (self.step + 1) % self.profile_every == 0
        if self._profiling:
            if self._cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._events = [(None, start)]
            self._phase_step = {phase: 0.0 for phase in PHASES}

    def lap(self, phase: str) -> None:
        """The phase `phase` (data, forward, backward or optimizer) just ended. Host clock only."""
        now = time.perf_counter()
        if phase == "data":
            self.data_wait_s += now - self._lap_t
        if self._profiling:
            if self._cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self._events.append((phase, event))
            else:
                self._phase_step[phase] += now - self._lap_t
        self._lap_t = now

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss to the on-device sum (detached: no graph is kept, no sync)."""
        self._loss_sum.add_(loss.detach())
        self.num_losses += 1

    def add_grad_norm(self, grad_norm: torch.Tensor | float | None) -> None:
        """The optimizer step's global gradient norm (DeepSpeed: `engine.get_global_grad_norm()`).

        DeepSpeed reports an inf/NaN norm as -1 (bf16, a tensor) or inf (fp32, a float after it
        skipped the step): both enter the sum as non-finite, so one bad step makes the window's
        grad-norm sum non-finite, and the drain's read sees it (docs/health.md). On the device,
        without a sync; a float is added to the device sum without one too."""
        if grad_norm is None:
            return
        if isinstance(grad_norm, torch.Tensor):
            norm = grad_norm.detach()
            self._grad_norm_sum.add_(torch.where(norm < 0, math.nan, norm))
        else:
            value = float(grad_norm)
            self._grad_norm_sum.add_(math.nan if value < 0 else value)
        self.num_grad_norms += 1

    def end_step(self, step: int) -> None:
        """Step `step` is done (optimizer applied): a profiled step's phase times join the window."""
        self.step = step
        if not self._profiling:
            return
        if self._cuda:
            self._pending_events.append(self._events)
            self._events = []
        else:
            for phase, seconds in self._phase_step.items():
                self._phase_sum[phase] += seconds
            self._num_profiled += 1
        self._profiling = False

    def phase_means(self) -> dict[str, float]:
        """Mean seconds per profiled step of each phase in the window. Call after the drain's host
        sync: every CUDA event recorded before it has completed, so elapsed_time() does not wait."""
        if self._cuda:
            for events in self._pending_events:
                for (_, previous), (phase, event) in zip(events, events[1:]):
                    self._phase_sum[phase] += previous.elapsed_time(event) / 1e3
                self._num_profiled += 1
            self._pending_events = []
        if not self._num_profiled:
            return {}
        return {phase: total / self._num_profiled for phase, total in self._phase_sum.items()}
