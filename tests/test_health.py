"""Divergence: a planted non-finite gradient rolls back, skips and finishes; a run that
keeps diverging stops with a clear error; no checkpoint ever holds a non-finite tensor.

Real Ray TorchTrainer, 2 gloo workers (1 for the diverging run), DeepSpeed ZeRO-2 in bf16 on the
CPU accelerator: the path where DeepSpeed itself does not check the gradient norm.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raytrain_fast.checkpoint.verify import state_health
from raytrain_fast.errors import DivergenceError
from raytrain_fast.launch.trainer import run
from raytrain_fast.loop.health import SpikeCheck
from raytrain_fast.drills import LoopHooks, Nonfinite, Spike, parse_drills
from raytrain_fast.metrics.sinks import read_metrics
from raytrain_fast.report import diagnose, load_run
from tests.test_train import micro_config as train_micro_config

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def micro_config(tmp_path: Path, name: str, *extra: str):
    """test_train's 2-worker bf16 micro run, saving every 5 steps and keeping them all."""
    return train_micro_config(tmp_path, name, "checkpoint.every_steps=5", "checkpoint.keep_last=20", "eval.enabled=false", *extra)


def non_finite_tensors(checkpoint: Path) -> list[str]:
    """Every floating-point tensor of every file of the checkpoint that holds an inf or NaN."""
    found: list[str] = []

    def walk(value, where: str) -> None:
        if isinstance(value, torch.Tensor):
            if value.is_floating_point() and not torch.isfinite(value).all():
                found.append(where)
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{where}/{key}")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, f"{where}[{i}]")

    files = sorted(checkpoint.rglob("*.pt"))
    assert any("model_states" in f.name for f in files) and any("optim_states" in f.name for f in files), files
    for path in files:
        walk(torch.load(path, map_location="cpu", weights_only=False), str(path.relative_to(checkpoint)))
    return found


def written_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(p for p in run_dir.glob("checkpoint_*") if p.is_dir())


def test_a_planted_nan_gradient_rolls_back_skips_and_finishes_like_a_clean_run(micro_run_uninterrupted, ray_session, tmp_path):
    clean = micro_run_uninterrupted  # test_train's micro run without the NaN (and with eval, which changes no step)
    clean_dir = Path(clean.run_dir)
    # Rank 1's gradient (not its loss) is NaN in step 12: the all-reduced gradient norm of both ranks
    # is NaN, the update is skipped on the device, and the drain at step 15 rolls back to step 10.
    planted = run(micro_config(tmp_path, "planted"), hooks=LoopHooks(Nonfinite(12, rank=1, what="grad")))

    run_dir = tmp_path / "runs" / "planted"
    records = json.loads((run_dir / "health.json").read_text())["rollbacks"]
    assert [(r["detected_step"], r["to_step"]) for r in records] == [(15, 10)]
    assert records[0]["skip_sequences"] == 5 * 8  # the 5 steps of 8 sequences read since step 10
    assert records[0]["resume_position"]["consumed"] - records[0]["position"]["consumed"] == 40
    checkpoints = written_checkpoints(run_dir)
    assert [int(p.name.rsplit("_", 1)[1]) for p in checkpoints] == [5, 10, 15, 20, 25, 30]
    for checkpoint in checkpoints:
        assert non_finite_tensors(checkpoint) == [], checkpoint
        state = json.loads((checkpoint / "train_state.json").read_text())
        assert state["health"]["finite"] is True and state_health(state) == ""
    final = json.loads((checkpoints[-1] / "train_state.json").read_text())
    assert final["health"]["rollbacks"][0]["to_step"] == 10  # the skip travels in the train state too
    assert final["data_position"]["consumed"] == 30 * 8 + 40  # 30 steps trained, 40 sequences skipped
    clean_records = "".join(p.read_text() for p in (clean_dir / "metrics").rglob("*") if p.is_file())
    assert "train/loss" in clean_records and "health/" not in clean_records  # no rollback, no spike on a clean run
    planted_records = "".join(p.read_text() for p in (run_dir / "metrics").rglob("*") if p.is_file())
    assert "health/nonfinite" in planted_records and "health/rollback" in planted_records
    clean_loss, planted_loss = clean.metrics["train/loss"], planted.metrics["train/loss"]
    assert math.isfinite(planted_loss) and abs(planted_loss - clean_loss) <= 0.1 * clean_loss
    # The report names the divergence, the checkpoint it went back to and the data it skipped; the clean run has none.
    assert not {"divergence", "spike"} & set(diagnose(load_run(str(clean_dir.parent), clean_dir.name)).keys())
    found = [f for f in diagnose(load_run(str(tmp_path / "runs"), "planted")).findings if f.key == "divergence"]
    assert [(f.numbers["step"], f.numbers["to_step"], f.numbers["skipped_sequences"]) for f in found] == [(15, 10, 40)]
    assert "Divergence at step 15: rolled back to step 10" == found[0].title


