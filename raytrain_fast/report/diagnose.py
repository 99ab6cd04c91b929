"""A plain-language diagnosis of a run from its metrics: each finding says what is wrong, the numbers
it rests on, and what to change.

Every rule judges the steady part of the run (warm-up and the first window after a resume left out,
see load.py) with medians, so one noisy log window on a busy machine never makes a finding. A rule
whose metrics the run does not have is skipped and the diagnosis says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from raytrain_fast.metrics.slowdown import STALL_CAUSES, SlowdownDetector, Stall, StallDetector, Window, largest_cause
from raytrain_fast.report.load import RunMetrics, median

# --- thresholds ----------------------------------------------------------------------------------
# Data-bound: the median window spends more than 10% of its time waiting for the next batch. The
# design target is <= 2%; 10% is far beyond noise (a clean CPU run measures well under 1%) and is
# a tenth of the run's speed, enough to be worth fixing.
DATA_WAIT_FRAC = 0.10
# One rank waiting for data this much more than the least-waiting rank (median) points at that rank.
DATA_WAIT_RANK_GAP = 0.05
# Sink backlog: a healthy sink thread has written each record before the next log step, so the
# backlog at a log step is 0. Three or more records waiting in at least two steady windows means it
# is persistently several windows behind; any dropped record or sink error is a finding too.
SINK_BACKLOG_RECORDS = 3
SINK_BACKLOG_WINDOWS = 2
# Memory under-used: the peak stays below half of the device memory (or the configured budget):
# a micro-batch about twice as large would fit, and larger micro-batches run closer to peak FLOP/s.
MEMORY_UNDERUSED_FRAC = 0.5
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
# Checkpoint stalls: training blocked by checkpoints for more than 5% of the wall time (the cost of
# checkpointing should be a small tax), or any single checkpoint blocking longer than 60 s.
CHECKPOINT_BLOCKED_SHARE = 0.05
CHECKPOINT_MAX_BLOCK_S = 60.0
# Stragglers: the slowest rank reaches the log step more than 10% of a step after the fastest, in
# at least two thirds of the steady windows. Ranks meet in a collective every step, so a healthy gap
# is a few percent; on a busy machine single windows reach 15%, but not most of them.
OVERFIT_RISES = 2
"""Evaluations in a row with a higher val/loss than the one before, ending at the last one."""
OVERFIT_MIN_RISE = 0.01
"""...and the last val/loss at least this much (relative) above the run's lowest."""
STRAGGLER_SHARE = 0.10
STRAGGLER_MIN_WINDOWS = 2 / 3
# Stalls: the run's stall detector (metrics/slowdown.py, factor metrics.stall_factor) replayed over
# the steady windows. A finding when the stalled windows lost at least 1% of the run's wall time or
# one of them lost a minute: a blip in a week-long run is left to the live alert.
STALL_MIN_SHARE = 0.01
STALL_MIN_LOST_S = 60.0
DEFAULT_STALL_FACTOR = 2.5
# Host contention: a compute thread (training or torch OpenMP) waited for a CPU at least a quarter of the window
# (host/cpu_wait_frac; a few percent on a node with nothing else running) in at least two steady
# windows and at least 5% of them, and at least 3 s in all: over the 50 ms windows of a tiny test
# model one scheduling hiccup reads as 40%.
CONTENTION_WAIT_FRAC = 0.25
CONTENTION_MIN_WINDOWS = 2
CONTENTION_MIN_SHARE = 0.05
CONTENTION_MIN_WAIT_S = 3.0
# Host memory pressure: the node's memory above 90% in use, swap growing by 0.1 GB or more, or a CPU
# run's process above 90% of resources.memory_budget_gb: the next allocation pages out or fails.
MEMORY_PRESSURE_FRAC = 0.90
SWAP_GROWTH_GB = 0.1


@dataclass(kw_only=True)
class Finding:
    key: str
    """data_bound, sink_backlog, memory_underused, slowdown, checkpoint_stall, straggler, stall,
    host_contention, memory_pressure, overfitting, corpus_repeated, hang, divergence or spike."""
    title: str
    evidence: list[str]
    """The numbers the finding rests on, in words."""
    advice: list[str]
    """What to change."""
    numbers: dict[str, float] = field(default_factory=dict)


@dataclass(kw_only=True)
class Diagnosis:
    findings: list[Finding]
    skipped: list[str]
    """Checks that could not run, and why (missing metrics, a single rank...)."""
    summary: dict[str, str]
    """Headline numbers of the run (label -> formatted value), for the terminal and the HTML table."""

    def keys(self) -> list[str]:
        return [f.key for f in self.findings]

    def to_text(self, run: RunMetrics) -> str:
        lines = [f"Run '{run.name}' ({run.uri}):"]
        width = max(len(k) for k in self.summary) if self.summary else 0
        lines += [f"  {label:<{width}}  {value}" for label, value in self.summary.items()]
        lines.append("")
        if not self.findings:
            lines.append("Diagnosis: no problems found in the steady part of the run.")
        else:
            lines.append(f"Diagnosis: {len(self.findings)} finding{'s' if len(self.findings) > 1 else ''}.")
        for number, finding in enumerate(self.findings, 1):
            lines.append("")
            lines.append(f"{number}. {finding.title}")
            lines += [f"   - {item}" for item in finding.evidence]
            lines += [f"   Change: {item}" for item in finding.advice]
        if self.skipped:
            lines.append("")
            lines.append("Not checked:")
            lines += [f"  - {item}" for item in self.skipped]
        return "\n".join(lines)


