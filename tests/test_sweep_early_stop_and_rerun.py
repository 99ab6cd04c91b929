"""Sweeps without running Tune: which trials stop early, and a rerun of
the same sweep replacing its earlier outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow.fs as pafs
import pytest
from ray.tune.schedulers import TrialScheduler

from raytrain_fast.sweep.runner import replace_previous_results
from raytrain_fast.sweep.stopping import NOISE_MARGIN, NoiseAwareStopper, grace_windows

pytestmark = pytest.mark.unit


def _feed(stopper, trial_id: str, values: list[float]) -> list[str]:
    trial = SimpleNamespace(trial_id=trial_id)
    return [stopper.on_trial_result(None, trial, {"training_iteration": i + 1, "tok": v}) for i, v in enumerate(values)]


def test_a_trial_inside_timing_noise_is_never_stopped():
    stopper = NoiseAwareStopper(metric="tok", mode="max", grace=grace_windows(6))
    assert grace_windows(6) == 3 and grace_windows(3) == 2
    assert set(_feed(stopper, "a", [900, 1000, 1010, 990, 1000, 1005])) == {TrialScheduler.CONTINUE}
    # The trial's case: 6% slower than the one before, at every window. Within the noise: runs to the end.
    assert set(_feed(stopper, "b", [800, 940, 950, 930, 940, 945])) == {TrialScheduler.CONTINUE}


def test_a_trial_clearly_behind_stops_after_the_grace_windows():
    stopper = NoiseAwareStopper(metric="tok", mode="max", grace=3)
    _feed(stopper, "a", [900, 1000, 1000, 1000])
    decisions = _feed(stopper, "c", [400, 500, 520, 510])  # half the speed
    assert decisions[:2] == [TrialScheduler.CONTINUE] * 2  # the grace windows always run
    assert decisions[2] == TrialScheduler.STOP
    # Minimising (loss): more than the margin above the best stops; a better trial never does.
    loss = NoiseAwareStopper(metric="tok", mode="min", grace=2)
    _feed(loss, "a", [5.0, 3.0, 2.9])
    assert _feed(loss, "b", [5.0, 3.0 * (1 + NOISE_MARGIN) + 0.2, 3.5])[1] == TrialScheduler.STOP
    assert set(_feed(loss, "c", [5.0, 2.5, 2.4])) == {TrialScheduler.CONTINUE}


def test_rerunning_a_sweep_replaces_its_earlier_outputs(tmp_path):
    sweep = tmp_path / "sw-sweep"
    (sweep / "trials" / "sw-sweep-mb1-aaaa").mkdir(parents=True)
    (sweep / "tune" / "run_trial_aaaa").mkdir(parents=True)
    (sweep / "results.csv").write_text("old")
    (sweep / "notes.txt").write_text("the user's own file")
    filesystem = pafs.LocalFileSystem()
    assert replace_previous_results(filesystem, str(sweep))
    assert sorted(p.name for p in sweep.iterdir()) == ["notes.txt"]
    assert not replace_previous_results(filesystem, str(sweep))  # a first run: nothing to replace
