"""Real runs: Ray TorchTrainer, 2 gloo workers, DeepSpeed ZeRO-2 in bf16 on the CPU accelerator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from raytrain_fast.config import load_config
from raytrain_fast.launch.trainer import run
from raytrain_fast.drills import FailOnce, LoopHooks, RecordSequences

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def micro_config(tmp_path: Path, name: str, *extra: str):
    """A model small enough that bf16 (slow on CPUs without native bf16) still runs in seconds."""
    return load_config(
        "tiny",
        [
            "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
            "data.seq_len=32", "data.max_tokens=60000", "train.micro_batch=4", "train.global_batch=8",
            "train.steps=30", "train.log_every=5", "checkpoint.every_steps=10", "optim.warmup_steps=3",
            "optim.lr=0.01", "resources.num_workers=2", "resources.max_failures=0", "engine.precision=bf16",
            f"storage.uri={tmp_path / 'runs'}", *extra,
        ],
        name=name,
    )


def by_step(result) -> dict[int, dict]:
    return {metrics["step"]: metrics for _, metrics in result.checkpoints}


def recorded_sequences(directory: Path) -> dict[int, dict[int, list[int]]]:
    """rank -> step -> sequence ids, the last record of a step winning (a resumed run repeats the
    steps after its checkpoint; what counts is what the surviving run trained on)."""
    seen: dict[int, dict[int, list[int]]] = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        rank = int(path.stem.removeprefix("rank"))
        for line in path.read_text().splitlines():
            record = json.loads(line)
            seen.setdefault(rank, {})[record["step"]] = record["ids"]
    return seen


@pytest.fixture
def uninterrupted(micro_run_uninterrupted):
    """micro_config's run, trained once for the session (tests/conftest.py)."""
    return micro_run_uninterrupted


def test_two_worker_zero2_bf16_loss_falls_and_checkpoint_has_both_shards(uninterrupted):
    steps = by_step(uninterrupted)
    assert sorted(steps) == [10, 20, 30]
    assert steps[30]["train/loss"] < steps[10]["train/loss"] < math.log(257)
    deepspeed_dir = Path(uninterrupted.checkpoint, "deepspeed")
    names = sorted(p.name for p in deepspeed_dir.iterdir())
    assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in names
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in names
    assert "mp_rank_00_model_states.pt" in names


def test_rerun_with_same_name_resumes_at_the_right_step_and_lr(uninterrupted, ray_session, tmp_path):
    marker = tmp_path / "failed-once"
    hooks = LoopHooks(FailOnce(25, str(marker), rank=1), RecordSequences(str(tmp_path)))
    config = micro_config(tmp_path, "crashy")
    with pytest.raises(Exception, match="injected failure at step 25 on rank 1"):
        run(config, hooks=hooks)  # max_failures=0: the job dies, as a preempted job would
    assert marker.exists()
    kept = sorted(p.name for p in Path(tmp_path, "runs", "crashy").glob("checkpoint_0*"))
    assert kept == ["checkpoint_00000010", "checkpoint_00000020"]

    resumed = run(config, hooks=hooks)  # the same command again (the marker keeps the failure from repeating)
    steps = by_step(resumed)
    assert steps[30]["start_step"] == 20  # continued from the step-20 checkpoint, not from 0
    from raytrain_fast.metrics.sinks import read_metrics

    evaluated = [r["step"] for r in read_metrics(resumed.run_dir) if "val/loss" in r]
    assert evaluated == [10, 20, 30], evaluated  # on its cadence after the resume too: none at its first log step, 25
    assert steps[30]["tokens"] == uninterrupted.metrics["tokens"] == 30 * 8 * 32
    assert steps[30]["train/lr"] == pytest.approx(by_step(uninterrupted)[30]["train/lr"], rel=1e-6)
    assert steps[30]["train/loss"] < steps[10]["train/loss"]
    # Exact data resume: every rank trained on the same sequences at every step as the
    # uninterrupted run with the same seed; none seen twice within the epoch, none skipped.
    sequences = recorded_sequences(tmp_path)
    assert sequences == uninterrupted.sequences
    for rank_steps in sequences.values():
        ids = [i for step in sorted(rank_steps) for i in rank_steps[step]]
        assert len(ids) == len(set(ids)) == 30 * 4


def test_finished_run_rerun_does_nothing_and_says_how_to_continue(uninterrupted, ray_session, capfd):
    config = micro_config(Path(uninterrupted.run_dir).parent.parent, "straight")
    again = run(config)
    assert again.checkpoint == uninterrupted.checkpoint
    assert "already reached train.steps=30" in capfd.readouterr().out