def diagnose(run: RunMetrics) -> Diagnosis:
    # A hang, a divergence or a spike is a finding however short the run.
    findings: list[Finding] = [*_hangs(run), *_divergence(run), *_spikes(run)]
    skipped: list[str] = []
    if not run.steady:
        skipped.append(
            f"everything: the run logged {len(run.records)} record(s), all within warm-up (up to step "
            f"{run.warmup_steps}); train longer or log more often (train.log_every)"
        )
        return Diagnosis(findings=findings, skipped=skipped, summary=summarize(run))
    for rule in (
        _data_bound, _sink_backlog, _memory_underused, _slowdown, _checkpoint_stall, _straggler,
        _stall, _host_contention, _memory_pressure,
        _overfitting, _corpus_repeated,
    ):
        result = rule(run)
        if isinstance(result, Finding):
            findings.append(result)
        elif isinstance(result, str):
            skipped.append(result)
    return Diagnosis(findings=findings, skipped=skipped, summary=summarize(run))


# --- helpers -------------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return f"{value:.1%}" if value < 0.1 else f"{value:.0%}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _steady_note(run: RunMetrics, count: int) -> str:
    return f"{count} log windows after warm-up (steps {run.warmup_steps + 1}-{run.last_step})"


def _setting_note(run: RunMetrics, section: str, key: str) -> str:
    value = run.setting(section, key)
    return f" (now {value})" if value is not None else ""


# --- rules ---------------------------------------------------------------------------------------


def _data_bound(run: RunMetrics) -> Finding | str | None:
    steps, fracs = run.series("time/data_wait_frac", steady=True)
    if not fracs:
        return "data wait: time/data_wait_frac was not recorded"
    share = median(fracs)
    if share <= DATA_WAIT_FRAC:
        return None
    _, step_s = run.series("time/step_s", steady=True)
    wait_s = share * median(step_s) if step_s else math.nan
    above = sum(f > DATA_WAIT_FRAC for f in fracs)
    evidence = [
        f"median time/data_wait_frac {_pct(share)} (threshold {_pct(DATA_WAIT_FRAC)}, target 2%) over "
        f"{_steady_note(run, len(fracs))}; {above} of {len(fracs)} windows above the threshold, worst {_pct(max(fracs))}",
        f"about {_ms(wait_s)} of each {_ms(median(step_s))} step is spent waiting for the next batch",
        f"removing the wait would make training about {1 / (1 - min(share, 0.99)):.2f}x faster",
    ]
    numbers = {"data_wait_frac": share, "step_s": median(step_s) if step_s else math.nan}
    _, rank_min = run.series("time/data_wait_frac_rank_min", steady=True)
    gap = share - median(rank_min) if rank_min else 0.0
    if rank_min:
        evidence.append(
            f"the rank that waits least waits {_pct(median(rank_min))}"
            + (": one rank's data is slow (its node, its storage path or its shards)" if gap > DATA_WAIT_RANK_GAP else ": every rank waits alike")
        )
    advice = [
        f"prefetch more batches: data.prefetch_batches{_setting_note(run, 'data', 'prefetch_batches')}, e.g. double it",
        f"give each worker more CPU cores for reading and collating: resources.cpus_per_worker{_setting_note(run, 'resources', 'cpus_per_worker')}",
        "feed prepared Parquet shards (`raytrain-fast prepare-data`) rather than raw text, and keep them near the workers (same region / endpoint)",
    ]
    return Finding(
        key="data_bound", title=f"Data-bound: training waits for data {_pct(share)} of the time",
        evidence=evidence, advice=advice, numbers=numbers,
    )


