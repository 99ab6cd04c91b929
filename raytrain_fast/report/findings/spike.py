"""Loss spikes: windows whose loss jumped far above the ones before."""

from __future__ import annotations

import math

from raytrain_fast.report.finding import Finding
from raytrain_fast.report.load import RunMetrics, median


def find(run: RunMetrics) -> list[Finding]:
    """The loss or gradient-norm spikes the health check recorded (health/spike), in one finding:
    each spike's loss and gradient norm beside the median of the windows before it."""
    spikes = [r for r in run.records if r.get("health/spike")]
    if not spikes:
        return []
    policy = run.setting("health", "on_spike", "warn")
    rolled_back = {int(r["detected_step"]) for r in run.rollbacks if "spike" in str(r.get("what", ""))}
    evidence = []
    for spike in spikes[:8]:
        before = [r for r in run.records if "train/loss" in r and r["step"] < spike["step"]][-10:]
        level = median([r["train/loss"] for r in before])
        grads = median([r["train/grad_norm"] for r in before if "train/grad_norm" in r])
        evidence.append(
            f"step {spike['step']}: loss {spike.get('health/spike_loss', math.nan):.4g} (median of the 10 windows before: {level:.4g}), "
            f"grad norm {spike.get('health/spike_grad_norm', math.nan):.4g} (before: {grads:.4g})"
            + ("; rolled back" if spike["step"] in rolled_back else "")
        )
    if len(spikes) > 8:
        evidence.append(f"... and {len(spikes) - 8} more")
    evidence.append(f"a spike is a window above median + {run.setting('health', 'spike_mads', '?')} x MAD of the last "
                    f"{run.setting('health', 'spike_windows', '?')} windows (health.spike_mads, health.spike_windows); policy: {policy}")
    steps = [int(s["step"]) for s in spikes]
    return [Finding(
        key="spike", title=f"Loss spike{'s' if len(spikes) > 1 else ''} at step{'s' if len(spikes) > 1 else ''} " + ", ".join(map(str, steps[:8]))
        + (" ..." if len(steps) > 8 else ""),
        evidence=evidence,
        advice=[
            "spikes that recur point at the learning rate: lower optim.lr or lengthen optim.warmup_steps; tighten optim.grad_clip",
            "a single spike that the loss recovers from costs little; health.on_spike: rollback goes back and skips the window's data instead",
        ],
        numbers={"spikes": float(len(spikes)), "first_step": float(steps[0])},
    )]
