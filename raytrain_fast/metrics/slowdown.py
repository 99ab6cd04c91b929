"""Two detectors over the log windows: a progressive slowdown (the run's own step time after
warm-up is the baseline) and a stall (one window far slower than the ones just before it).

Slowdown: fed one `Window` per log step. After `warmup_steps`, the median of the first `num_windows` windows
becomes the baseline; from then on, when the median of the last `num_windows` windows exceeds the
baseline by more than `threshold`, the detector raises an alert naming the most likely cause among
what the loop measures, by how many seconds per step each signal grew against its own baseline:
data wait, GC pauses, checkpoint stalls, CPU the sink thread took; then the training thread
waiting for a core (other processes taking the CPU); then sink drops and memory growth, which cost
no measurable seconds of their own.

Stall: see `StallDetector`.

The same detectors serve the live alert (TrainMetrics, thresholds from MetricsConfig) and the
report, which replays it over a run's records with its own thresholds when the run has no
alert/slowdown metrics (report/findings/slowdown.py). The detector does not log: its caller does.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

_DESCRIPTIONS = {
    "data_wait": "the data pipeline: waiting for the next batch",
    "gc": "Python garbage collection pauses",
    "checkpoint": "checkpoint stalls (time training was blocked saving)",
    "sink": "the metric sinks (the sink thread's CPU time, a growing backlog or dropped records)",
    "memory": "memory growth",
    "cpu": "other processes took the CPU (a compute thread waited for a core)",
    "unexplained": (
        "nothing the loop measures: the compute itself got slower (other processes on this machine, "
        "thermal or power throttling, a straggler rank, a slower interconnect)"
    ),
}
# A seconds-based cause must explain at least this share of the extra step time to be named.
_MIN_EXPLAINED = 0.25
_MEMORY_GROWTH = 0.10
# A slowdown episode ends when the rolling median is back within this share of the threshold.
_EPISODE_END = 0.5


@dataclass(kw_only=True)
class Window:
    """What the loop measured over one log window, per optimizer step where it is a time."""

    step: int
    step_s: float
    num_steps: int = 1
    """Optimizer steps in the window."""
    data_wait_s: float = 0.0
    gc_s: float = 0.0
    checkpoint_s: float = 0.0
    sink_cpu_s: float = 0.0
    sink_dropped: int = 0
    """Records dropped by the sink queue during this window."""
    sink_backlog: int = 0
    memory_gb: float = 0.0
    """Memory in use now (host RSS on CPU, allocated on GPU)."""
    cpu_wait_frac: float | None = None
    """host/cpu_wait_frac: share of the window the training thread was ready to run but had no core."""


@dataclass(kw_only=True)
class Alert:
    step: int
    ratio: float
    """Rolling median step time / baseline."""
    cause: str
    message: str
    since_step: int
    """The step of the first window above the threshold among the rolling ones that raised the alert."""


class SlowdownDetector:
    def __init__(self, *, threshold: float, num_windows: int, warmup_steps: int) -> None:
        self.threshold = threshold
        self.num_windows = num_windows
        self.warmup_steps = warmup_steps
        self.baseline: Window | None = None
        self.alerting = False
        self.last_ratio: float | None = None
        """Rolling median step time / baseline at the last update: the number the alert compares."""
        self._baseline_windows: list[Window] = []
        self._recent: deque[Window] = deque(maxlen=num_windows)

    def update(self, window: Window) -> tuple[float, Alert | None]:
        """Feed one log window. Returns (alert/slowdown value: 1.0 or 0.0, the alert when an episode starts).

        Only the start of an episode returns an Alert (the caller logs its message once); the value
        stays 1.0 while the episode lasts, which the progress line shows as a short marker. An episode
        ends when the rolling median is back within half the threshold: a ratio hovering around the
        threshold (11-18% during a pip install) is one episode, not one paragraph per window.
        """
        if window.step <= self.warmup_steps:
            return 0.0, None
        if self.baseline is None:
            self._baseline_windows.append(window)
            if len(self._baseline_windows) == self.num_windows:
                self.baseline = _median_window(self._baseline_windows)
            return 0.0, None
        self._recent.append(window)
        if len(self._recent) < self.num_windows:
            return 0.0, None
        current = _median_window(list(self._recent))
        ratio = current.step_s / self.baseline.step_s if self.baseline.step_s > 0 else 1.0
        self.last_ratio = ratio
        if self.alerting and ratio <= 1.0 + self.threshold * _EPISODE_END:
            self.alerting = False
        alert = None
        if ratio > 1.0 + self.threshold and not self.alerting:
            # Diagnose on the slow windows only: their signals are the ones that explain the slowdown.
            limit = self.baseline.step_s * (1.0 + self.threshold)
            slow_windows = [w for w in self._recent if w.step_s > limit]
            dropped = sum(w.sink_dropped for w in self._recent)
            alert = self._diagnose(
                _mean_window(slow_windows), ratio=ratio, median_s=current.step_s, step=window.step,
                since_step=slow_windows[0].step, dropped=dropped,
            )
            self.alerting = True
        return (1.0 if self.alerting else 0.0), alert

    def _diagnose(self, current: Window, *, ratio: float, median_s: float, step: int, since_step: int, dropped: int) -> Alert:
        """`current`: the mean of the slow windows (what the causes are read from); `median_s`: the
        rolling median step time, the statistic `ratio` and the sentence use, as the baseline does."""
        base = self.baseline
        assert base is not None
        measured = _measured_cause(current, base, ("data_wait", "gc", "checkpoint", "sink"))
        cause = measured or _unmeasured_cause(current, base, dropped=dropped)
        details = {
            "data_wait": f"data wait {base.data_wait_s * 1e3:.1f} -> {current.data_wait_s * 1e3:.1f} ms/step",
            "gc": f"GC {base.gc_s * 1e3:.1f} -> {current.gc_s * 1e3:.1f} ms/step",
            "checkpoint": f"checkpoint blocked {base.checkpoint_s * 1e3:.1f} -> {current.checkpoint_s * 1e3:.1f} ms/step",
            "sink": (
                f"sink thread CPU {base.sink_cpu_s * 1e3:.1f} -> {current.sink_cpu_s * 1e3:.1f} ms/step, "
                f"backlog {current.sink_backlog}, {dropped} dropped"
            ),
            "memory": f"memory {base.memory_gb:.2f} -> {current.memory_gb:.2f} GB",
        }
        if current.cpu_wait_frac is not None and base.cpu_wait_frac is not None:
            details["cpu"] = f"waiting for a CPU {base.cpu_wait_frac:.0%} -> {current.cpu_wait_frac:.0%} of the time"
        message = (
            f"slowdown at step {step}: the median step time of the last {self.num_windows} log windows, "
            f"{median_s * 1e3:.1f} ms, is {ratio - 1:.0%} above the baseline {base.step_s * 1e3:.1f} ms (the median of "
            f"the first {self.num_windows} after warm-up). "
            f"Most likely cause: {_DESCRIPTIONS[cause]}"
            + (f" ({details[cause]})" if cause in details else "")
            + ". Measured: " + "; ".join(v for k, v in details.items() if k != cause) + "."
        )
        return Alert(step=step, ratio=ratio, cause=cause, message=message, since_step=since_step)


def _unmeasured_cause(current: Window, base: Window, *, dropped: int) -> str:
    """The cause when no measured seconds explain the slowdown: a sink falling behind, memory
    growth, or nothing the loop measures."""
    if dropped > 0 or current.sink_backlog > base.sink_backlog + 1:
        return "sink"
    memory_growth = (current.memory_gb - base.memory_gb) / base.memory_gb if base.memory_gb > 0 else 0.0
    return "memory" if memory_growth > _MEMORY_GROWTH else "unexplained"


def signal_s(window: Window) -> dict[str, float | None]:
    """Seconds per step of each signal a cause is read from; cpu: how long the most starved compute
    thread waited for a core (None where not measured)."""
    return {
        "data_wait": window.data_wait_s, "gc": window.gc_s, "checkpoint": window.checkpoint_s,
        "sink": window.sink_cpu_s,
        "cpu": None if window.cpu_wait_frac is None else window.cpu_wait_frac * window.step_s,
    }


def _measured_cause(current: Window, base: Window, causes: tuple[str, ...]) -> str | None:
    """The one of `causes` whose seconds per step grew most from `base` (largest_cause), else the CPU wait
    by the same rule. The CPU wait is asked after the signals inside the process: a busy thread of the
    process itself, like a CPU-hungry sink, also makes the training thread wait for a core, and it is
    the better name for the cause."""
    now, then, excess = signal_s(current), signal_s(base), current.step_s - base.step_s
    grew = lambda of: {n: now[n] - then[n] for n in of if now[n] is not None and then[n] is not None}  # noqa: E731
    return largest_cause(grew(causes), excess) or largest_cause(grew(("cpu",)), excess)


def largest_cause(grew: dict[str, float], excess_s: float) -> str | None:
    """The signal whose seconds per step grew most, when it explains at least _MIN_EXPLAINED of the
    `excess_s` extra seconds per step; None when nothing measured explains the slowdown."""
    if not grew or excess_s <= 0:
        return None
    top = max(grew, key=lambda k: grew[k])
    return top if grew[top] >= _MIN_EXPLAINED * excess_s else None


_SECONDS = ("step_s", "data_wait_s", "gc_s", "checkpoint_s", "sink_cpu_s")


def _median_window(windows: list[Window]) -> Window:
    """The baseline and the rolling window the alert compares: medians."""
    return _combine(
        windows, statistics.median,
        sink_backlog=int(statistics.median(w.sink_backlog for w in windows)),
        memory_gb=statistics.median(w.memory_gb for w in windows),
    )


def _mean_window(windows: list[Window]) -> Window:
    """The slow windows a diagnosis reads: means, the largest backlog and the latest memory."""
    return _combine(
        windows, statistics.fmean,
        sink_backlog=max(w.sink_backlog for w in windows), memory_gb=windows[-1].memory_gb,
    )


def _combine(windows: list[Window], average: Callable[[list[float]], float], *, sink_backlog: int, memory_gb: float) -> Window:
    waits = [w.cpu_wait_frac for w in windows if w.cpu_wait_frac is not None]
    return Window(
        step=windows[-1].step,
        **{name: average([getattr(w, name) for w in windows]) for name in _SECONDS},
        cpu_wait_frac=average(waits) if waits else None,
        sink_dropped=sum(w.sink_dropped for w in windows),
        sink_backlog=sink_backlog,
        memory_gb=memory_gb,
    )


# --- stalls --------------------------------------------------------------------------------------

STALL_CAUSES = {
    "cpu": "other processes took the CPU",
    "data_wait": "waiting for data",
    "checkpoint": "a checkpoint blocked training",
    "gc": "a garbage-collection pause",
    "unknown": "nothing the loop measures",
}


@dataclass(kw_only=True)
class Stall:
    step: int
    step_s: float
    """This window's step time."""
    base_s: float
    """The median step time of the windows before it."""
    cause: str
    """A key of STALL_CAUSES."""
    message: str

    @property
    def ratio(self) -> float:
        return self.step_s / self.base_s

    @property
    def lost_s(self) -> float:
        """Seconds per step above the windows before it."""
        return self.step_s - self.base_s