def _sink_backlog(run: RunMetrics) -> Finding | str | None:
    if not (run.has("sink/backlog") or run.has("sink/dropped")):
        return "metric sinks: sink/backlog and sink/dropped were not recorded"
    _, backlog = run.series("sink/backlog", steady=True)
    _, dropped = run.series("sink/dropped")
    _, errors = run.series("sink/errors")
    num_dropped, num_errors = int(max(dropped, default=0)), int(max(errors, default=0))
    behind = sum(b >= SINK_BACKLOG_RECORDS for b in backlog)
    if num_dropped == 0 and num_errors == 0 and behind < SINK_BACKLOG_WINDOWS:
        return None
    evidence = []
    if num_dropped:
        evidence.append(f"{num_dropped} metric records were dropped because the sink queue was full (sink/dropped)")
    if behind:
        evidence.append(
            f"the sink thread was {SINK_BACKLOG_RECORDS} or more records behind in {behind} of {len(backlog)} "
            f"steady windows, at most {int(max(backlog))} (sink/backlog; a healthy sink is at 0)"
        )
    if num_errors:
        evidence.append(f"{num_errors} sink calls raised (sink/errors; the first of each kind is in rank 0's log)")
    _, step_s = run.series("time/step_s", steady=True)
    log_every = run.setting("train", "log_every")
    if step_s and isinstance(log_every, int):
        evidence.append(f"a record is made every {_duration(median(step_s) * log_every)} (train.log_every={log_every})")
    advice = [
        f"log less often: raise train.log_every{_setting_note(run, 'train', 'log_every')}",
        f"make room for bursts: raise metrics.queue_size{_setting_note(run, 'metrics', 'queue_size')}",
        "if W&B is on, use metrics.wandb_mode=offline and `wandb sync` later; with S3 storage, raise metrics.jsonl_flush_every_s",
    ]
    title = "Logging can't keep up: the metric sink " + ("dropped records" if num_dropped else "has a growing backlog" if behind else "raised errors")
    return Finding(
        key="sink_backlog", title=title, evidence=evidence, advice=advice,
        numbers={"dropped": num_dropped, "errors": num_errors, "max_backlog": max(backlog, default=0.0), "windows_behind": behind},
    )


def _memory_underused(run: RunMetrics) -> Finding | str | None:
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
    evidence = [f"peak memory is {_pct(peak_frac)} of what is available (memory/peak_frac, threshold {_pct(MEMORY_UNDERUSED_FRAC)})"]
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
        key="memory_underused", title=f"Memory under-used: the peak is only {_pct(peak_frac)} of the memory available",
        evidence=evidence, advice=advice, numbers={"peak_frac": peak_frac},
    )


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


def _slowdown(run: RunMetrics) -> Finding | str | None:
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
    evidence = [slowdown.source, f"step time {_ms(step_before)} before step {since}, {_ms(step_after)} since"]
    labels = {"data_wait": "data wait", "checkpoint": "checkpoint blocked", "gc": "GC", "cpu": "waiting for a CPU (host/cpu_wait_frac)"}
    for key, (old, new, _) in growth.items():
        evidence.append(f"{labels[key]} {_ms(old)} -> {_ms(new)} per step")
    _, mem = run.series("memory/current_gb")
    if mem:
        evidence.append(f"memory in use {mem[0]:.2f} GB at the start, {mem[-1]:.2f} GB at the end (memory/current_gb)")
    if extra > 0:
        explained = sum(max(0.0, grew) for _, _, grew in growth.values())
        evidence.append(f"of the {_ms(extra)} extra per step, the signals above together explain {_ms(min(explained, extra))}")
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

    def per_step(records: list[dict[str, Any]], signal: str) -> float | None:
        values = []
        for r in records:
            if signal == "data_wait" and "time/data_wait_frac" in r:
                values.append(r["time/data_wait_frac"] * r["time/step_s"])
            elif signal == "checkpoint":
                values.append(r.get("checkpoint/blocked_s", 0.0) / windows[r["step"]])
            elif signal == "gc" and "gc/collect_s" in r:
                values.append(r["gc/collect_s"] / windows[r["step"]])
            elif signal == "cpu" and "host/cpu_wait_frac" in r:
                values.append(r["host/cpu_wait_frac"] * r["time/step_s"])
        return median(values) if values else None

    result = {}
    for signal in ("data_wait", "checkpoint", "gc", "cpu"):
        old, new = per_step(before, signal), per_step(after, signal)
        if old is not None and new is not None and (old > 0 or new > 0):
            result[signal] = (old, new, new - old)
    return result


def _checkpoint_stall(run: RunMetrics) -> Finding | str | None:
    steps, blocked = run.series("checkpoint/blocked_s")
    if not blocked:
        return "checkpoint stalls: no checkpoint was saved between two log steps (checkpoint/blocked_s absent)"
    windows = run.window_steps()
    every = run.setting("checkpoint", "every_steps")
    total_blocked = 0.0
    num_checkpoints = 0
    for step, seconds in zip(steps, blocked):
        count = len(run.saves_in_window(step))  # blocked_s is per checkpoint saved in the window
        total_blocked += seconds * count
        num_checkpoints += count
    wall = sum(r.get("time/step_s", 0.0) * windows[r["step"]] for r in run.records)
    share = total_blocked / wall if wall > 0 else 0.0
    worst = max(blocked)
    if share <= CHECKPOINT_BLOCKED_SHARE and worst <= CHECKPOINT_MAX_BLOCK_S:
        return None
    upload = run.setting("checkpoint", "upload")
    evidence = [
        f"training was blocked {_duration(total_blocked)} by {num_checkpoints} checkpoints: {_pct(share)} of "
        f"{_duration(wall)} of logged training time (threshold {_pct(CHECKPOINT_BLOCKED_SHARE)})",
        f"per checkpoint: median {_duration(median(blocked))}, worst {_duration(worst)} (checkpoint/blocked_s; "
        f"a single block above {CHECKPOINT_MAX_BLOCK_S:.0f} s is a finding on its own)",
    ]
    _, uploads = run.series("checkpoint/upload_s")
    if uploads:
        evidence.append(f"uploads took a median {_duration(median(uploads))} (checkpoint/upload_s)")
    if upload:
        evidence.append(f"checkpoint.upload is {upload}" + (f", checkpoint.every_steps {every}" if every is not None else ""))
    advice = []
    if upload == "sync" or upload is None:
        advice.append("upload in the background: checkpoint.upload=async (training then waits only for the local save)")
    _, step_s = run.series("time/step_s", steady=True)
    if isinstance(every, int) and every > 0 and step_s:
        advice.append(
            f"save less often: checkpoint.every_steps={every} is a save every {_duration(every * median(step_s))} "
            f"of training; e.g. every_steps={every * 5} or checkpoint.every_minutes"
        )
    else:
        advice.append("save less often (checkpoint.every_steps or checkpoint.every_minutes)")
    if uploads and upload == "async":
        advice.append("with async upload, a save still waits for the previous upload: a faster bucket or fewer saves removes that wait")
    return Finding(
        key="checkpoint_stall", title=f"Checkpoint stalls: training blocked {_pct(share)} of the time by checkpoints",
        evidence=evidence, advice=advice,
        numbers={"blocked_share": share, "worst_block_s": worst, "num_checkpoints": float(num_checkpoints)},
    )