def test_a_run_that_keeps_diverging_stops_with_a_clear_error_and_keeps_a_healthy_checkpoint(ray_session, tmp_path):
    config = micro_config(
        tmp_path, "lr500", "optim.lr=500", "train.steps=12", "train.log_every=1", "checkpoint.every_steps=1",
        "checkpoint.keep_last=1", "resources.num_workers=1", "health.max_rollbacks=2",
    )
    with pytest.raises(DivergenceError) as raised:
        run(config)
    message = str(raised.value)
    assert "non-finite" in message and "Tried: rolled back from step" in message
    assert message.count("rolled back") == 2 and "optim.lr" in message and "optim.warmup_steps" in message
    run_dir = tmp_path / "runs" / "lr500"
    assert len(json.loads((run_dir / "health.json").read_text())["rollbacks"]) == 2
    checkpoints = written_checkpoints(run_dir)
    assert checkpoints, "the newest healthy checkpoint must stay in storage"
    for checkpoint in checkpoints:
        assert non_finite_tensors(checkpoint) == [], checkpoint
    found = [f for f in diagnose(load_run(str(tmp_path / "runs"), "lr500")).findings
             if f.key == "divergence" and "without a NaN" not in f.title]  # a finite blow-up before the NaN is its own
    assert len(found) == 3 and found[-1].title.endswith("and stopped")  # two rollbacks, then the stop
    assert f"the newest is at step {int(checkpoints[-1].name.rsplit('_', 1)[1])}" in found[-1].evidence[-1]


def test_a_divergence_before_any_checkpoint_stops_with_the_fix_not_a_worker_crash(ray_session, tmp_path):
    config = micro_config(tmp_path, "early", "optim.lr=500", "train.steps=12", "train.log_every=1",
                          "checkpoint.every_steps=100", "resources.num_workers=1")
    with pytest.raises(DivergenceError, match="nothing to roll back to: set checkpoint.every_steps below"):
        run(config)
    stop = json.loads((tmp_path / "runs" / "early" / "health.json").read_text())["stopped"]
    assert stop["step"] <= 12 and "non-finite" in stop["what"]

def test_a_planted_loss_spike_is_warned_once_recorded_and_reported(ray_session, tmp_path, capfd):
    """The planted spike (step 30's loss x1000 on rank 0) is warned once, recorded and reported; no other
    window is a loss spike. The micro model's gradient norm is its own: on one 2-core CPU (bf16) the clean
    run's window at step 38 read a gradient norm of 9.5 against a median of 0.8, a real gradient spike that
    the check reports as one (on another CPU's bf16 kernels it did not happen): so only loss spikes are
    held to 'the planted one alone'."""
    config = micro_config(tmp_path, "spiky", "resources.num_workers=1", "train.steps=40", "train.log_every=2",
                          "checkpoint.every_steps=20")
    run(config, hooks=LoopHooks(Spike(30, rank=0)))  # step 30's loss x1000 on rank 0: the window ending at 30
    printed = capfd.readouterr()
    text = printed.out + printed.err
    warnings = [line for line in text.splitlines() if "spike (median +" in line]
    assert len([line for line in warnings if "Step 30: a loss" in line]) == 1, warnings
    assert not [line for line in warnings if "a loss" in line and "Step 30:" not in line], warnings
    assert "spike (last at step" in text and ("1 spike (last at step 30)" in text or "2 spikes" in text)
    records = read_metrics(str(tmp_path / "runs" / "spiky"))
    spikes = {r["step"]: r for r in records if r.get("health/spike")}
    assert 30 in spikes and spikes[30]["health/spike_loss"] > 100
    others = [r for step, r in spikes.items() if step != 30]
    median_loss = statistics.median(r["train/loss"] for r in records if "train/loss" in r and r["step"] != 30)
    assert all(r["health/spike_loss"] < 2 * median_loss for r in others), others  # gradient spikes, never the loss
    report = diagnose(load_run(str(tmp_path / "runs"), "spiky"))
    assert 30 in [f.numbers["first_step"] for f in report.findings if f.key == "spike"]
    assert "divergence" not in report.keys()


