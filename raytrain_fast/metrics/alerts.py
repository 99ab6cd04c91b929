"""The alerts of a log window, on rank 0: the slowdown detector (a steady slide against the run's
own baseline) and the stall detector (one window far slower than those before it), each with its
cause, a metric and one warning when it starts."""

from __future__ import annotations

import logging

from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.metrics.slowdown import SlowdownDetector, StallDetector, Window

logger = logging.getLogger("raytrain_fast.metrics")


class WindowAlerts:
    def __init__(self, config: MetricsConfig, *, start_step: int) -> None:
        warmup_steps = start_step + config.slowdown_warmup_steps
        self.slowdown = SlowdownDetector(
            threshold=config.slowdown_threshold, num_windows=config.slowdown_windows, warmup_steps=warmup_steps,
        )
        self.stall = StallDetector(factor=config.stall_factor, warmup_steps=warmup_steps)

    def check(self, metrics: dict[str, float], window: Window) -> None:
        """Feed the window to both detectors; alert/* into `metrics`."""
        slowdown, alert = self.slowdown.update(window)
        if self.slowdown.baseline is not None:
            metrics["alert/slowdown"] = slowdown
            # The ratio the alert is decided on (rolling median), so a label never reads
            # "SLOWDOWN x0.95" because one window happened to be fast.
            ratio = self.slowdown.last_ratio
            metrics["alert/slowdown_ratio"] = ratio if ratio is not None else window.step_s / self.slowdown.baseline.step_s
        if alert is not None:
            metrics[f"alert/slowdown_cause/{alert.cause}"] = 1.0
            logger.warning(alert.message)
        stall = self.stall.update(window)
        metrics["alert/stall"] = 1.0 if stall else 0.0
        if stall is not None:
            metrics["alert/stall_ratio"] = stall.ratio
            metrics[f"alert/stall_cause/{stall.cause}"] = 1.0
            logger.warning(stall.message)