def _straggler(run: RunMetrics) -> Finding | str | None:
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
        f"in the median window the slowest rank reached the log step {_ms(median(gaps))} after the fastest: "
        f"{_pct(share)} of a step (threshold {_pct(STRAGGLER_SHARE)}; time/step_s_rank_spread x steps per window)",
        f"{above} of {len(shares)} windows after warm-up are above the threshold (a finding needs {STRAGGLER_MIN_WINDOWS:.0%})",
        "every rank waits for the slowest one at each step's gradient all-reduce, so the whole run goes at its pace",
    ]
    _, high = run.series("time/data_wait_frac", steady=True)
    _, low = run.series("time/data_wait_frac_rank_min", steady=True)
    if high and low and median(high) - median(low) > DATA_WAIT_RANK_GAP:
        evidence.append(f"data wait differs across ranks ({_pct(median(low))} to {_pct(median(high))}): the late rank waits for its data")
        advice = ["look at that rank's data path (its node's disk or network, its shards) and prefetch more (data.prefetch_batches)"]
    else:
        evidence.append("data wait is alike on every rank, so the late rank computes or communicates more slowly")
        advice = [
            "look for other processes on the late rank's node (CPU or GPU shared), thermal or power throttling, or a slower link",
            "keep metrics.gc_every on: it makes every rank collect garbage at the same step",
        ]
    return Finding(
        key="straggler", title=f"Straggler: one rank arrives {_pct(share)} of a step late",
        evidence=evidence, advice=advice, numbers={"share": share, "gap_s": median(gaps)},
    )


def _record_window(record: dict[str, Any], steps: int) -> Window:
    """A log record as the detectors' Window (seconds per step)."""
    step_s = record["time/step_s"]
    return Window(
        step=record["step"], step_s=step_s, num_steps=steps,
        data_wait_s=record.get("time/data_wait_frac", 0.0) * step_s,
        gc_s=record.get("gc/collect_s", 0.0) / steps,
        checkpoint_s=record.get("checkpoint/blocked_s", 0.0) / steps,
        memory_gb=record.get("memory/current_gb", 0.0),
        cpu_share=record.get("host/cpu_share"), cpu_wait_frac=record.get("host/cpu_wait_frac"),
    )


def run_stalls(run: RunMetrics) -> list[Stall]:
    """The stalls of the steady windows: the run's own stall detector replayed with its factor."""
    detector = StallDetector(factor=stall_factor(run), warmup_steps=0)
    windows = run.window_steps()
    stalls = []
    for record in run.steady:
        if "time/step_s" in record:
            stall = detector.update(_record_window(record, windows[record["step"]]))
            if stall is not None:
                stalls.append(stall)
    return stalls


_STALL_ADVICE = {
    "cpu": "keep other CPU-heavy work off the training nodes while they train, or run it at low priority (`nice -n 19 ...`)",
    "data_wait": "see the data advice: prefetch more (data.prefetch_batches), more CPUs per worker, prepared shards near the workers",
    "checkpoint": "use checkpoint.upload=async and check the storage's write speed around those steps",
    "gc": "keep metrics.gc_every on, and look for many Python objects made per step",
    "unknown": "look at the node around those steps: other jobs, storage or network hiccups, throttling",
}


