"""A slowdown episode prints its paragraph once, and its sentence compares like with like."""

from __future__ import annotations

import re

import pytest

from raytrain_fast.metrics.slowdown import SlowdownDetector, Window

pytestmark = pytest.mark.unit


def _feed(detector: SlowdownDetector, seconds: list[float], first_step: int = 1):
    return [detector.update(Window(step=first_step + i, step_s=s)) for i, s in enumerate(seconds)]


def test_a_ratio_hovering_around_the_threshold_is_one_episode():
    detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=0)
    # baseline 100 ms, then 11-18% slower with windows dipping under the threshold (the pip-install case)
    results = _feed(detector, [0.1] * 3 + [0.118, 0.115, 0.107, 0.109, 0.106, 0.112, 0.118, 0.107, 0.113])
    alerts = [a for _, a in results if a is not None]
    values = [v for v, _ in results]
    assert len(alerts) == 1
    assert values[-1] == 1.0  # the episode goes on: the progress line keeps its marker
    # back to normal ends the episode; a new slowdown is a new episode with its own paragraph
    results = _feed(detector, [0.1] * 4 + [0.13] * 3, first_step=20)
    assert [v for v, _ in results][3] == 0.0
    assert len([a for _, a in results if a is not None]) == 1


def test_the_sentence_uses_the_rolling_median_as_the_ratio_does():
    detector = SlowdownDetector(threshold=0.10, num_windows=3, warmup_steps=0)
    # one huge window (a stall) among slow ones: a mean would say 7 s, the median says 130 ms
    alerts = [a for _, a in _feed(detector, [0.1] * 3 + [0.13, 21.0, 0.13]) if a is not None]
    assert len(alerts) == 1
    found = re.search(r"step time of the last 3 log windows, ([\d.]+) ms, is (\d+)% above the baseline ([\d.]+) ms", alerts[0].message)
    assert found, alerts[0].message
    median_ms, percent, base_ms = float(found[1]), int(found[2]), float(found[3])
    assert median_ms == 130.0 and base_ms == 100.0 and percent == round(100 * (median_ms / base_ms - 1))
