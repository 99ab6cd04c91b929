"""`raytrain-fast sweep`: Tune trials over micro-batch x accumulation at a fixed global batch, on a
real local Ray instance (2 CPUs). The CPU sweep with a memory budget one trial goes over, its table,
files and best config trained, runs from a shell: tests/test_printed_commands.py."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from raytrain_fast.config import load_config
from raytrain_fast.errors import ConfigError
from raytrain_fast.sweep import SweepSpec, max_concurrent_trials, plan, run_sweep
from raytrain_fast.sweep.results import SweepRow, format_table, pick_best, row_from_reports
from raytrain_fast.sweep.trial import MemoryBudgetExceeded, failure_reason

pytestmark = pytest.mark.unit


def _config(tmp_path: Path, *extra: str, name: str = "sw"):
    return load_config(
        "tiny",
        [
            # Long sequences on a narrow model: activations, which grow with the micro-batch,
            # dominate the memory that does not (weights, optimizer state, libraries).
            # A large vocabulary adds logits memory per token at little compute.
            "model.vocab_size=4096", "model.d_model=64", "model.num_heads=2", "model.num_layers=2",
            "model.max_seq_len=1024", "data.seq_len=1024", "data.max_tokens=200000", "train.global_batch=8", "engine.precision=fp32",
            "metrics.peak_measure_s=0.2", f"storage.uri={tmp_path / 'runs'}", *extra,
        ],
        name=name,
    )


def test_plan_derives_accumulation_and_skips_what_does_not_divide(tmp_path):
    runnable, skipped = plan(_config(tmp_path, "resources.num_workers=2"), [1, 2, 3, 4, 8])
    assert runnable == [(1, 4), (2, 2), (4, 1)]  # 8 x 2 workers = 16 sequences: more than the global 8
    assert {r.micro_batch: r.status for r in skipped} == {3: "skipped", 8: "skipped"}
    assert "not a multiple of 3 x 2 worker(s) = 6" in next(r.reason for r in skipped if r.micro_batch == 3)


def test_plan_is_the_shared_rule_and_defaults_to_the_autobatch_candidates(tmp_path):
    from raytrain_fast.microbatch import candidate_micro_batches, plan_candidates

    config = _config(tmp_path, "resources.num_workers=2", "train.global_batch=24")
    runnable, skipped = plan(config, None)
    assert runnable == [(1, 12), (2, 6), (4, 3), (12, 1)] and skipped == []
    assert [m for m, _ in runnable] == candidate_micro_batches(24, 2)
    asked = [0, 3, 5, 6, 24]
    runnable, skipped = plan(config, asked)
    expected_runnable, expected_skipped = plan_candidates(24, 2, asked)
    assert runnable == expected_runnable == [(3, 4), (6, 2)]
    assert [(r.micro_batch, r.reason) for r in skipped] == expected_skipped and {r.status for r in skipped} == {"skipped"}
    with pytest.raises(ConfigError, match="not a multiple of resources.num_workers"):
        run_sweep(_config(tmp_path, "resources.num_workers=2", "train.global_batch=7"), SweepSpec(steps=4))


def test_concurrency_comes_from_what_one_trial_holds(tmp_path):
    import dataclasses

    config = _config(tmp_path)
    cpu = dataclasses.replace(config, resources=dataclasses.replace(config.resources, use_gpu=False, cpus_per_worker=2))
    assert max_concurrent_trials(cpu, cluster_cpus=2, cluster_gpus=0) == 1
    assert max_concurrent_trials(cpu, cluster_cpus=7, cluster_gpus=0) == 3
    gpu = dataclasses.replace(config, resources=dataclasses.replace(config.resources, num_workers=2, use_gpu=True, cpus_per_worker=4))
    assert max_concurrent_trials(gpu, cluster_cpus=64, cluster_gpus=8) == 4  # GPUs bind: 8 / 2
    assert max_concurrent_trials(gpu, cluster_cpus=16, cluster_gpus=8) == 2  # CPUs bind: 16 / (2 x 4)


def test_rows_table_and_reasons():
    reports = [
        {"step": 2, "throughput/tokens_per_sec": 100.0, "memory/peak_gb": 0.5, "train/loss": 5.0},  # warm-up window
        {"step": 4, "throughput/tokens_per_sec": 300.0, "memory/peak_gb": 0.6, "train/loss": 4.0, "memory/peak_frac": 0.6},
        {"step": 6, "throughput/tokens_per_sec": 310.0, "memory/peak_gb": 0.6, "train/loss": 3.0, "memory/peak_frac": 0.6},
    ]
    done = row_from_reports(micro_batch=4, grad_accum=2, reports=reports, steps=6, error=None)
    early = row_from_reports(micro_batch=8, grad_accum=1, reports=reports[:2], steps=6, error=None)
    failed = row_from_reports(micro_batch=16, grad_accum=1, reports=[], steps=6, error="over memory budget: peak 1.2 GB")
    assert (done.status, done.tokens_per_sec, done.peak_gb, done.final_loss) == ("ok", 305.0, 0.6, 3.0)
    assert early.status == "stopped" and "behind the best trial" in early.reason
    assert pick_best([done, early, failed], objective="tokens_per_sec") is done
    table = format_table([failed, done, early, SweepRow(micro_batch=3, grad_accum=None, status="skipped", reason="x")])
    lines = table.splitlines()
    assert [line.split()[0] for line in lines[1:5]] == ["3", "4", "8", "16"]
    assert "BEST" in lines[2] and "60%" in lines[2] and "failed: over memory budget" in lines[4]
    # --objective val_loss: the lowest val/loss at the last evaluation.
    lower = row_from_reports(micro_batch=2, grad_accum=4, reports=[{**r, "val/loss": 6.0 - r["train/loss"]} for r in reports], steps=6, error=None)
    higher = row_from_reports(micro_batch=1, grad_accum=8, reports=[{**r, "val/loss": 2.0 + r["train/loss"]} for r in reports], steps=6, error=None)
    assert (lower.final_val_loss, higher.final_val_loss) == (3.0, 5.0)
    assert pick_best([higher, lower, failed], objective="val_loss") is lower
    assert failure_reason(RuntimeError("wrapped")) == "RuntimeError: wrapped"
    chained = RuntimeError("training failed")
    chained.__cause__ = MemoryBudgetExceeded("peak memory 1.20 GB > resources.memory_budget_gb 0.90 GB at step 2")
    assert failure_reason(chained).startswith("over memory budget: peak memory 1.20 GB")


def _trial(micro_batch: int, speeds: list[float], load: float = 0.5) -> SweepRow:
    reports = [{"step": 2 * (i + 1), "throughput/tokens_per_sec": v, "host/load_per_cpu": load, "train/loss": 3.0}
               for i, v in enumerate([1.0, *speeds])]  # the first window is warm-up
    return row_from_reports(micro_batch=micro_batch, grad_accum=16 // micro_batch, reports=reports, steps=2 * len(reports), error=None)


def test_a_lead_within_the_windows_spread_is_not_resolved_and_the_load_is_named():
    from raytrain_fast.sweep.results import load_note, resolution

    clear = [_trial(4, [5000, 5100, 4950]), _trial(8, [6000, 6100, 5900])]
    assert resolution(clear, objective="tokens_per_sec") == ""
    one_slow_window = [_trial(4, [2015, 11000, 11500, 12000, 12122]), _trial(16, [9885, 13000, 13120, 13500, 13893])]
    assert resolution(one_slow_window, objective="tokens_per_sec") == ""  # the middle half of the windows: no outlier
    noisy = [_trial(4, [3000, 5200, 4900], load=3.5), _trial(8, [5100, 5300, 4000], load=6.0)]
    why = resolution(noisy, objective="tokens_per_sec")
    assert why.startswith("not resolved: micro-batch 8 leads micro-batch 4 by 200 tokens/s, less than the 1,100")
    assert pick_best(noisy, objective="tokens_per_sec").micro_batch == 8  # still the median's best, said to be unsure
    table = format_table(noisy, notes=[load_note(noisy)])
    assert "5,100 [4,550-5,200]" in table and "3.50 to 6.00 across trials" in table and "other processes shared" in table
    assert resolution(noisy, objective="loss") == ""


def test_a_lead_the_machine_load_can_explain_is_not_resolved():
    from raytrain_fast.sweep.results import resolution

    # Steady windows each, so the noise check passes; the loads of `sweep --micro-batch 4,8,16 --steps 30`
    # on a busy 2-core VM: the winner ran with half the load of the runner-up.
    loaded = [_trial(4, [6000, 6050, 5980], load=1.66), _trial(8, [4000, 4030, 3990], load=3.32),
              _trial(16, [2500, 2520, 2490], load=5.92)]
    why = resolution(loaded, objective="tokens_per_sec")
    assert why.startswith("not resolved: micro-batch 4 leads micro-batch 8 by 1.50x, but it ran at a load per CPU of 1.66 "
                          "against 3.32: the load alone can make a 2.00x difference"), why
    beyond = [_trial(4, [9000, 9050, 8980], load=1.66), _trial(8, [4000, 4030, 3990], load=3.32)]
    assert resolution(beyond, objective="tokens_per_sec") == ""  # 2.25x: more than the load's 2x
    despite = [_trial(4, [4000, 4030, 3990], load=3.32), _trial(8, [3900, 3910, 3890], load=1.66)]
    assert resolution(despite, objective="tokens_per_sec") == ""  # the leader had the busier machine
    quiet = [_trial(4, [5000, 5010, 4990], load=0.4), _trial(8, [4900, 4910, 4890], load=0.9)]
    assert resolution(quiet, objective="tokens_per_sec") == ""  # below 1 per CPU: no trial was short of CPU


def test_the_best_config_has_its_own_run_name_and_only_what_differs_from_the_defaults(tmp_path):
    import yaml

    from raytrain_fast.sweep.results import best_config_yaml

    config = load_config("tiny", ["engine.precision=fp32", "train.steps=50"])
    best = _trial(8, [6000, 6100, 5900])
    text = best_config_yaml(config, best, sweep_name="tiny-sweep", objective="tokens_per_sec")
    saved = yaml.safe_load(text)
    assert saved["name"] == "tiny-mb8" and saved["train"] == {"steps": 50, "micro_batch": 8, "grad_accum": 2}
    assert "eval" not in saved and "log_every" not in saved["train"] and "checkpoint" not in saved
    path = tmp_path / "best.yaml"
    path.write_text(text)
    loaded = load_config(str(path))
    assert loaded.name == "tiny-mb8" and loaded.engine.precision == "fp32"
    assert (loaded.model, loaded.data, loaded.optim) == (config.model, config.data, config.optim)


@pytest.mark.ray
@pytest.mark.slow
def test_a_trial_error_through_ray_gets_the_shared_reason(ray_session):
    import os

    import ray
    import torch

    from raytrain_fast.microbatch import classify_error
    from raytrain_fast.sweep.runner import _error_reason
    from raytrain_fast.sweep.trial import FAILED_MARK, TrialFailed

    def raised(function) -> BaseException:
        with pytest.raises(ray.exceptions.RayError) as caught:
            ray.get(ray.remote(max_retries=0)(function).remote())
        return caught.value

    def cuda_oom():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def over_budget():  # as a trial's worker raises it (report_window)
        raise MemoryBudgetExceeded("peak memory 1.20 GB > resources.memory_budget_gb 0.90 GB at step 2")

    def trial_failed():
        raise TrialFailed(f"{FAILED_MARK}out of memory: as the trial said")

    def killed():
        os._exit(1)  # what the kernel's OOM killer leaves: a worker gone mid-task

    def broken():
        raise ValueError("no such tokenizer")

    oom = raised(cuda_oom)
    assert _error_reason(oom) == "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB" == classify_error(oom).reason
    assert _error_reason(raised(over_budget)) == "over memory budget: peak memory 1.20 GB > resources.memory_budget_gb 0.90 GB at step 2"
    assert _error_reason(raised(trial_failed)) == "out of memory: as the trial said"  # the trial's own reason first
    crashed = raised(killed)
    assert isinstance(crashed, ray.exceptions.WorkerCrashedError)
    assert classify_error(crashed).status == "oom"
    assert _error_reason(crashed).startswith("out of memory: process killed (WorkerCrashedError")
    assert _error_reason(raised(broken)) == "ValueError: no such tokenizer"


@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_on_a_mixture_over_activation_checkpointing_tries_each_micro_batch_with_each_value(ray_session, tmp_path):
    config = _config(tmp_path, "train.global_batch=2", "model.max_seq_len=256", "data.seq_len=256", "data.max_tokens=0",
                     "data.sources=[{source: stdlib, weight: 0.7}, {source: stdlib, name: again, weight: 0.3}]", name="ac")
    result = run_sweep(config, SweepSpec(micro_batches=[2, 3], activation_checkpointing=["none", "full"], steps=2, num_reports=2))
    print(result.table)
    trials = [r for r in result.rows if r.status != "skipped"]
    assert sorted((r.micro_batch, r.activation_checkpointing) for r in trials) == [(2, "full"), (2, "none")]
    assert all(r.status == "ok" for r in trials), trials  # 2 steps, both reported: ASHA has nothing to stop
    assert [r.activation_checkpointing for r in result.rows if r.status == "skipped"] == [""]  # 3: skipped for both
    names = {r.activation_checkpointing: r.run_name for r in trials}
    assert "-mb2-ac-none-" in names["none"] and "-mb2-ac-full-" in names["full"]
    # Recomputing activations changes what is kept, not the math: the same data gives the same loss.
    assert trials[0].final_loss == pytest.approx(trials[1].final_loss, rel=1e-4)

    header, *lines = result.table.splitlines()
    assert header.split()[:4] == ["micro-batch", "accum", "act.", "ckpt"]
    assert [line.split()[:3] for line in lines[:3]] == [["2", "1", "none"], ["2", "1", "full"], ["3", "-", "-"]]
    sweep_dir = tmp_path / "runs" / result.name
    with open(sweep_dir / "results.csv") as f:
        saved = list(csv.DictReader(f))
    assert [(r["micro_batch"], r["activation_checkpointing"]) for r in saved] == [("2", "none"), ("2", "full"), ("3", "")]
    summary = json.loads((sweep_dir / "results.json").read_text())
    assert summary["activation_checkpointing"] == ["none", "full"]
    assert summary["best_activation_checkpointing"] == result.best.activation_checkpointing
    # The best config sets the winning value (and leaves the config's own, none, as it is).
    best = load_config(result.best_config_path)
    assert (best.train.micro_batch, best.model.activation_checkpointing) == (2, result.best.activation_checkpointing)
    assert [(s.name, s.weight) for s in best.data.sources] == [(None, 0.7), ("again", 0.3)]  # the mixture, as given


def test_cli_rejects_an_unknown_activation_checkpointing_before_ray_starts(tmp_path, capsys):
    from raytrain_fast.cli import main

    common = ["sweep", "--micro-batch", "2", "--set", f"storage.uri={tmp_path}"]
    assert main([*common, "--activation-checkpointing", "none,partial"]) == 2
    err = capsys.readouterr().err
    assert "--activation-checkpointing takes a comma-separated list of none, full, every_n" in err and "got 'partial'" in err
    assert main([*common, "--activation-checkpointing", ","]) == 2
    assert "got none" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="got 'FULL'"):
        run_sweep(_config(tmp_path), SweepSpec(micro_batches=[8], activation_checkpointing=["FULL"], steps=4))

def test_cli_rejects_a_sweep_with_nothing_to_run_before_ray_starts(tmp_path, capsys):
    from raytrain_fast.cli import main

    assert main(["sweep", "--micro-batch", "1,x", f"--set=storage.uri={tmp_path}"]) == 2
    assert "expected comma-separated integers" in capsys.readouterr().err
    assert main(["sweep", "--micro-batch", "3,5", "--set", "train.global_batch=16", "--set", f"storage.uri={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "no --micro-batch value fits train.global_batch=16" in err and "3: global batch 16 is not a multiple of 3" in err