STALL_WINDOWS = 5
"""How many windows before a window the stall detector takes the median of."""


class StallDetector:
    """One log window far slower than the ones just before it: a stall, not a trend.

    The progressive-slowdown detector watches a rolling median, so a single 70x window never moves
    it. This one compares each window with the median of the last `num_windows` windows that were
    not stalls (at least 3, after `warmup_steps`) and reports a window whose step time is more than
    `factor` times that and which lost at least `min_lost_s` seconds in all (a 40 ms window of a
    tiny test model that took 100 ms is noise, not a stall anyone waits for). Its likely cause comes from the window's own numbers: data wait,
    checkpoint or GC, whichever grew most in seconds if it explains at least a quarter of the extra
    time; else a compute thread waiting for a core (other processes took the CPU) by the same
    rule; else unknown. Used live (TrainMetrics) and by the report.
    """

    def __init__(self, *, factor: float, warmup_steps: int, num_windows: int = STALL_WINDOWS, min_lost_s: float = 1.0) -> None:
        self.factor = factor
        self.min_lost_s = min_lost_s
        self.num_windows = num_windows
        self.warmup_steps = warmup_steps
        self._recent: deque[Window] = deque(maxlen=num_windows)
        self.threshold_s: float | None = None
        """The step time the last window was held to: `factor` x the median (None before the detector has one)."""

    def update(self, window: Window) -> Stall | None:
        if window.step <= self.warmup_steps:
            return None
        if len(self._recent) < min(3, self.num_windows):
            self._recent.append(window)
            return None
        base = _median_window(list(self._recent))
        self.threshold_s = self.factor * base.step_s
        lost = (window.step_s - base.step_s) * window.num_steps
        if base.step_s <= 0 or window.step_s <= self.factor * base.step_s or lost < self.min_lost_s:
            self._recent.append(window)  # stalls stay out of the median, so a long one keeps firing
            return None
        cause = stall_cause(window, base)
        ratio = window.step_s / base.step_s
        message = (
            f"stall at step {window.step}: {window.step_s * 1e3:,.0f} ms/step, {ratio:.1f}x the {base.step_s * 1e3:,.0f} ms "
            f"of the windows before it. Likely cause: {STALL_CAUSES[cause]}"
            + (f" (a compute thread waited for a CPU {window.cpu_wait_frac:.0%} of the window)" if cause == "cpu" else "")
            + "."
        )
        return Stall(step=window.step, step_s=window.step_s, base_s=base.step_s, cause=cause, message=message)


def stall_cause(window: Window, base: Window) -> str:
    return _measured_cause(window, base, ("data_wait", "checkpoint", "gc")) or "unknown"