def test_spike_check_flags_a_jump_but_not_a_falling_or_noisy_loss():
    falling = SpikeCheck(mads=10.0, windows=20)
    assert not any(falling.is_spike(5.0 * 0.97**i + 0.01 * (-1) ** i) for i in range(200))
    noisy = SpikeCheck(mads=10.0, windows=20)
    assert not any(noisy.is_spike(2.0 + 0.05 * ((i * 7) % 5 - 2)) for i in range(100))
    assert noisy.is_spike(4.0)
    assert not noisy.is_spike(2.05)  # the spike stayed out of the recent level


@pytest.mark.parametrize("norm", [float("nan"), float("inf"), -1.0])
def test_an_invalid_norm_leaves_weights_moments_and_step_count_as_they_were(norm):
    from raytrain_fast.engine.deepspeed_compat import skip_nonfinite_update

    weight = torch.nn.Parameter(torch.ones(64))
    optimizer = torch.optim.AdamW([weight], lr=0.1, fused=True)
    weight.grad = torch.ones(64)
    skip_nonfinite_update(optimizer, torch.tensor(2.0))
    optimizer.step()
    before = weight.detach().clone(), {k: v.clone() for k, v in optimizer.state[weight].items()}
    weight.grad = torch.full((64,), float("nan"))
    skip_nonfinite_update(optimizer, torch.tensor(norm))  # what DeepSpeed's norm of that gradient reads
    optimizer.step()
    assert torch.equal(weight.detach(), before[0])
    assert all(torch.equal(v, optimizer.state[weight][k]) for k, v in before[1].items())
    weight.grad = torch.ones(64)
    skip_nonfinite_update(optimizer, torch.tensor(2.0))
    optimizer.step()
    assert not torch.equal(weight.detach(), before[0]) and optimizer.state[weight]["step"].item() == 2


