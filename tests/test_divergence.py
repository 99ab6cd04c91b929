"""Finite divergence (loop/divergence.py): a loss that blows up without a NaN is named once per
episode, during warm-up too once it is twice a uniform guess, and recorded and real clean runs (the
quickstart, 2,000 steps, a resume with a lower LR, a brisk LR that trains well, a tiny LR's plateau,
a plateau) raise no alarm. Losses recorded from real runs are in tests/recorded_losses.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raytrain_fast.config.train import HealthConfig
from raytrain_fast.loop.divergence import DivergenceCheck
from raytrain_fast.loop.health import DivergenceStop, HealthMonitor, Rollback

pytestmark = pytest.mark.unit

RECORDED = json.loads((Path(__file__).parent / "recorded_losses.json").read_text())
UNIFORM_320 = math.log(320)


def episodes(losses: list[float], *, every: int = 10, warmup: int = 20, start: int = 0, vocab: int = 320) -> list:
    check = DivergenceCheck.for_vocabulary(vocab, warmup_steps=warmup, start_step=start)
    steps = range(start + every, start + every * (len(losses) + 1), every)
    return [found for step, loss in zip(steps, losses) if (found := check.observe(step, loss)) is not None]


def replay(recorded: dict) -> list:
    check = DivergenceCheck.for_vocabulary(recorded["vocab_size"], warmup_steps=recorded["warmup_steps"],
                                           start_step=recorded["start_step"])
    return [found for s, v in zip(recorded["steps"], recorded["loss"]) if (found := check.observe(s, v)) is not None]


@pytest.mark.parametrize("run", sorted(RECORDED["clean"]))
def test_no_alarm_on_the_recorded_clean_runs(run):
    recorded = RECORDED["clean"][run]
    assert len(recorded["steps"]) >= 20
    assert replay(recorded) == []


def test_the_recorded_planted_blowup_is_one_episode_from_its_first_window_at_twice_a_uniform_guess():
    recorded = RECORDED["planted"]["blowup"]  # 13.0 at step 40, the last window of its warm-up, then 22.9
    [found] = replay(recorded)
    assert (found.since, found.step, found.kind) == (40, 50, "uniform") and found.loss > 3 * UNIFORM_320


def test_the_recorded_blowup_during_warm_up_is_named_within_30_steps_of_twice_a_uniform_guess():
    recorded = RECORDED["planted"]["warmup-blowup"]  # optim.lr=3 over a 150-step warm-up
    [found] = replay(recorded)
    passed = next(s for s, v in zip(recorded["steps"], recorded["loss"]) if v > 2 * UNIFORM_320)
    assert passed < found.step <= passed + 30 and found.step < recorded["warmup_steps"], (passed, found)
    assert found.kind == "uniform" and "uniform guess" in found.describe()


def test_in_warm_up_only_a_loss_twice_a_uniform_guess_counts_and_a_spike_is_still_a_spike():
    assert episodes([7.0, 6.6, 6.8, 7.5, 6.9, 6.5, 6.0], warmup=100) == []  # above the uniform guess, far below twice it
    assert episodes([5.0, 4.0, 1596.0, 3.9, 3.8], warmup=100) == []  # one window: a spike
    [found] = episodes([5.0, 4.0, 12.0, 9.0, 30.0], warmup=100)  # twice it, then above it: two windows in a row
    assert (found.since, found.step, found.best) == (30, 40, 4.0)
    [found] = episodes([13.0, 30.0], warmup=100)  # a fresh run blown up from its first window
    assert (found.since, found.step) == (10, 20)


def test_no_alarm_on_a_plateau_a_noisy_level_or_a_slow_fall_from_a_poor_start():
    plateau = [2.0 + 0.08 * math.sin(i * 1.7) for i in range(400)]
    falling = [UNIFORM_320 * 0.98**i + 1.0 for i in range(300)]
    bumpy = [2.5 - 0.001 * i + (0.6 if i % 37 == 0 else 0.0) for i in range(500)]  # single-window bumps
    assert episodes(plateau) == [] and episodes(falling) == [] and episodes(bumpy) == []


def test_the_first_window_of_a_fresh_run_warm_up_and_no_progress_yet_are_not_judged():
    assert episodes([6.9, 3.0, 2.5], warmup=0) == []  # starts above ln(320): the first window alone
    assert episodes([6.5, 6.6, 6.4, 3.0], warmup=30) == []  # within warm-up
    assert episodes([UNIFORM_320 + 0.02] * 50, warmup=0) == []  # learning nothing (a tiny LR): at the uniform guess
    [found] = episodes([6.5, 6.6, 6.7, 6.9], warmup=20)
    assert (found.since, found.step, found.kind) == (30, 40, "uniform")


def test_a_loss_above_a_uniform_guess_after_warm_up_is_one_episode():
    blowup = [4.9, 3.7, 6.2, 9.0, 20.0, 40.0, 90.0, 190.0]  # a clipped, finite, climbing run
    [found] = episodes(blowup)
    assert (found.since, found.step, found.kind, found.best) == (30, 40, "uniform", 3.7) and found.loss > UNIFORM_320
    assert "uniform guess" in found.describe() and "3.7" in found.describe()
    assert found.record()["health/divergence"] == 1.0 and found.record()["health/divergence_loss"] == 9.0


def test_one_window_above_a_uniform_guess_is_a_spike_not_a_divergence():
    assert episodes([4.9, 3.7, 3.0, 1596.0, 2.9, 2.8, 2.7]) == []  # a planted loss x1000 in one step


def test_a_sustained_climb_is_a_divergence_and_a_recovery_ends_the_episode():
    best, bound = 2.0, 2.0 + 0.5 * (UNIFORM_320 - 2.0)
    climb = [3.0, 2.5, best, 2.1, bound + 0.1, bound + 0.3, bound + 0.5, bound + 0.6, 2.2, 2.1, 2.1, 2.1, bound + 0.2,
             bound + 0.2, bound + 0.3]
    first, second = episodes(climb)
    assert (first.kind, first.since, first.step, first.best) == ("climb", 50, 70, best)
    assert first.bound == pytest.approx(bound) and first.loss < UNIFORM_320
    assert (second.since, second.step) == (130, 150)  # after three windows back below the bound: a new episode
    assert episodes(climb[:6]) == []  # two windows above the bound: not yet


def _monitor(**settings) -> tuple[HealthMonitor, list]:
    emitted: list = []

    class Metrics:
        def emit(self, step, record):
            emitted.append((step, record))

        def mark_health(self, what, step):
            pass

    monitor = HealthMonitor(HealthConfig(**settings), rank=0, warmup_steps=20, rollbacks=[], vocab_size=320)
    monitor.metrics = Metrics()
    return monitor, emitted


def _feed(monitor: HealthMonitor, losses: list[float]) -> None:
    for i, loss in enumerate(losses, 1):
        monitor.check_window(10 * i, {"train/loss": loss, "train/grad_norm": 1.0}, monitor.metrics)


def test_the_health_policies_apply_to_a_finite_divergence():
    blowup = [4.9, 3.7, 6.2, 9.0, 20.0]
    monitor, emitted = _monitor(on_divergence="warn", on_spike="off")
    _feed(monitor, blowup)  # warned once, goes on
    assert [step for step, record in emitted if record.get("health/divergence")] == [40]
    monitor, emitted = _monitor(on_divergence="off", on_spike="off")
    _feed(monitor, blowup)
    assert emitted == []
    monitor, _ = _monitor(on_divergence="stop")
    with pytest.raises(DivergenceStop) as stop:
        _feed(monitor, blowup)
    assert stop.value.step == 40 and "Tried: nothing (health.on_divergence: stop)" in str(stop.value)
    assert stop.value.record()["setting"] == "health.on_divergence"
    monitor, _ = _monitor(on_divergence="rollback")
    with pytest.raises(Rollback) as rollback:
        _feed(monitor, blowup)
    assert rollback.value.setting == "on_divergence"
    assert not monitor.may_save(40, monitor.metrics, logged=True)  # no save while above the bound


def test_a_rollback_with_no_checkpoint_says_so_not_that_the_limit_is_zero():
    monitor, _ = _monitor(on_nonfinite="rollback", max_rollbacks=3)
    message = monitor.stop_message(step=30, what="a non-finite loss or gradient norm", loss=math.nan, grad=math.nan,
                                   setting="on_nonfinite", no_checkpoint=True)
    assert "max_rollbacks=0" not in message and "no checkpoint was saved before it" in message
    assert "health.max_rollbacks=3 allows more tries" in message
