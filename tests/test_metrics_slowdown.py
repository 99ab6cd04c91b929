"""The slowdown detector: deterministic windows, then planted slowdowns in a real (sleep-paced) loop."""

from __future__ import annotations

import time

import pytest

from raytrain_fast.metrics import MetricsConfig, SinkWriter, SlowdownDetector, StepPlan, TrainMetrics, Window
from raytrain_fast.metrics.slowdown import StallDetector, largest_cause

pytestmark = pytest.mark.unit


def _feed(detector: SlowdownDetector, windows: list[Window]):
    return [detector.update(w) for w in windows]


def test_no_alert_while_step_time_stays_within_threshold():
    detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=10)
    step_times = [0.5, 0.2, 0.1, 0.1, 0.1] + [0.105, 0.095, 0.108, 0.1, 0.109, 0.107, 0.104] * 3
    results = _feed(detector, [Window(step=10 * (i + 1), step_s=s) for i, s in enumerate(step_times)])
    assert detector.baseline is not None and detector.baseline.step_s == pytest.approx(0.1)  # warm-up ignored
    assert all(value == 0.0 and alert is None for value, alert in results)


def test_alert_needs_several_slow_windows_and_fires_once():
    detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=0)
    windows = [Window(step=i, step_s=0.1) for i in range(1, 7)]
    windows.append(Window(step=7, step_s=0.3))  # one outlier window: not a slowdown
    windows += [Window(step=8, step_s=0.1), Window(step=9, step_s=0.1)]
    windows += [Window(step=i, step_s=0.15, data_wait_s=0.05) for i in range(10, 15)]
    results = _feed(detector, windows)
    values = [value for value, _ in results]
    alerts = [alert for _, alert in results if alert is not None]
    assert values[:10] == [0.0] * 10
    assert values[10:] == [1.0] * 4  # the median of 3 is slow from the second slow window on
    assert len(alerts) == 1 and alerts[0].cause == "data_wait" and alerts[0].step == 11


@pytest.mark.parametrize(
    ("signal", "cause"),
    [("data_wait_s", "data_wait"), ("gc_s", "gc"), ("checkpoint_s", "checkpoint"), ("sink_cpu_s", "sink")],
)
def test_cause_is_the_signal_that_grew_most(signal, cause):
    detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=0)
    quiet = {"data_wait_s": 0.001, "gc_s": 0.001, "checkpoint_s": 0.0, "sink_cpu_s": 0.0005}
    windows = [Window(step=i, step_s=0.1, **quiet) for i in range(1, 4)]
    windows += [Window(step=i, step_s=0.16, **{**quiet, signal: quiet[signal] + 0.05}) for i in range(4, 7)]
    alert = [a for _, a in _feed(detector, windows) if a is not None][0]
    assert alert.cause == cause
    assert f"{alert.ratio - 1:.0%}" in alert.message


def test_other_processes_taking_the_cpu_are_named_when_nothing_in_the_process_explains_it():
    def alert_for(**slow):
        detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=0)
        windows = [Window(step=i, step_s=0.1, data_wait_s=0.001, cpu_wait_frac=0.02) for i in range(1, 4)]
        windows += [Window(step=i, step_s=0.3, **{"data_wait_s": 0.005, **slow}) for i in range(4, 7)]
        return [a for _, a in _feed(detector, windows) if a is not None][0]

    alert = alert_for(cpu_wait_frac=0.7)  # the thread waited for a core 0.21 s of each 0.3 s step
    assert alert.cause == "cpu" and "waiting for a CPU 2% -> 70%" in alert.message
    # A CPU-hungry thread of the process itself makes the training thread wait for a core too: the
    # measured sink CPU is the better name.
    assert alert_for(cpu_wait_frac=0.5, sink_cpu_s=0.12).cause == "sink"


