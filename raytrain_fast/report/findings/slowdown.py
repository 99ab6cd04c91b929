"""Progressive slowdown: the step time grows over the run, and the signal that grew with it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from raytrain_fast.metrics.slowdown import SlowdownDetector, Window, largest_cause, signal_s
from raytrain_fast.report.finding import Finding, ms
from raytrain_fast.report.findings.stall import record_window
from raytrain_fast.report.load import RunMetrics, median


# Progressive slowdown: the run's own detector (metrics.slowdown_threshold, default 10%) raised
# alert/slowdown in at least three log windows (its rolling median already needs two slow windows
# out of three), and the step time in those windows is at least 15% above the baseline: a burst of
# other work on a shared machine slows a window or two, not that many.
SLOWDOWN_MIN_WINDOWS = 3
SLOWDOWN_MIN_RATIO = 1.15

# Runs without the detector's metrics (shorter than its warm-up): the report replays the same
# detector (metrics/slowdown.py) over the steady windows, its baseline the median of the first
# SLOWDOWN_ROLLING of them, its rolling median over SLOWDOWN_ROLLING windows, with a higher bar.
SLOWDOWN_FALLBACK_RATIO = 1.25
SLOWDOWN_ROLLING = 3


@dataclass(kw_only=True)
class _Slowdown:
    """A slowdown as the report sees it: from the run's own detector metrics, or from replaying the
    same detector over the records."""

    since: int
    ratio: float
    """Rolling median step time / baseline when it started."""
    steps: list[int]
    """The log steps of the slow windows."""
    source: str
    """Where the numbers come from, in words (the finding's first line of evidence)."""
    detector_cause: str | None = None
    """The cause the run's detector named (alert/slowdown_cause/<cause>), if it named one."""


def find(run: RunMetrics) -> Finding | str | None:
    steps, step_s = run.series("time/step_s", steady=True)
    if len(step_s) < 2 * SLOWDOWN_ROLLING:
        return f"progressive slowdown: needs at least {2 * SLOWDOWN_ROLLING} log windows after warm-up, the run has {len(step_s)}"
    by_step = {r["step"]: r for r in run.records}
    slowdown = _detector_slowdown(run, by_step) if run.has("alert/slowdown") else _replayed_slowdown(run, steps, step_s)
    if slowdown is None:
        return None
    before = [by_step[s] for s in steps if s < slowdown.since][:max(SLOWDOWN_ROLLING, 1)] or [by_step[steps[0]]]
    after = [by_step[s] for s in slowdown.steps if "time/step_s" in by_step.get(s, {})]
    if not after:
        return None
    return _slowdown_finding(run, slowdown, before, after)


def _detector_slowdown(run: RunMetrics, by_step: dict[int, dict[str, Any]]) -> _Slowdown | None:
    """The run's own detector (alert/slowdown) was on long enough, far enough above its baseline."""
    alert_steps = [s for s, v in zip(*run.series("alert/slowdown")) if v >= 1]
    ratios = [by_step[s].get("alert/slowdown_ratio", math.nan) for s in alert_steps]
    ratio = median([r for r in ratios if not math.isnan(r)])
    if len(alert_steps) < SLOWDOWN_MIN_WINDOWS or not ratio >= SLOWDOWN_MIN_RATIO:
        return None
    causes = [
        name.removeprefix("alert/slowdown_cause/")
        for s in alert_steps for name in by_step[s] if name.startswith("alert/slowdown_cause/")
    ]
    source = (
        f"the run's slowdown detector (alert/slowdown) was on in {len(alert_steps)} log windows from step {alert_steps[0]}; "
        f"step time there is a median {ratio:.2f}x the baseline taken after warm-up (alert/slowdown_ratio)"
    )
    return _Slowdown(
        since=alert_steps[0], ratio=ratio, steps=alert_steps, source=source, detector_cause=causes[0] if causes else None
    )


def _replayed_slowdown(run: RunMetrics, steps: list[int], step_s: list[float]) -> _Slowdown | None:
    """Runs without the detector's metrics: the same detector (metrics/slowdown.py) replayed over the
    steady windows with the report's own thresholds. A slowdown it no longer sees at the end recovered:
    not progressive."""
    detector = SlowdownDetector(
        threshold=SLOWDOWN_FALLBACK_RATIO - 1.0, num_windows=SLOWDOWN_ROLLING, warmup_steps=run.warmup_steps
    )
    alerts = [detector.update(Window(step=step, step_s=seconds))[1] for step, seconds in zip(steps, step_s)]
    first = next((alert for alert in alerts if alert is not None), None)
    if first is None or not detector.alerting:
        return None
    source = (
        f"median step time of {SLOWDOWN_ROLLING} windows rose to {first.ratio:.2f}x the first steady windows at step "
        f"{first.since_step} and ends at {detector.last_ratio:.2f}x (the run had no slowdown-detector metrics: "
        f"the report ran the same detector over its records, threshold {SLOWDOWN_FALLBACK_RATIO:.2f}x)"
    )
    return _Slowdown(
        since=first.since_step, ratio=first.ratio, steps=[s for s in steps if s >= first.since_step], source=source
    )


_SLOWDOWN_CAUSES = {
    "cpu": (
        "other processes took the CPU: a compute thread waited for a core more of the time (host/cpu_wait_frac)",
        "keep CPU-heavy work off the training nodes, or run it with `nice -n 19`; check host/niceness is 0",
    ),
    "data_wait": ("the data pipeline: waiting for the next batch grew", "see the data advice: prefetch more, more CPUs per worker, prepared shards near the workers"),
    "gc": ("Python garbage collection pauses grew", "keep metrics.gc_every on (not 0); look for objects kept across steps (lists of tensors, growing caches)"),
    "checkpoint": ("checkpoint stalls grew", "use checkpoint.upload=async, save less often, or check the storage's write speed"),
    "sink": ("the metric sinks fell behind", "log less often (train.log_every) or use W&B offline"),
    "memory": ("memory kept growing", "look for tensors kept across steps (e.g. `loss_sum += loss` without .detach())"),
    "unexplained": (
        "nothing the loop measures: the compute itself got slower",
        "check for other processes on the nodes, thermal or power throttling, a straggler rank or a slower interconnect",
    ),
}


def _slowdown_finding(
    run: RunMetrics, slowdown: _Slowdown, before: list[dict[str, Any]], after: list[dict[str, Any]]
) -> Finding:
    step_before, step_after = median([r["time/step_s"] for r in before]), median([r["time/step_s"] for r in after])
    extra = step_after - step_before
    growth = _growth(run, before, after)
    # The report's own reading, by the detector's rule: the measured signal that grew most, if it
    # explains a quarter of the extra step time; else nothing the loop measures.
    own_cause = largest_cause({key: grew for key, (_, _, grew) in growth.items()}, extra) or "unexplained"
    cause = slowdown.detector_cause
    if cause is None or (cause == "sink" and own_cause == "unexplained"):
        # A sink runs off the training thread: its drops and backlog cost no step time. The
        # detector names it when nothing else explains the slowdown; the seconds are the better guide.
        cause = own_cause
    since = slowdown.since
    evidence = [slowdown.source, f"step time {ms(step_before)} before step {since}, {ms(step_after)} since"]
    labels = {"data_wait": "data wait", "checkpoint": "checkpoint blocked", "gc": "GC", "cpu": "waiting for a CPU (host/cpu_wait_frac)"}
    for key, (old, new, _) in growth.items():
        evidence.append(f"{labels[key]} {ms(old)} -> {ms(new)} per step")
    _, mem = run.series("memory/current_gb")
    if mem:
        evidence.append(f"memory in use {mem[0]:.2f} GB at the start, {mem[-1]:.2f} GB at the end (memory/current_gb)")
    if extra > 0:
        explained = sum(max(0.0, grew) for _, _, grew in growth.values())
        evidence.append(f"of the {ms(extra)} extra per step, the signals above together explain {ms(min(explained, extra))}")
    what, fix = _SLOWDOWN_CAUSES.get(cause, _SLOWDOWN_CAUSES["unexplained"])
    line = f"likely cause: {what}"
    if slowdown.detector_cause == cause:
        line += f" (the run's detector agrees: alert/slowdown_cause/{cause})"
    elif slowdown.detector_cause:
        line += (
            f" (the run's detector named '{slowdown.detector_cause}' because records were dropped, but a sink works "
            "off the training thread and costs no step time)"
        )
    evidence.append(line)
    return Finding(
        key="slowdown", title=f"Progressive slowdown: steps are {slowdown.ratio:.2f}x slower since step {since}",
        evidence=evidence, advice=[fix], numbers={"since_step": float(since), "ratio": slowdown.ratio},
    )


def _growth(run: RunMetrics, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, tuple[float, float, float]]:
    """Per-step seconds of each measured signal before and after: key -> (before, after, growth)."""
    windows = run.window_steps()
    before_s, after_s = ([signal_s(record_window(r, windows[r["step"]])) for r in rs] for rs in (before, after))
    result = {}
    for signal in ("data_wait", "checkpoint", "gc", "cpu"):  # the records hold no sink-thread CPU
        old, new = (median([v for s in signals if (v := s[signal]) is not None]) for signals in (before_s, after_s))
        if not math.isnan(old + new) and (old > 0 or new > 0):  # NaN: not measured before or after
            result[signal] = (old, new, new - old)
    return result
