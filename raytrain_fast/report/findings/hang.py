"""Hangs: a worker group that stopped stepping, and the time it cost."""

from __future__ import annotations

import math

from raytrain_fast.report.finding import Finding, duration, median_step_s
from raytrain_fast.report.load import RunMetrics


def find(run: RunMetrics) -> list[Finding]:
    """One finding per hang the watchdog acted on (watchdog/stacks.py): the rank, the top of its
    stack, and the time lost: the time stuck plus the steps trained again from the checkpoint."""
    resumed = {int(v): s for s, v in zip(*run.series("hang/step"))}
    step_s = median_step_s(run)
    findings = []
    for hang in run.hangs:
        ranks = hang.get("stuck_ranks") or []
        resumed_at = resumed.get(int(hang["step"]))
        redone = hang["step"] - resumed_at if resumed_at is not None else None
        lost = hang["stuck_s"] + (redone * step_s if redone is not None and not math.isnan(step_s) else 0.0)
        waiting = hang.get("waiting_ranks") or []
        evidence = [
            f"no rank completed a step after step {hang['step']} for {duration(hang['stuck_s'])} (timeout {duration(hang['timeout_s'])})",
            f"stuck: rank {', '.join(map(str, ranks))}" + (f"; rank {', '.join(map(str, waiting))} waited in a collective" if waiting else ""),
            *[f"top of the stack of rank {r}: {hang['ranks'][str(r)]['top']}" for r in ranks],
            f"every rank's stack: {run.uri}/{hang['stacks_file']}",
            f"the worker group restarted from the checkpoint at step {resumed_at} and trained {redone} steps again" if redone is not None
            else "the worker group restarted from its newest checkpoint",
            f"time lost: about {duration(lost)}",
        ]
        findings.append(Finding(
            key="hang", title=f"Hang at step {hang['step']}: rank {', '.join(map(str, ranks))} stuck, about {duration(lost)} lost",
            evidence=evidence,
            advice=[
                "read the stuck rank's stack: a data read, a storage call or a kernel that never returns; the others only wait for it",
                "a rank frozen by the system (swap, a stopped process, a failing GPU): check that node's logs around that time",
            ],
            numbers={"step": float(hang["step"]), "rank": float(ranks[0]) if ranks else -1.0, "stuck_s": float(hang["stuck_s"]), "lost_s": lost},
        ))
    return findings
