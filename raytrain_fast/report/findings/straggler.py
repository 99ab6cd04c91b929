"""Stragglers: one rank reaches the log step late in most windows."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, ms, pct
from raytrain_fast.report.findings.data_bound import DATA_WAIT_RANK_GAP
from raytrain_fast.report.load import RunMetrics, median


# Stragglers: the slowest rank reaches the log step more than 10% of a step after the fastest, in
# at least two thirds of the steady windows. Ranks meet in a collective every step, so a healthy gap
# is a few percent; on a busy machine single windows reach 15%, but not most of them.
STRAGGLER_SHARE = 0.10
STRAGGLER_MIN_WINDOWS = 2 / 3


def find(run: RunMetrics) -> Finding | str | None:
    if not run.has("time/step_s_rank_spread"):
        ranks = run.world_size
        if ranks == 1 or ranks is None:
            return "stragglers: a single-rank run (time/step_s_rank_spread is recorded only with several ranks)"
        return "stragglers: time/step_s_rank_spread was not recorded"
    windows = run.window_steps()
    gaps, shares = [], []
    for r in run.steady:
        if "time/step_s_rank_spread" in r and r.get("time/step_s", 0) > 0:
            # The metric is the arrival gap at the log step divided by the window's steps: undo that,
            # because ranks meet in a collective every step and the gap is the last step's lag.
            gap = r["time/step_s_rank_spread"] * windows[r["step"]]
            gaps.append(gap)
            shares.append(gap / r["time/step_s"])
    if not shares:
        return "stragglers: no steady window has time/step_s_rank_spread"
    share = median(shares)
    above = sum(s > STRAGGLER_SHARE for s in shares)
    if above < STRAGGLER_MIN_WINDOWS * len(shares):
        return None
    evidence = [
        f"in the median window the slowest rank reached the log step {ms(median(gaps))} after the fastest: "
        f"{pct(share)} of a step (threshold {pct(STRAGGLER_SHARE)}; time/step_s_rank_spread x steps per window)",
        f"{above} of {len(shares)} windows after warm-up are above the threshold (a finding needs {STRAGGLER_MIN_WINDOWS:.0%})",
        "every rank waits for the slowest one at each step's gradient all-reduce, so the whole run goes at its pace",
    ]
    _, high = run.series("time/data_wait_frac", steady=True)
    _, low = run.series("time/data_wait_frac_rank_min", steady=True)
    if high and low and median(high) - median(low) > DATA_WAIT_RANK_GAP:
        evidence.append(f"data wait differs across ranks ({pct(median(low))} to {pct(median(high))}): the late rank waits for its data")
        advice = ["look at that rank's data path (its node's disk or network, its shards) and prefetch more (data.prefetch_batches)"]
    else:
        evidence.append("data wait is alike on every rank, so the late rank computes or communicates more slowly")
        advice = [
            "look for other processes on the late rank's node (CPU or GPU shared), thermal or power throttling, or a slower link",
            "keep metrics.gc_every on: it makes every rank collect garbage at the same step",
        ]
    return Finding(
        key="straggler", title=f"Straggler: one rank arrives {pct(share)} of a step late",
        evidence=evidence, advice=advice, numbers={"share": share, "gap_s": median(gaps)},
    )