def test_stall_is_one_window_far_above_the_ones_before_it():
    detector = StallDetector(factor=2.5, num_windows=5, warmup_steps=10)
    times = [1.0, 0.1, 0.1, 0.11, 0.1, 0.12, 0.2, 0.1, 7.0, 0.1, 6.0, 5.5, 0.1]  # the first window is warm-up
    waits = {9: 0.9, 11: 0.9}
    stalls = {}
    for i, seconds in enumerate(times, 1):
        stall = detector.update(Window(step=10 * i, step_s=seconds, cpu_wait_frac=waits.get(i, 0.02), data_wait_s=4.0 if i == 12 else 0.0))
        if stall is not None:
            stalls[10 * i] = stall
    assert set(stalls) == {90, 110, 120}  # 2x (step 70) is not a stall; stalls stay out of the median
    assert stalls[90].ratio == pytest.approx(7.0 / 0.11) and stalls[90].cause == "cpu"  # median of steps 40-80
    assert stalls[120].cause == "data_wait" and stalls[120].base_s == pytest.approx(0.1)
    assert "other processes took the CPU" in stalls[110].message

    # The same ratio in a window that lost well under a second in all is noise, not a stall.
    tiny = StallDetector(factor=2.5, warmup_steps=0)
    windows = [Window(step=i, step_s=0.01, num_steps=3) for i in range(1, 6)] + [Window(step=6, step_s=0.05, num_steps=3)]
    assert [tiny.update(w) for w in windows] == [None] * 6


def test_alert_says_since_which_window_and_leaves_logging_to_the_caller(caplog):
    detector = SlowdownDetector(threshold=0.25, num_windows=3, warmup_steps=0)
    windows = [Window(step=i, step_s=0.1) for i in range(1, 7)] + [Window(step=i, step_s=0.2) for i in range(7, 10)]
    with caplog.at_level("DEBUG"):
        alerts = [a for _, a in _feed(detector, windows) if a is not None]
    assert len(alerts) == 1
    assert alerts[0].step == 8 and alerts[0].since_step == 7  # the median of 3 turns slow at the second slow window
    assert alerts[0].ratio == pytest.approx(2.0) and detector.alerting and detector.last_ratio == pytest.approx(2.0)
    assert caplog.records == []


def test_largest_cause_needs_a_quarter_of_the_extra_time():
    grew = {"data_wait": 0.03, "gc": 0.01, "checkpoint": -0.02}
    assert largest_cause(grew, 0.1) == "data_wait"
    assert largest_cause(grew, 0.13) is None  # 0.03 < 25% of 0.13
    assert largest_cause(grew, 0.0) is None and largest_cause({}, 0.1) is None


def test_memory_growth_and_unexplained():
    detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=0)
    windows = [Window(step=i, step_s=0.1, memory_gb=10.0) for i in range(1, 4)]
    windows += [Window(step=i, step_s=0.2, memory_gb=14.0) for i in range(4, 7)]
    assert [a for _, a in _feed(detector, windows) if a][0].cause == "memory"

    detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=0)
    windows = [Window(step=i, step_s=0.1, memory_gb=10.0) for i in range(1, 4)]
    windows += [Window(step=i, step_s=0.2, memory_gb=10.1) for i in range(4, 7)]
    alert = [a for _, a in _feed(detector, windows) if a][0]
    assert alert.cause == "unexplained" and "compute itself got slower" in alert.message


# --- planted slowdowns in a real loop ----------------------------------------------------------------


