"""Learning-rate schedules in real runs (Ray TorchTrainer, DeepSpeed ZeRO-2, one CPU worker, fp32): a
wsd run's logged LR follows the wsd formula at every step, a decay branched from a mid-run
checkpoint trains with the new schedule from that step on, and a resume with another optim.lr trains
at it and says so. Every step is a log step, so `train/lr` is read at each one."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import yaml

from raytrain_fast.config import load_config
from raytrain_fast.launch.trainer import run
from raytrain_fast.metrics.sinks import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.ray]

LR = 0.01


def config(storage: Path, *extra: str):
    return load_config(
        "tiny",
        [
            "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
            "data.seq_len=32", "data.max_tokens=60000", "train.micro_batch=4", "train.global_batch=4",
            "train.log_every=1", "checkpoint.every_steps=4", "optim.warmup_steps=2", f"optim.lr={LR}",
            "optim.min_lr_ratio=0.1", "resources.num_workers=1", "resources.max_failures=0",
            "engine.precision=fp32", "eval.enabled=false", f"storage.uri={storage}", *extra,
        ],
        name="sched",
    )


def logged_lr(storage: Path) -> dict[int, float]:
    return {r["step"]: r["train/lr"] for r in read_metrics(str(storage / "sched")) if "train/lr" in r}


# The stable run every branch starts from: wsd over 8 steps whose decay is its last 2 (steps 6-8).
STABLE = ("train.steps=8", "optim.schedule=wsd", "optim.decay_steps=2", "optim.decay_shape=sqrt")


@pytest.fixture(scope="module")
def stable_run(ray_session, tmp_path_factory):
    storage = tmp_path_factory.mktemp("stable") / "runs"
    run(config(storage, *STABLE))
    return storage, logged_lr(storage)


def branch_of(stable_run, tmp_path: Path) -> Path:
    """A copy of the stable run's storage: each test resumes its own."""
    storage = tmp_path / "runs"
    shutil.copytree(stable_run[0], storage)
    return storage


def test_a_wsd_run_logs_the_wsd_learning_rate_at_every_step(stable_run):
    lr = stable_run[1]
    assert sorted(lr) == list(range(1, 9))
    # The LR logged at step N is the one step N+1 trains with: warmup over steps 0-1, the peak from
    # step 2 to the decay's first step (6), then 1 - sqrt(progress) down to min_lr_ratio at step 8.
    for step, value in lr.items():
        if step < 2:
            expected = LR * (step + 1) / 2
        elif step <= 6:
            expected = LR
        else:
            expected = LR * (0.1 + 0.9 * (1 - math.sqrt((step - 6) / 2)))
        assert value == pytest.approx(expected, rel=1e-6), (step, value, expected)
    assert lr[8] == pytest.approx(LR * 0.1, rel=1e-6)


def test_a_decay_branched_from_a_mid_run_checkpoint_follows_the_new_schedule(stable_run, tmp_path, capfd):
    """The annealing branch: from the step-4 checkpoint, decay linearly over the 4 steps left."""
    storage = branch_of(stable_run, tmp_path)
    result = run(config(storage, *STABLE, "checkpoint.resume=4", "optim.decay_steps=4", "optim.decay_shape=linear"))
    out = capfd.readouterr().out
    assert "Resuming at step 4 with changed optimizer settings, in effect from this step on: " \
           "optim.decay_steps: 2 -> 4; optim.decay_shape: 'sqrt' -> 'linear'" in out
    assert result.metrics["start_step"] == 4
    branched, stable = logged_lr(storage), stable_run[1]
    assert [branched[s] for s in range(1, 5)] == [stable[s] for s in range(1, 5)]  # the checkpoint's steps
    decay = [branched[s] for s in range(4, 9)]
    assert decay == pytest.approx([LR * (0.1 + 0.9 * (1 - (s - 4) / 4)) for s in range(4, 9)], rel=1e-6)
    assert branched[5] < stable[5] == LR  # the stable run was still at its peak there
    # The branch's checkpoint records the schedule it trained with.
    saved = yaml.safe_load((storage / "sched" / "checkpoint_00000008" / "config.yaml").read_text())
    assert saved["optim"]["decay_steps"] == 4 and saved["optim"]["decay_shape"] == "linear"


def test_a_resume_with_a_lower_lr_trains_at_it_and_says_so(stable_run, tmp_path, capfd):
    """The issue's report: --set optim.lr=... on a resume went on with the checkpoint's LR."""
    storage = branch_of(stable_run, tmp_path)
    run(config(storage, *STABLE, "checkpoint.resume=4", f"optim.lr={LR / 2}"))
    out = capfd.readouterr().out
    assert f"with changed optimizer settings, in effect from this step on: optim.lr: {LR} -> {LR / 2}" in out
    lowered, stable = logged_lr(storage), stable_run[1]
    # The same schedule at half the peak from the resumed step on: half of what the stable run logged.
    for step in range(5, 9):
        assert lowered[step] == pytest.approx(stable[step] / 2, rel=1e-6), step