def _stall(run: RunMetrics) -> Finding | str | None:
    if not run.has("time/step_s"):
        return "stalls: time/step_s was not recorded"
    stalls = run_stalls(run)
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
        f"those windows lost {_duration(lost)} against their neighbours: {_pct(share)} of {_duration(wall)} of logged training time",
        f"worst: the window ending at step {worst.step}, {_ms(worst.step_s)} per step against {_ms(worst.base_s)}",
    ]
    live = [s for s, v in zip(*run.series("alert/stall")) if v >= 1]
    if live:
        evidence.append(f"the run's live alert (alert/stall) fired at steps {', '.join(map(str, live[:8]))}")
    return Finding(
        key="stall", title=f"Stalls: {len(stalls)} log window{'s' if len(stalls) > 1 else ''} far slower than the rest, likely cause: {STALL_CAUSES[causes[0]]}",
        evidence=evidence, advice=[_STALL_ADVICE[c] for c in causes],
        numbers={"lost_s": lost, "lost_share": share, "windows": float(len(stalls)), "first_step": float(stalls[0].step), "last_step": float(stalls[-1].step)},
    )


def _corpus_repeated(run: RunMetrics) -> Finding | str | None:
    """The run went through its corpus more than MANY_EPOCHS times (train/epoch at its last record)."""
    from raytrain_fast.data.corpus import MANY_EPOCHS

    _, epochs = run.series("train/epoch")
    if not epochs:
        return "corpus repetition: train/epoch was not recorded"
    if epochs[-1] <= MANY_EPOCHS:
        return None
    evidence = [f"the run took {epochs[-1]:,.1f} epochs of its training data by step {run.last_step:,} (train/epoch; threshold {MANY_EPOCHS:g})"]
    _, val = run.series("val/loss")
    if not val:
        evidence.append("no val/loss was recorded, so nothing shows whether the falling loss is memorisation")
    return Finding(
        key="corpus_repeated", title=f"Small corpus: every sequence was seen about {epochs[-1]:,.0f} times",
        evidence=evidence,
        advice=[
            "train on more data (data.source) or for fewer steps; a loss reached by repeating a small corpus is memorisation",
            "keep a validation split (prepare-data --val-fraction) so val/loss shows when the model stops generalising",
        ],
        numbers={"epochs": epochs[-1]},
    )


def stall_factor(run: RunMetrics) -> float:
    return float(run.setting("metrics", "stall_factor", DEFAULT_STALL_FACTOR))


def _median_step_s(run: RunMetrics) -> float:
    """The median time/step_s over every record (NaN without one): what the time lost is priced at."""
    return median([r["time/step_s"] for r in run.records if "time/step_s" in r])


def _hangs(run: RunMetrics) -> list[Finding]:
    """One finding per hang the watchdog acted on (watchdog/stacks.py): the rank, the top of its
    stack, and the time lost: the time stuck plus the steps trained again from the checkpoint."""
    resumed = {int(v): s for s, v in zip(*run.series("hang/step"))}
    step_s = _median_step_s(run)
    findings = []
    for hang in run.hangs:
        ranks = hang.get("stuck_ranks") or []
        resumed_at = resumed.get(int(hang["step"]))
        redone = hang["step"] - resumed_at if resumed_at is not None else None
        lost = hang["stuck_s"] + (redone * step_s if redone is not None and not math.isnan(step_s) else 0.0)
        tops = [f"rank {r}: {hang['ranks'][str(r)]['top']}" for r in ranks]
        waiting = hang.get("waiting_ranks") or []
        evidence = [
            f"no rank completed a step after step {hang['step']} for {_duration(hang['stuck_s'])} (timeout {_duration(hang['timeout_s'])})",
            f"stuck: rank {', '.join(map(str, ranks))}" + (f"; rank {', '.join(map(str, waiting))} waited in a collective" if waiting else ""),
            *[f"top of the stack of {top}" for top in tops],
            f"every rank's stack: {run.uri}/{hang['stacks_file']}",
            f"the worker group restarted from the checkpoint at step {resumed_at} and trained {redone} steps again" if redone is not None
            else "the worker group restarted from its newest checkpoint",
            f"time lost: about {_duration(lost)}",
        ]
        findings.append(Finding(
            key="hang", title=f"Hang at step {hang['step']}: rank {', '.join(map(str, ranks))} stuck, about {_duration(lost)} lost",
            evidence=evidence,
            advice=[
                "read the stuck rank's stack: a data read, a storage call or a kernel that never returns; the others only wait for it",
                "a rank frozen by the system (swap, a stopped process, a failing GPU): check that node's logs around that time",
            ],
            numbers={"step": float(hang["step"]), "rank": float(ranks[0]) if ranks else -1.0, "stuck_s": float(hang["stuck_s"]), "lost_s": lost},
        ))
    return findings