def _fake_checkpoint(run_dir: Path, step: int, state: dict) -> None:
    """A complete one-rank checkpoint as the loop writes it (files, train state, then the manifest)."""
    from raytrain_fast.checkpoint import write_rank_manifest

    directory = run_dir / f"checkpoint_{step:08d}"
    (directory / "deepspeed").mkdir(parents=True)
    (directory / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(b"weights" * 100)
    (directory / "train_state.json").write_text(json.dumps({"step": step, "world_size": 1, **state}))
    write_rank_manifest(str(directory), rank=0, world_size=1, step=step)


def test_resume_export_and_retention_keep_to_the_newest_healthy_checkpoint(tmp_path):
    import pyarrow.fs as pafs

    from raytrain_fast.checkpoint import CheckpointConfig, find_resumable_checkpoint
    from raytrain_fast.checkpoint.retention import Retention

    run_dir = tmp_path / "run"
    _fake_checkpoint(run_dir, 10, {"health": {"finite": True, "loss": 3.1, "grad_norm": 0.4}})
    _fake_checkpoint(run_dir, 20, {"metrics": {"train/loss": float("nan")}})  # an older version's NaN save
    _fake_checkpoint(run_dir, 30, {"health": {"finite": False, "loss": float("nan"), "grad_norm": float("inf")}})
    filesystem = pafs.LocalFileSystem()
    chosen, skipped = find_resumable_checkpoint(filesystem, str(run_dir))  # what resume and export use
    assert chosen.endswith("checkpoint_00000010")
    assert [(p.rsplit("_", 1)[1], "healthy" in r or "non-finite" in r) for p, r in skipped] == [("00000030", True), ("00000020", True)]

    # Retention with keep_last=1 (the Checkpointer's own, outside a Ray Train worker).
    Retention(CheckpointConfig(keep_last=1), filesystem=filesystem, run_path=str(run_dir)).prune()
    assert sorted(p.name for p in run_dir.glob("checkpoint_*")) == ["checkpoint_00000010", "checkpoint_00000030"]


def test_the_spike_and_nonfinite_drills_plant_once_at_their_step_on_their_rank():
    hooks = parse_drills(["spike=3:1"])
    assert hooks.for_rank(0).on_loss is None
    rank1 = hooks.for_rank(1)
    seen = []
    for step in (1, 2, 3, 3, 4):  # step 3 twice: a rollback goes back over it
        seen.append(rank1.on_loss(torch.tensor(2.0)).item())
        rank1.after_step(step)
    assert seen == [2.0, 2.0, 2000.0, 2.0, 2.0]
    nan = parse_drills(["nonfinite=1"]).for_rank(0)
    assert math.isnan(nan.on_loss(torch.tensor(2.0)).item())
    with pytest.raises(ValueError, match="malformed SPEC"):
        parse_drills(["spike=3:1:grad"])


def test_bench_health_times_both_variants_the_same_way_from_a_fresh_shell():
    command = [sys.executable, "-m", "raytrain_fast.cli", "bench", "health", "--steps", "1", "--rounds", "2", "--warmup-steps", "1",
               "--ops-calls", "50", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "[bench health] round 2/2" in done.stderr  # progress on stderr
    report = json.loads(done.stdout)  # stdout is the JSON alone
    assert report["order"] == [["without", "with"], ["with", "without"]]  # interleaved, the order alternating
    assert report["precision"] in ("bf16", "fp32") and report["threads"] >= 1 and report["cpu"]
    assert report["step_ms_without"] > 0 and report["step_ms_with"] > 0
    assert report["ratio_min"] <= report["ratio_with_over_without"] <= report["ratio_max"]


class _Metrics:
    """What HealthMonitor hands records to (TrainMetrics' emit and mark_health), kept to read back."""

    def __init__(self) -> None:
        self.emitted: list[tuple[int, dict]] = []
        self.marks: list[tuple[str, int]] = []

    def emit(self, step: int, record: dict) -> None:
        self.emitted.append((step, record))

    def mark_health(self, what: str, step: int) -> None:
        self.marks.append((what, step))


def _monitor(**settings):
    from raytrain_fast.config.train import HealthConfig
    from raytrain_fast.loop.health import HealthMonitor

    return HealthMonitor(HealthConfig(**settings), rank=0, warmup_steps=2, rollbacks=[]), _Metrics()


def test_each_nonfinite_policy_does_what_it_says():
    from raytrain_fast.loop.health import DivergenceStop, Rollback

    nan = {"train/loss": float("nan"), "train/grad_norm": 1.0}
    monitor, metrics = _monitor(on_nonfinite="stop")
    with pytest.raises(DivergenceStop, match=r"Tried: nothing \(health.on_nonfinite: stop\)"):
        monitor.check_window(10, nan, metrics)
    monitor, metrics = _monitor(on_nonfinite="warn")
    monitor.check_window(10, nan, metrics)  # goes on
    assert metrics.emitted == [(10, {"health/nonfinite": 1.0})] and metrics.marks == [("non-finite window", 10)]
    assert not monitor.may_save(10, metrics, logged=True)  # no save while the state is not healthy
    monitor.check_window(12, {"train/loss": 2.0, "train/grad_norm": 1.0}, metrics)
    assert monitor.may_save(12, metrics, logged=True)
    monitor, metrics = _monitor(on_nonfinite="rollback", max_rollbacks=1)
    with pytest.raises(Rollback):
        monitor.check_window(10, nan, metrics)
    monitor.rollbacks.append({"detected_step": 10, "to_step": 5, "skip_sequences": 40})
    with pytest.raises(DivergenceStop, match="rolled back from step 10 to 5 and skipped 40 sequences"):
        monitor.check_window(15, nan, metrics)  # out of tries


@pytest.mark.parametrize("policy", ["warn", "rollback", "off"])
def test_each_spike_policy_does_what_it_says(policy):
    from raytrain_fast.loop.health import Rollback

    monitor, metrics = _monitor(on_spike=policy)
    for step in range(3, 30):  # past warm-up, a gently falling loss: never a spike
        monitor.check_window(step, {"train/loss": 5.0 - 0.01 * step, "train/grad_norm": 1.0 + 0.01 * (step % 3)}, metrics)
    assert metrics.emitted == []
    spike = {"train/loss": 500.0, "train/grad_norm": 1.0}
    if policy == "rollback":
        with pytest.raises(Rollback):
            monitor.check_window(30, spike, metrics)
    else:
        monitor.check_window(30, spike, metrics)
    assert [step for step, record in metrics.emitted if record.get("health/spike")] == ([] if policy == "off" else [30])