def _spin(seconds: float) -> None:
    """A fixed amount of Python work that holds the GIL (like the Python side of a training step):
    `seconds` of this thread's CPU time, so a thread that takes the GIL away makes it last longer
    in wall time, while a machine that is slow for everyone slows the baseline as much."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _CpuHogSink:
    """A sink that starts burning CPU (and the GIL) on every record after `from_step`."""

    def __init__(self, *, from_step: int, cpu_s: float) -> None:
        self.from_step = from_step
        self.cpu_s = cpu_s

    def log(self, metrics, step):
        if step > self.from_step:
            end = time.thread_time() + self.cpu_s
            while time.thread_time() < end:
                pass

    def close(self):
        pass


def _run(config: MetricsConfig, *, steps: int, step_fn, sinks=(), log_every: int = 5):
    import torch

    metrics = TrainMetrics(
        config, steps=StepPlan(log_every=log_every, total_steps=steps, start_step=0, tokens_per_step=1000),
        device="cpu", sinks=SinkWriter(list(sinks), max_queue=config.queue_size) if sinks else None, print_progress=False,
    )
    records = {}
    try:
        for step in range(1, steps + 1):
            metrics.begin_step()
            step_fn(step, metrics)
            metrics.add_loss(torch.tensor(1.0))
            metrics.end_step(step)
            if metrics.is_log_step(step):
                records[step] = metrics.log(step)
    finally:
        metrics.close()
    return metrics, records


def _first_alert(records, *, after: int) -> dict[str, float]:
    """The record where the alert starts; none may start before the planted slowdown."""
    alerts = sorted(step for step, r in records.items() if r.get("alert/slowdown"))
    assert alerts, {step: round(r["time/step_s"] * 1e3, 1) for step, r in records.items()}
    assert alerts[0] > after, f"alert before the slowdown was planted: {alerts}"
    return records[alerts[0]]


# Steps of about 20 ms (100 ms windows): scheduler hiccups of a few tens of ms on a loaded 2-core
# machine stay well under the 50% threshold in a median of 3 windows, while each planted slowdown
# is 2.5x or more.
STEP_S = 0.020


def _config(**overrides) -> MetricsConfig:
    # A 50% threshold: the planted slowdowns are 2.5x or more, and this shared test machine is noisy.
    base = {"slowdown_warmup_steps": 10, "slowdown_windows": 3, "slowdown_threshold": 0.5, "gc_every": 0, "profile_every": 0}
    return MetricsConfig(**{**base, **overrides})


def test_planted_data_slowdown_is_named(caplog):
    def step_fn(step, metrics):
        time.sleep(2 * STEP_S if step > 40 else 0.0)  # the data pipeline falls behind after step 40
        metrics.lap("data")
        time.sleep(STEP_S)
        metrics.lap("forward")

    with caplog.at_level("WARNING", logger="raytrain_fast.metrics"):
        metrics, records = _run(_config(), steps=70, step_fn=step_fn)
    first = _first_alert(records, after=40)
    assert first["alert/slowdown_cause/data_wait"] == 1.0
    assert "data pipeline" in caplog.text and "slowdown at step" in caplog.text


def test_planted_slow_sink_is_named():
    def step_fn(step, metrics):
        metrics.lap("data")
        _spin(STEP_S)  # GIL-holding step work: a CPU-hungry sink thread takes turns with it
        metrics.lap("forward")

    sink = _CpuHogSink(from_step=40, cpu_s=10 * STEP_S)  # per record, i.e. per 5-step window
    metrics, records = _run(_config(queue_size=2), steps=80, step_fn=step_fn, sinks=[sink])
    first = _first_alert(records, after=40)
    assert first["alert/slowdown_cause/sink"] == 1.0


def test_planted_gc_pressure_is_named():
    heap = []

    def step_fn(step, metrics):
        metrics.lap("data")
        if step == 41:
            # A heap that grew after setup (not frozen): every full collection now walks it
            # (about 40 ms per collection here, 2 cores, AVX2: twice the step).
            heap.extend([i] for i in range(400_000))
        time.sleep(STEP_S)
        metrics.lap("forward")

    metrics, records = _run(_config(gc_every=1), steps=70, step_fn=step_fn)
    heap.clear()
    first = _first_alert(records, after=40)
    assert first["alert/slowdown_cause/gc"] == 1.0
    gc_after = [r["gc/collect_s"] for s, r in records.items() if s > 45]
    gc_before = [r["gc/collect_s"] for s, r in records.items() if s <= 40]
    assert min(gc_after) > 5 * max(gc_before)