def _divergence(run: RunMetrics) -> list[Finding]:
    """One finding per divergence (loop/health.py): each rollback from `<run>/health.json` (the step,
    what it was, the checkpoint it went back to, the data it skipped, the time lost), and a non-finite
    window the run did not roll back from (health.on_nonfinite stop or warn, or max_rollbacks spent)."""
    step_s = _median_step_s(run)
    findings = []
    for number, record in enumerate(run.rollbacks, 1):
        redone = int(record["detected_step"]) - int(record["to_step"])
        lost = redone * step_s if not math.isnan(step_s) else math.nan
        position = record.get("position") or {}
        evidence = [
            f"{record['what']} in the window ending at step {record['detected_step']} (loss {record['loss']:.4g}, grad norm {record['grad_norm']:.4g})",
            f"rolled back to the checkpoint at step {record['to_step']} and skipped the {int(record['skip_sequences']):,} sequences "
            f"read since it (from epoch {position.get('epoch', 0)}, sequence {position.get('consumed', 0):,}); a resume skips them again",
            f"rollback {number} of at most {run.setting('health', 'max_rollbacks', '?')} (health.max_rollbacks)",
        ]
        if not math.isnan(lost):
            evidence.append(f"time lost: about {_duration(lost)} ({redone} steps trained again)")
        findings.append(Finding(
            key="divergence", title=f"Divergence at step {record['detected_step']}: rolled back to step {record['to_step']}",
            evidence=evidence, advice=_DIVERGENCE_ADVICE,
            numbers={"step": float(record["detected_step"]), "to_step": float(record["to_step"]),
                     "skipped_sequences": float(record["skip_sequences"]), "lost_s": lost},
        ))
    stop = run.divergence_stop
    if stop:
        evidence = [
            f"{stop['what']} in the window ending at step {stop['step']} (loss {stop['loss']:.4g}, grad norm {stop['grad_norm']:.4g})",
            f"the run stopped there (health.on_nonfinite / health.on_spike: {run.setting('health', 'on_nonfinite', '?')} / "
            f"{run.setting('health', 'on_spike', '?')}" + (f", after {len(run.rollbacks)} rollback(s)" if run.rollbacks else "") + ")",
            "the update of a non-finite step never reached the weights, and every checkpoint saved is healthy: "
            + (f"the newest is at step {max(run.saved_steps)}" if run.saved_steps else "none was saved"),
        ]
        findings.append(Finding(key="divergence", title=f"Training diverged at step {stop['step']} and stopped",
                                evidence=evidence, advice=_DIVERGENCE_ADVICE, numbers={"step": float(stop["step"])}))
    # Non-finite windows the run went on from (health.on_nonfinite: warn).
    acted = {int(r["detected_step"]) for r in run.rollbacks} | ({int(stop["step"])} if stop else set())
    warned = [s for s, v in zip(*run.series("health/nonfinite")) if v >= 1 and s not in acted]
    if warned:
        findings.append(Finding(
            key="divergence", title=f"Non-finite training windows at {len(warned)} log step(s), first at step {warned[0]}",
            evidence=[
                "non-finite loss or gradient norm in the windows ending at step"
                + ("s " if len(warned) > 1 else " ") + ", ".join(map(str, warned[:12])) + (" ..." if len(warned) > 12 else "") + " (health/nonfinite)",
                f"the run went on (health.on_nonfinite: {run.setting('health', 'on_nonfinite', '?')}); the updates of non-finite steps "
                "never reached the weights, and no checkpoint was saved while the state was not healthy",
            ],
            advice=_DIVERGENCE_ADVICE, numbers={"step": float(warned[0]), "windows": float(len(warned))},
        ))
    return findings


_DIVERGENCE_ADVICE = [
    "lower optim.lr, lengthen optim.warmup_steps or tighten optim.grad_clip; a resume from the newest healthy checkpoint can change them",
    "if it recurs at the same data, look at the sequences of that window: a rollback skips them, a rerun from an earlier checkpoint reads them again",
]


def _spikes(run: RunMetrics) -> list[Finding]:
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


def _host_contention(run: RunMetrics) -> Finding | str | None:
    if not run.has("host/cpu_wait_frac"):
        return "host contention: host/cpu_wait_frac was not recorded (a Linux kernel's schedstat gives it)"
    steps, waits = run.series("host/cpu_wait_frac", steady=True)
    contended = [(s, w) for s, w in zip(steps, waits) if w >= CONTENTION_WAIT_FRAC]
    if len(contended) < CONTENTION_MIN_WINDOWS or len(contended) < CONTENTION_MIN_SHARE * len(waits):
        return None
    by_step, windows = {r["step"]: r for r in run.records}, run.window_steps()
    waited_s = sum(w * by_step[s].get("time/step_s", 0.0) * windows[s] for s, w in contended)
    if waited_s < CONTENTION_MIN_WAIT_S:
        return None
    wait_in = median([w for _, w in contended])
    quiet = [w for _, w in zip(steps, waits) if w < CONTENTION_WAIT_FRAC]
    evidence = [
        f"the training thread was ready to run but waited for a CPU a median {_pct(wait_in)} of the time in {len(contended)} of "
        f"{len(waits)} steady windows (host/cpu_wait_frac, threshold {_pct(CONTENTION_WAIT_FRAC)}): steps "
        + ", ".join(str(s) for s, _ in contended[:12]) + (" ..." if len(contended) > 12 else ""),
    ]
    evidence.append(f"it waited {_duration(waited_s)} in those windows")
    if quiet:
        evidence.append(f"in the other windows it waited {_pct(median(quiet))}")
    shares = [by_step[s]["host/cpu_share"] for s, _ in contended if "host/cpu_share" in by_step[s]]
    if shares:
        evidence.append(f"the training process got {_pct(median(shares))} of its threads' CPU time there (host/cpu_share)")
    _, load = run.series("host/load_per_cpu", steady=True)
    if load:
        evidence.append(f"load per CPU on rank 0's node: median {median(load):.2f}, up to {max(load):.2f} (host/load_per_cpu)")
    _, step_s = run.series("time/step_s", steady=True)
    contended_s = [by_step[s]["time/step_s"] for s, _ in contended if "time/step_s" in by_step[s]]
    if contended_s and step_s:
        evidence.append(f"step time {_ms(median(contended_s))} in those windows, {_ms(median(step_s))} over the run")
    advice = ["other processes on the node took the CPU: keep CPU-heavy work (tokenizers, notebooks, other jobs) off training nodes, or run it with `nice -n 19`"]
    _, nice = run.series("host/niceness")
    if nice and nice[0] > 0:
        evidence.append(f"the training worker ran at niceness {nice[0]:.0f} (host/niceness): every process at normal priority came first")
        advice.insert(0, "run training at normal priority: start Ray with RAY_worker_niceness=0 (cluster.yaml does), or let the worker renice itself (root or CAP_SYS_NICE)")
    return Finding(
        key="host_contention", title=f"Host contention: other processes took the CPU from training in {len(contended)} log windows",
        evidence=evidence, advice=advice, numbers={
            "cpu_wait_frac": wait_in, "windows": float(len(contended)), "first_step": float(contended[0][0]), "waited_s": waited_s,
        },
    )


