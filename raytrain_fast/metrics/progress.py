"""The progress line rank 0 prints on log steps."""

from __future__ import annotations

import math

from raytrain_fast.metrics.slowdown import STALL_CAUSES

# The window's figures on the line, in order: (metric, format); one the window lacks is left out.
_SHOWN = (
    ("train/epoch", "epoch {:.2f}"), ("train/loss", "loss {:.4f}"), ("train/lr", "lr {:.2e}"),
    ("throughput/tokens_per_sec", "{:,.0f} tok/s"), ("ms/step", "{:.0f} ms/step"), ("throughput/mfu", "MFU {:.1%}"),
    ("throughput/mfu_measured_peak", "{:.0%} of measured peak"), ("time/data_wait_frac", "data wait {:.1%}"),
)


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


def progress_line(step: int, total_steps: int, metrics: dict[str, float], health_marks: dict[str, tuple[int, int]]) -> str:
    """`step 40/100  epoch 0.02  loss 2.95  lr 1.0e-04  18,735 tok/s  109 ms/step  ...  ETA 0m07s`,
    then any alert and what the health check saw so far (event -> (count, last step))."""
    step_s = metrics["time/step_s"]
    shown = {**metrics, "ms/step": step_s * 1000}
    parts = [f"step {step:>{len(str(total_steps))}}/{total_steps}"]
    parts += [fmt.format(shown[name]) for name, fmt in _SHOWN if name in shown]
    parts.append(f"ETA {duration(step_s * max(0, total_steps - step))}")
    if metrics.get("alert/slowdown"):
        parts.append(f"SLOWDOWN x{metrics.get('alert/slowdown_ratio', math.nan):.2f}")
    if metrics.get("alert/stall"):
        cause = next((k.rsplit("/", 1)[1] for k in metrics if k.startswith("alert/stall_cause/")), "unknown")
        parts.append(f"STALL x{metrics.get('alert/stall_ratio', math.nan):.1f} ({STALL_CAUSES[cause]})")
    for event, (count, last) in health_marks.items():
        parts.append(f"{count} {event}{'s' if count > 1 else ''} (last at step {last})")
    return "  ".join(parts)