def test_evaluation_never_changes_what_or_how_it_trains(uninterrupted, ray_session, tmp_path):
    """The uninterrupted run evaluates (eval.enabled=auto on the stdlib corpus's split: before every
    checkpoint); the same run with eval off trains on exactly the same sequences at every step on
    every rank, to the same losses (no data position, RNG stream or gradient touched)."""
    evaluated = by_step(uninterrupted)
    assert all(0 < evaluated[step]["val/loss"] < math.log(257) for step in (10, 20, 30))
    assert all(evaluated[step]["time/eval_s"] > 0 for step in (10, 20, 30))
    plain = run(micro_config(tmp_path, "no-eval", "eval.enabled=false"), hooks=LoopHooks(RecordSequences(str(tmp_path))))
    assert recorded_sequences(tmp_path) == uninterrupted.sequences
    for step, metrics in by_step(plain).items():
        assert "val/loss" not in metrics
        assert metrics["train/loss"] == pytest.approx(evaluated[step]["train/loss"], rel=1e-5)


def test_val_loss_falls_over_the_quickstart(ray_session, tmp_path):
    """The quickstart as the README runs it (the tiny preset's 300 steps on the stdlib corpus, its
    held-out split evaluated at every checkpoint), in fp32 so it is quick on any CPU: the held-out
    loss falls from the first evaluation to the last."""
    from raytrain_fast.metrics.sinks import read_metrics

    config = load_config("tiny", ["engine.precision=fp32", "metrics.peak_measure_s=0.2", f"storage.uri={tmp_path / 'runs'}"])
    run(config)
    val = [(r["step"], r["val/loss"]) for r in read_metrics(str(tmp_path / "runs" / "tiny")) if "val/loss" in r]
    assert [s for s, _ in val] == [100, 200, 300], val
    assert val[-1][1] < val[0][1], val


def test_a_compiled_run_reports_compile_time_once_and_resumes_eager(ray_session, tmp_path, capfd):
    """engine.compile=on (regional, per block) through the real loop and DeepSpeed: the first step's
    compile time is logged once as time/compile_s and kept out of tokens/s; its checkpoint resumes
    with compile off and training continues from it (the same parameter names either way)."""
    from raytrain_fast.metrics.sinks import read_metrics

    def config(compile_setting: str, steps: int, patches: str = "auto"):
        return micro_config(
            tmp_path, "compiled", "resources.num_workers=1", "train.global_batch=4", f"train.steps={steps}",
            "train.log_every=2", "checkpoint.every_steps=4", "eval.enabled=false", "engine.precision=fp32",
            f"engine.compile={compile_setting}", f"engine.deepspeed_patches={patches}",
        )

    run(config("on", 4))
    out = capfd.readouterr().out
    assert "Compile: on, 2 blocks compiled on their first step (engine.compile=on)" in out
    assert "patch(es) in force: clip-without-host-sync, grad-norm-without-fp64-copies" in out  # the startup line
    assert 0 <= out.index("Checkpoint saves reuse") < out.index("step 2/4")  # its memory reserved before the first step
    records = read_metrics(str(tmp_path / "runs" / "compiled"))
    compile_times = [r["time/compile_s"] for r in records if "time/compile_s" in r]
    assert len(compile_times) == 1 and compile_times[0] > 0
    first = next(r for r in records if "throughput/tokens_per_sec" in r)
    # The window of step 2 timed step 2 only: the compiled first step would dominate it otherwise.
    assert first["step"] == 2 and first["time/step_s"] < compile_times[0]

    resumed = run(config("off", 8, patches="off"))  # DeepSpeed's own methods resume our patched run's checkpoint
    out = capfd.readouterr().out
    assert "Compile:" not in out and "no patches (engine.deepspeed_patches=off)" in out
    assert by_step(resumed)[8]["start_step"] == 4
    records = read_metrics(str(tmp_path / "runs" / "compiled"))
    assert [r["step"] for r in records if "time/compile_s" in r] == [2]  # the eager restart compiled nothing
    losses = {r["step"]: r["train/loss"] for r in records if "train/loss" in r}
    assert losses[8] < losses[2]