def _memory_pressure(run: RunMetrics) -> Finding | str | None:
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
                f"{what} was above {_pct(MEMORY_PRESSURE_FRAC)} in {len(high)} of {len(values)} steady windows, "
                f"from step {high[0][0]}, up to {_pct(max(v for _, v in high))} ({metric})"
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
        f"lower the training process's memory: a smaller train.micro_batch{_setting_note(run, 'train', 'micro_batch')} "
        f"with more accumulation, fewer data.prefetch_batches{_setting_note(run, 'data', 'prefetch_batches')}",
    ]
    if numbers.keys() - {"host/memory_budget_frac"}:  # the node itself is short of memory
        advice.insert(0, "find what else holds memory on the node (other jobs, a notebook) and stop it, or train on a node with more memory")
    if "host/memory_budget_frac" in numbers:
        advice.append(f"or raise resources.memory_budget_gb{_setting_note(run, 'resources', 'memory_budget_gb')} if the node has the memory")
    return Finding(
        key="memory_pressure", title="Host memory pressure: training runs close to the memory it has",
        evidence=evidence, advice=advice, numbers=numbers,
    )


# --- summary -------------------------------------------------------------------------------------


def run_facts(run: RunMetrics) -> dict[str, str]:
    """What the run was: model, precision, workers, batch, tokens and dates (from its config and
    records), for the top of the report."""
    import datetime

    facts: dict[str, str] = {}
    model = run.config.get("model") if run.config else None
    if isinstance(model, dict) and model.get("d_model"):
        facts["model"] = (
            f"{model.get('num_layers')} layers, d_model {model.get('d_model'):,}, {model.get('num_heads')} heads, "
            f"vocabulary {model.get('vocab_size', 0):,}, sequence {model.get('max_seq_len', 0):,}"
        )
    precision = run.setting("engine", "precision")
    if precision:
        facts["precision"] = f"{precision}, ZeRO stage {run.setting('engine', 'zero_stage', '?')}"
    workers = run.setting("resources", "num_workers")
    if workers is not None:
        facts["workers"] = f"{workers}" + (f" x {run.setting('resources', 'cpus_per_worker')} CPUs" if run.setting("resources", "cpus_per_worker") else "")
    global_batch, seq_len = run.setting("train", "global_batch"), run.setting("data", "seq_len")
    if isinstance(global_batch, int) and isinstance(seq_len, int):
        facts["batch"] = f"{global_batch:,} sequences of {seq_len:,} tokens (micro-batch {run.setting('train', 'micro_batch')})"
        steps = run.setting("train", "steps")
        facts["tokens trained"] = f"{global_batch * seq_len * run.last_step:,} (to step {run.last_step:,}" + (f" of {steps:,})" if isinstance(steps, int) else ")")
    times = [r["time"] for r in run.records if isinstance(r.get("time"), (int, float))]
    if times:
        fmt = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")  # noqa: E731
        facts["logged"] = f"{fmt(min(times))} to {fmt(max(times))}"
        first = run.records[0]
        # The first record closes the first window: the run started that window's steps earlier.
        start = min(times) - float(first.get("time/step_s", 0.0)) * run.window_steps()[first["step"]]
        resumes = f", {len(run.restart_steps)} resume(s) and the pauses before them included" if run.restart_steps else ""
        facts["duration"] = f"{_duration(max(times) - start)} from the first step to the last record{resumes}"
    return facts


def _saves_timed(run: RunMetrics, num_windows: int) -> str:
    """How many of the run's saves the blocked times cover: a final save (or one on a stop signal)
    comes after the last record, so no window times it."""
    saves = run.planned_saves()
    untimed = [s for s in saves if s >= run.last_step]
    timed = f"{num_windows} window(s) timing a save"
    if not saves:
        return timed
    return f"{len(saves)} saves; {timed}" + (f"; the save at step {untimed[0]} is after the last record" if untimed else "")


