"""Memory under-used: a larger micro-batch would fit."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, pct
from raytrain_fast.report.load import RunMetrics


# Memory under-used: the peak stays below half of the device memory (or the configured budget):
# a micro-batch about twice as large would fit, and larger micro-batches run closer to peak FLOP/s.
MEMORY_UNDERUSED_FRAC = 0.5


def find(run: RunMetrics) -> Finding | str | None:
    _, fracs = run.series("memory/peak_frac")
    if not fracs:
        return (
            "memory use: memory/peak_frac was not recorded (it needs a GPU or a CPU memory budget), "
            "so how much memory is left cannot be judged"
        )
    peak_frac = max(fracs)
    if peak_frac >= MEMORY_UNDERUSED_FRAC:
        return None
    _, peak_gb = run.series("memory/peak_gb")
    evidence = [f"peak memory is {pct(peak_frac)} of what is available (memory/peak_frac, threshold {pct(MEMORY_UNDERUSED_FRAC)})"]
    if peak_gb and peak_frac > 0:
        total = max(peak_gb) / peak_frac
        evidence[0] += f": {max(peak_gb):.2f} GB of {total:.1f} GB"
    budget = run.setting("resources", "memory_budget_gb")
    evidence.append(
        "available = the device's memory on GPU, resources.memory_budget_gb on CPU"
        + (f" (set to {budget} GB)" if budget is not None else "")
    )
    micro = run.setting("train", "micro_batch")
    if micro is not None:
        evidence.append(f"train.micro_batch is {micro}")
    if micro is not None and micro == run.auto_micro_batch:
        evidence[-1] += ", the fastest that fits by `train.micro_batch: auto`'s measurement"
        advice = [
            "`auto` already measured the larger micro-batches that divide the global batch as slower or not fitting; "
            "the spare memory is headroom. To use it, raise train.global_batch (larger micro-batches become possible) "
            "or train a larger model",
        ]
    else:
        advice = [
            "use a larger micro-batch with less gradient accumulation at the same global batch: set "
            "`train.micro_batch: auto` to pick the fastest that fits, or compare settings with "
            "`raytrain-fast sweep --micro-batch 4,8,16` before a long run",
        ]
    return Finding(
        key="memory_underused", title=f"Memory under-used: the peak is only {pct(peak_frac)} of the memory available",
        evidence=evidence, advice=advice, numbers={"peak_frac": peak_frac},
    )
