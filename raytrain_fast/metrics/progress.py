"""Progress lines on the terminal from rank 0: step, loss, tokens/s, ETA."""

from __future__ import annotations

import sys
import time


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class Progress:
    """Measures host wall time between log steps; prints one line per log step."""

    def __init__(self, *, total_steps: int, start_step: int, tokens_per_step: int, enabled: bool) -> None:
        self.total_steps = total_steps
        self.tokens_per_step = tokens_per_step
        self.enabled = enabled
        self._last_step = start_step
        self._last_time = time.perf_counter()

    def restart_clock(self, step: int) -> None:
        """Exclude time not spent training (checkpoint saves) from the next window."""
        self._last_step = step
        self._last_time = time.perf_counter()

    def log(self, *, step: int, loss: float, lr: float) -> dict[str, float]:
        now = time.perf_counter()
        steps = max(1, step - self._last_step)
        step_s = (now - self._last_time) / steps
        tokens_per_sec = self.tokens_per_step / step_s if step_s > 0 else 0.0
        self._last_step, self._last_time = step, now
        eta = step_s * (self.total_steps - step)
        if self.enabled:
            width = len(str(self.total_steps))
            print(
                f"step {step:>{width}}/{self.total_steps}  loss {loss:.4f}  lr {lr:.2e}  "
                f"{tokens_per_sec:,.0f} tok/s  {step_s * 1000:.0f} ms/step  ETA {_duration(eta)}",
                file=sys.stdout,
                flush=True,
            )
        return {"train/loss": loss, "train/lr": lr, "throughput/tokens_per_sec": tokens_per_sec, "time/step_s": step_s}