def summarize(run: RunMetrics) -> dict[str, str]:
    """Headline numbers: medians over the steady windows (all windows when none is steady)."""
    steady = bool(run.steady)
    summary: dict[str, str] = {}
    first, last = run.records[0]["step"], run.last_step
    summary["steps logged"] = f"{first:,}-{last:,} ({len(run.records):,} records, every {run.log_every:,} steps)"
    ranks = run.world_size
    summary["ranks"] = str(ranks) if ranks else ("several" if run.has("time/step_s_rank_spread") else "1 (or unknown)")
    summary["warm-up left out"] = f"steps up to {run.warmup_steps}" + (f"; resumes at steps {run.restart_steps}" if run.restart_steps else "")
    _, loss = run.series("train/loss")
    if loss:
        summary["loss"] = f"{loss[0]:.4f} -> {loss[-1]:.4f} (min {min(loss):.4f})"

    def add(label: str, metric: str, fmt) -> None:
        _, values = run.series(metric, steady=steady)
        if values:
            summary[label] = fmt(median(values))

    add("tokens/s (median)", "throughput/tokens_per_sec", lambda v: f"{v:,.0f}")
    add("step time (median)", "time/step_s", _ms)
    add("MFU (median)", "throughput/mfu", _pct)
    add("MFU vs measured peak (median)", "throughput/mfu_measured_peak", _pct)
    add("data wait (median)", "time/data_wait_frac", _pct)
    _, blocked = run.series("checkpoint/blocked_s")
    if blocked:
        summary["checkpoint blocked"] = f"median {_duration(median(blocked))}, worst {_duration(max(blocked))} ({_saves_timed(run, len(blocked))})"
    _, peak = run.series("memory/peak_gb")
    if peak:
        summary["peak memory"] = f"{max(peak):.2f} GB"
        _, fracs = run.series("memory/peak_frac")
        if fracs:
            summary["peak memory"] += f" ({_pct(max(fracs))} of available)"
    _, nice = run.series("host/niceness")
    if nice:
        summary["worker niceness"] = f"{nice[0]:.0f}" + (" (normal priority)" if nice[0] <= 0 else " (below normal priority: other processes come first)")
    add("CPU wait (median)", "host/cpu_wait_frac", _pct)
    _, alerts = run.series("alert/slowdown")
    if alerts:
        summary["slowdown alerts"] = f"{int(sum(a >= 1 for a in alerts))} of {len(alerts)} windows"
    _, dropped = run.series("sink/dropped")
    if dropped:
        summary["sink records dropped"] = str(int(max(dropped)))
    return summary


def _overfitting(run: RunMetrics) -> Finding | str | None:
    """val/loss rising over the last OVERFIT_RISES evaluations, above its minimum, while train/loss fell."""
    steps, val = run.series("val/loss")
    if len(val) < OVERFIT_RISES + 1:
        why = "no val/loss (evaluation off: prepare the data with a validation split and keep eval.enabled)" if not val else (
            f"{len(val)} evaluation(s), {OVERFIT_RISES + 1} needed (eval.every_steps)"
        )
        return f"overfitting: {why}"
    best = min(range(len(val)), key=val.__getitem__)
    rising = all(val[i] > val[i - 1] for i in range(len(val) - OVERFIT_RISES, len(val)))
    rise = val[-1] / val[best] - 1.0
    train = dict(zip(*run.series("train/loss")))
    train_then, train_now = train.get(steps[best]), train.get(steps[-1])
    if not (rising and rise >= OVERFIT_MIN_RISE and train_then is not None and train_now is not None and train_now < train_then):
        return None
    evidence = [
        f"val/loss rose over the last {OVERFIT_RISES} evaluations, from its lowest {val[best]:.4f} at step {steps[best]} "
        f"to {val[-1]:.4f} at step {steps[-1]} (+{rise:.1%})",
        f"while train/loss fell from {train_then:.4f} to {train_now:.4f}: the model is memorising its training data",
    ]
    advice = [
        "more data: a larger corpus (data.source), or all of it (data.max_tokens=0"
        + _setting_note(run, "data", "max_tokens") + ")",
        f"fewer epochs: train fewer steps (train.steps{_setting_note(run, 'train', 'steps')}), or keep the best "
        f"checkpoint by val/loss (checkpoint.keep_best=1: the step-{steps[best]} one)",
        f"regularise: model.dropout{_setting_note(run, 'model', 'dropout')} (e.g. 0.1), "
        f"optim.weight_decay{_setting_note(run, 'optim', 'weight_decay')}",
    ]
    return Finding(
        key="overfitting", title=f"Overfitting: val/loss up {rise:.1%} since step {steps[best]} while train/loss fell",
        evidence=evidence, advice=advice,
        numbers={"best_step": float(steps[best]), "best_val_loss": val[best], "val_loss": val[-1], "rise": rise},
    )