def test_resize_round_trip_two_one_two_workers(uninterrupted, ray_session, tmp_path, capfd):
    """2 workers, stopped after the step-10 checkpoint; resumed on 1 worker (a universal checkpoint
    converted once and cached beside the checkpoint), stopped after step 20; resumed on 2 workers to
    the end. The global batch (8) is kept: 4 x 1 x 2, then 4 x 2 x 1.

    Data: each step trains on exactly the sequences the uninterrupted run trained on at that step
    (the global stream is sliced anew; no sequence twice, none skipped). Loss: not bitwise. The
    1-worker phase sums two micro-batches' gradients by accumulation instead of an all-reduce of two
    ranks, and ZeRO-2 partitions the fp32 master weights and Adam moments differently, so the bf16
    gradients and the order of fp32 additions differ in their last bits, and the difference grows over
    the steps. Stated tolerance: the window loss at steps 20 and 30 within 2% of the uninterrupted run's."""
    from raytrain_fast.checkpoint.verify import list_checkpoint_dirs, verify_checkpoint
    from raytrain_fast.checkpoint.resize import ensure_universal
    from raytrain_fast.storage import StorageConfig, resolve_filesystem

    phases = [(2, 15), (1, 25), (2, None)]  # (workers, the step after which the run is stopped)
    results, phase_steps = [], [range(1, 11), range(11, 21), range(21, 31)]
    for index, (workers, stop_at) in enumerate(phases):
        record = tmp_path / f"sequences{index}"
        record.mkdir()
        config = micro_config(tmp_path, "resize", f"resources.num_workers={workers}")
        if stop_at is None:
            results.append(run(config, hooks=LoopHooks(RecordSequences(str(record)))))
        else:
            hooks = LoopHooks(FailOnce(stop_at, str(tmp_path / f'stopped{index}'), rank=0), RecordSequences(str(record)))
            with pytest.raises(Exception, match=f"injected failure at step {stop_at}"):
                run(config, hooks=hooks)
    out = capfd.readouterr().out
    assert "Resized at step 10: 2 -> 1 workers (micro_batch 4 x grad_accum 2 per worker), converted to a universal checkpoint in" in out
    assert "Resized at step 20: 1 -> 2 workers (micro_batch 4 x grad_accum 1 per worker), converted to a universal checkpoint in" in out

    # Every training sequence of the epoch exactly once, each step the same set as without resizes.
    expected = {step: sorted(i for rank in uninterrupted.sequences.values() for i in rank[step]) for step in range(1, 31)}
    seen: dict[int, list[int]] = {}
    for index, steps in enumerate(phase_steps):
        for rank, by_rank in recorded_sequences(tmp_path / f"sequences{index}").items():
            for step in steps:
                seen.setdefault(step, []).extend(by_rank[step])
    assert {step: sorted(ids) for step, ids in seen.items()} == expected
    every = [i for ids in seen.values() for i in ids]
    assert len(every) == len(set(every)) == 30 * 8

    # Step, LR and loss continue.
    final, reference = by_step(results[-1]), by_step(uninterrupted)
    assert sorted(final) == [10, 20, 30] and final[30]["start_step"] == 20
    assert final[30]["tokens"] == reference[30]["tokens"]
    print("resize: relative loss differences", {s: final[s]["train/loss"] / reference[s]["train/loss"] - 1 for s in (10, 20, 30)})
    for step in (20, 30):
        assert final[step]["train/lr"] == pytest.approx(reference[step]["train/lr"], rel=1e-6)
        assert final[step]["train/loss"] == pytest.approx(reference[step]["train/loss"], rel=0.02)

    # The cache sits beside the checkpoints, is never listed as one, and is reused by a later resize;
    # the original checkpoints are untouched (their checksums still verify).
    filesystem, run_path = resolve_filesystem(str(tmp_path / "runs" / "resize"), StorageConfig())
    names = sorted(p.name for p in Path(tmp_path, "runs", "resize").iterdir() if p.is_dir() and p.name.startswith("checkpoint_"))
    assert names == [
        "checkpoint_00000010", "checkpoint_00000010.universal", "checkpoint_00000020", "checkpoint_00000020.universal",
        "checkpoint_00000030",
    ]
    assert [step for step, _ in list_checkpoint_dirs(filesystem, run_path)] == [30, 20, 10]
    for step in (10, 20):
        assert verify_checkpoint(filesystem, f"{run_path}/checkpoint_{step:08d}", checksums=True)[0]
    cache, seconds = ensure_universal(filesystem, f"{run_path}/checkpoint_00000010", local_checkpoint="/nonexistent", step=10)
    assert cache.endswith("checkpoint_00000010.universal") and seconds is None  # reused, not converted again
