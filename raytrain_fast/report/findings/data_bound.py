"""Data-bound: the step waits for its next batch."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, ms, pct, setting_note, steady_note
from raytrain_fast.report.load import RunMetrics, median


# --- thresholds ----------------------------------------------------------------------------------
# Data-bound: the median window spends more than 10% of its time waiting for the next batch. The
# design target is <= 2%; 10% is far beyond noise (a clean CPU run measures well under 1%) and is
# a tenth of the run's speed, enough to be worth fixing.
DATA_WAIT_FRAC = 0.10

# One rank waiting for data this much more than the least-waiting rank (median) points at that rank.
DATA_WAIT_RANK_GAP = 0.05


def find(run: RunMetrics) -> Finding | str | None:
    steps, fracs = run.series("time/data_wait_frac", steady=True)
    if not fracs:
        return "data wait: time/data_wait_frac was not recorded"
    share = median(fracs)
    if share <= DATA_WAIT_FRAC:
        return None
    step_s = median(run.series("time/step_s", steady=True)[1])  # NaN without
    wait_s = share * step_s
    above = sum(f > DATA_WAIT_FRAC for f in fracs)
    evidence = [
        f"median time/data_wait_frac {pct(share)} (threshold {pct(DATA_WAIT_FRAC)}, target 2%) over "
        f"{steady_note(run, len(fracs))}; {above} of {len(fracs)} windows above the threshold, worst {pct(max(fracs))}",
        f"about {ms(wait_s)} of each {ms(step_s)} step is spent waiting for the next batch",
        f"removing the wait would make training about {1 / (1 - min(share, 0.99)):.2f}x faster",
    ]
    numbers = {"data_wait_frac": share, "step_s": step_s}
    _, rank_min = run.series("time/data_wait_frac_rank_min", steady=True)
    gap = share - median(rank_min) if rank_min else 0.0
    if rank_min:
        evidence.append(
            f"the rank that waits least waits {pct(median(rank_min))}"
            + (": one rank's data is slow (its node, its storage path or its shards)" if gap > DATA_WAIT_RANK_GAP else ": every rank waits alike")
        )
    advice = [
        f"prefetch more batches: data.prefetch_batches{setting_note(run, 'data', 'prefetch_batches')}, e.g. double it",
        f"give each worker more CPU cores for reading and collating: resources.cpus_per_worker{setting_note(run, 'resources', 'cpus_per_worker')}",
        "feed prepared Parquet shards (`raytrain-fast prepare-data`) rather than raw text, and keep them near the workers (same region / endpoint)",
    ]
    return Finding(
        key="data_bound", title=f"Data-bound: training waits for data {pct(share)} of the time",
        evidence=evidence, advice=advice, numbers=numbers,
    )
