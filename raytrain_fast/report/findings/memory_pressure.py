"""Host memory pressure: the node's memory, its swap or the run's budget nearly full."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, pct, setting_note
from raytrain_fast.report.load import RunMetrics


# Host memory pressure: the node's memory above 90% in use, swap growing by 0.1 GB or more, or a CPU
# run's process above 90% of resources.memory_budget_gb: the next allocation pages out or fails.
MEMORY_PRESSURE_FRAC = 0.90
SWAP_GROWTH_GB = 0.1


def find(run: RunMetrics) -> Finding | str | None:
    checks = {
        "host/memory_used_frac": "the node's memory in use",
        "host/memory_budget_frac": "the process's memory against resources.memory_budget_gb",
    }
    if not any(run.has(m) for m in (*checks, "host/swap_used_gb")):
        return "host memory: host/memory_used_frac and host/swap_used_gb were not recorded"
    evidence, numbers = [], {}
    for metric, what in checks.items():
        steps, values = run.series(metric, steady=True)
        high = [(s, v) for s, v in zip(steps, values) if v > MEMORY_PRESSURE_FRAC]
        if high:
            evidence.append(
                f"{what} was above {pct(MEMORY_PRESSURE_FRAC)} in {len(high)} of {len(values)} steady windows, "
                f"from step {high[0][0]}, up to {pct(max(v for _, v in high))} ({metric})"
            )
            numbers[metric] = max(v for _, v in high)
    _, swap = run.series("host/swap_used_gb")
    if swap and swap[-1] - min(swap) >= SWAP_GROWTH_GB:
        evidence.append(f"swap in use grew from {min(swap):.2f} GB to {swap[-1]:.2f} GB (host/swap_used_gb): memory is being paged out")
        numbers["swap_growth_gb"] = swap[-1] - min(swap)
    if not evidence:
        return None
    _, current = run.series("memory/current_gb")
    if current:
        evidence.append(f"the training process used {current[0]:.2f} GB at the start and {current[-1]:.2f} GB at the end (memory/current_gb)")
    advice = [
        f"lower the training process's memory: a smaller train.micro_batch{setting_note(run, 'train', 'micro_batch')} "
        f"with more accumulation, fewer data.prefetch_batches{setting_note(run, 'data', 'prefetch_batches')}",
    ]
    if numbers.keys() - {"host/memory_budget_frac"}:  # the node itself is short of memory
        advice.insert(0, "find what else holds memory on the node (other jobs, a notebook) and stop it, or train on a node with more memory")
    if "host/memory_budget_frac" in numbers:
        advice.append(f"or raise resources.memory_budget_gb{setting_note(run, 'resources', 'memory_budget_gb')} if the node has the memory")
    return Finding(
        key="memory_pressure", title="Host memory pressure: training runs close to the memory it has",
        evidence=evidence, advice=advice, numbers=numbers,
    )
