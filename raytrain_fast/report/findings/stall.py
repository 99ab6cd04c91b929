"""Stalls: single windows far slower than the ones before them, with their cause."""

from __future__ import annotations

from typing import Any

from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.metrics.slowdown import STALL_CAUSES, Stall, StallDetector, Window
from raytrain_fast.report.finding import Finding, duration, ms, pct
from raytrain_fast.report.load import RunMetrics


# Stalls: the run's stall detector (metrics/slowdown.py, factor metrics.stall_factor) replayed over
# the steady windows. A finding when the stalled windows lost at least 1% of the run's wall time or
# one of them lost a minute: a blip in a week-long run is left to the live alert.
STALL_MIN_SHARE = 0.01
STALL_MIN_LOST_S = 60.0


def record_window(record: dict[str, Any], steps: int) -> Window:
    """A log record as the detectors' Window (seconds per step)."""
    step_s = record["time/step_s"]
    return Window(
        step=record["step"], step_s=step_s, num_steps=steps,
        data_wait_s=record.get("time/data_wait_frac", 0.0) * step_s,
        gc_s=record.get("gc/collect_s", 0.0) / steps,
        checkpoint_s=record.get("checkpoint/blocked_s", 0.0) / steps,
        memory_gb=record.get("memory/current_gb", 0.0),
        cpu_wait_frac=record.get("host/cpu_wait_frac"),
    )


def replay_stalls(run: RunMetrics) -> tuple[list[Stall], dict[int, float]]:
    """The stalls of the steady windows (the run's own stall detector replayed with its factor), and
    the step time it held each window to (step -> seconds; none for the first windows, its median's)."""
    detector = StallDetector(factor=stall_factor(run), warmup_steps=0)
    windows = run.window_steps()
    stalls, thresholds = [], {}
    for record in run.steady:
        if "time/step_s" in record:
            stall = detector.update(record_window(record, windows[record["step"]]))
            if stall is not None:
                stalls.append(stall)
            if detector.threshold_s is not None:
                thresholds[record["step"]] = detector.threshold_s
    return stalls, thresholds


_STALL_ADVICE = {
    "cpu": "keep other CPU-heavy work off the training nodes while they train, or run it at low priority (`nice -n 19 ...`)",
    "data_wait": "see the data advice: prefetch more (data.prefetch_batches), more CPUs per worker, prepared shards near the workers",
    "checkpoint": "use checkpoint.upload=async and check the storage's write speed around those steps",
    "gc": "keep metrics.gc_every on, and look for many Python objects made per step",
    "unknown": "look at the node around those steps: other jobs, storage or network hiccups, throttling",
}


def find(run: RunMetrics) -> Finding | str | None:
    if not run.has("time/step_s"):
        return "stalls: time/step_s was not recorded"
    stalls, _ = replay_stalls(run)
    if not stalls:
        return None
    windows = run.window_steps()
    lost = sum(s.lost_s * windows[s.step] for s in stalls)
    wall = sum(r.get("time/step_s", 0.0) * windows[r["step"]] for r in run.records)
    share = lost / wall if wall > 0 else 0.0
    worst = max(stalls, key=lambda s: s.lost_s * windows[s.step])
    if share < STALL_MIN_SHARE and worst.lost_s * windows[worst.step] < STALL_MIN_LOST_S:
        return None
    causes = sorted({s.cause for s in stalls}, key=lambda c: -sum(x.lost_s * windows[x.step] for x in stalls if x.cause == c))
    listed = ", ".join(f"{s.step} ({s.ratio:.1f}x, {STALL_CAUSES[s.cause]})" for s in stalls[:8])
    evidence = [
        f"{len(stalls)} log window{'s' if len(stalls) > 1 else ''} took more than {stall_factor(run):.1f}x the median of the windows "
        f"before {'them' if len(stalls) > 1 else 'it'}: the windows ending at step {listed}" + (" ..." if len(stalls) > 8 else ""),
        f"those windows lost {duration(lost)} against their neighbours: {pct(share)} of {duration(wall)} of logged training time",
        f"worst: the window ending at step {worst.step}, {ms(worst.step_s)} per step against {ms(worst.base_s)}",
    ]
    live = [s for s, v in zip(*run.series("alert/stall")) if v >= 1]
    if live:
        evidence.append(f"the run's live alert (alert/stall) fired at steps {', '.join(map(str, live[:8]))}")
    return Finding(
        key="stall", title=f"Stalls: {len(stalls)} log window{'s' if len(stalls) > 1 else ''} far slower than the rest, likely cause: {STALL_CAUSES[causes[0]]}",
        evidence=evidence, advice=[_STALL_ADVICE[c] for c in causes],
        numbers={"lost_s": lost, "lost_share": share, "windows": float(len(stalls)), "first_step": float(stalls[0].step), "last_step": float(stalls[-1].step)},
    )


def stall_factor(run: RunMetrics) -> float:
    return float(run.setting("metrics", "stall_factor", MetricsConfig.stall_factor))
