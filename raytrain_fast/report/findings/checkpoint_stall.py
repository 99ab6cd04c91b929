"""Checkpoint stalls: saves that block training too long."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, duration, pct
from raytrain_fast.report.load import RunMetrics, median


# Checkpoint stalls: training blocked by checkpoints for more than 5% of the wall time (the cost of
# checkpointing should be a small tax), or any single checkpoint blocking longer than 60 s.
CHECKPOINT_BLOCKED_SHARE = 0.05
CHECKPOINT_MAX_BLOCK_S = 60.0


def find(run: RunMetrics) -> Finding | str | None:
    steps, blocked = run.series("checkpoint/blocked_s")
    if not blocked:
        return "checkpoint stalls: no checkpoint was saved between two log steps (checkpoint/blocked_s absent)"
    windows = run.window_steps()
    every = run.setting("checkpoint", "every_steps")
    counts = [len(run.saves_in_window(step)) for step in steps]  # blocked_s is per checkpoint saved in the window
    total_blocked, num_checkpoints = sum(s * c for s, c in zip(blocked, counts)), sum(counts)
    wall = sum(r.get("time/step_s", 0.0) * windows[r["step"]] for r in run.records)
    share = total_blocked / wall if wall > 0 else 0.0
    worst = max(blocked)
    if share <= CHECKPOINT_BLOCKED_SHARE and worst <= CHECKPOINT_MAX_BLOCK_S:
        return None
    upload = run.setting("checkpoint", "upload")
    evidence = [
        f"training was blocked {duration(total_blocked)} by {num_checkpoints} checkpoints: {pct(share)} of "
        f"{duration(wall)} of logged training time (threshold {pct(CHECKPOINT_BLOCKED_SHARE)})",
        f"per checkpoint: median {duration(median(blocked))}, worst {duration(worst)} (checkpoint/blocked_s; "
        f"a single block above {CHECKPOINT_MAX_BLOCK_S:.0f} s is a finding on its own)",
    ]
    _, uploads = run.series("checkpoint/upload_s")
    if uploads:
        evidence.append(f"uploads took a median {duration(median(uploads))} (checkpoint/upload_s)")
    if upload:
        evidence.append(f"checkpoint.upload is {upload}" + (f", checkpoint.every_steps {every}" if every is not None else ""))
    advice = []
    if upload == "sync" or upload is None:
        advice.append("upload in the background: checkpoint.upload=async (training then waits only for the local save)")
    _, step_s = run.series("time/step_s", steady=True)
    if isinstance(every, int) and every > 0 and step_s:
        advice.append(
            f"save less often: checkpoint.every_steps={every} is a save every {duration(every * median(step_s))} "
            f"of training; e.g. every_steps={every * 5} or checkpoint.every_minutes"
        )
    else:
        advice.append("save less often (checkpoint.every_steps or checkpoint.every_minutes)")
    if uploads and upload == "async":
        advice.append("with async upload, a save still waits for the previous upload: a faster bucket or fewer saves removes that wait")
    return Finding(
        key="checkpoint_stall", title=f"Checkpoint stalls: training blocked {pct(share)} of the time by checkpoints",
        evidence=evidence, advice=advice,
        numbers={"blocked_share": share, "worst_block_s": worst, "num_checkpoints": float(num_checkpoints)},
    )
