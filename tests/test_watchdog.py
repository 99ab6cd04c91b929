"""The hang watchdog: its decisions on planted heartbeats, and a real 2-worker run with one worker
frozen (SIGSTOP) mid-step, which is named with its stack and restarted from its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_fast.config import load_config
from raytrain_fast.config.watchdog import WatchdogConfig
from raytrain_fast.watchdog.hang import HangWatch, RankStack, parse_py_spy, stuck_ranks, top_frame, training_thread

pytestmark = pytest.mark.unit

_WAITING = """Thread 10 (idle): "TrainingThread(train_fn)"
    all_reduce (torch/distributed/distributed_c10d.py:3252)
    TorchBackend.all_reduce (deepspeed/comm/torch.py:290)
    DeepSpeedEngine.backward (deepspeed/runtime/engine.py:3431)
    train_step (raytrain_fast/loop/train_loop.py:58)
    run_steps (raytrain_fast/loop/train_loop.py:338)
"""
_COMPUTING = """Thread 11 (idle): "TrainingThread(train_fn)"
    grad_handling_hook (deepspeed/runtime/zero/stage_1_and_2.py:1372)
    backward (torch/autograd/__init__.py:395)
    train_step (raytrain_fast/loop/train_loop.py:58)
    run_steps (raytrain_fast/loop/train_loop.py:338)
Thread 12 (idle): "raytrain-fast-heartbeat"
    all_reduce (torch/distributed/distributed_c10d.py:1)
"""


_IN_A_WRAPPER = """Thread 13 (idle): "TrainingThread(train_fn)"
    instrument_w_nvtx.<locals>.wrapped_fn (deepspeed/utils/nvtx.py:31)
    DeepSpeedZeroOptimizer.step (deepspeed/runtime/zero/stage_1_and_2.py:2001)
    instrument_w_nvtx.<locals>.wrapped_fn (deepspeed/utils/nvtx.py:31)
    DeepSpeedEngine.step (deepspeed/runtime/engine.py:2400)
    train_step (raytrain_fast/loop/train_loop.py:60)
    run_steps (raytrain_fast/loop/train_loop.py:338)
"""


def test_the_top_of_a_stack_is_the_innermost_frame_that_is_not_a_wrapper():
    """A rank frozen while DeepSpeed's NVTX decorator calls into C (seen in CI) is shown in the DeepSpeed
    function it wraps; a stack with no wrapper shows its innermost frame."""
    assert top_frame(training_thread(parse_py_spy(_IN_A_WRAPPER))).startswith("DeepSpeedZeroOptimizer.step (")
    assert top_frame(training_thread(parse_py_spy(_COMPUTING))).startswith("grad_handling_hook (")
    assert top_frame(None) == "no stack"


def _beats(watch: HangWatch, now: float, steps: dict[int, int], *, phase: str = "train", start: int = 0) -> None:
    for rank, step in steps.items():
        watch.beat(rank=rank, world_size=len(steps), pid=100 + rank, node_id="n", step=step, start_step=start, phase=phase, now=now)


def test_the_first_step_is_not_watched_and_a_stalled_group_fires_once():
    watch = HangWatch(timeout_s=10, min_timeout_s=60)
    _beats(watch, 0.0, {0: 0, 1: 0})
    assert watch.check(100.0) is None  # still in its first (compiled) step: not armed
    _beats(watch, 101.0, {0: 1, 1: 1})
    assert watch.check(110.0) is None
    stuck = watch.check(112.0)
    assert stuck is not None and stuck.step == 1 and stuck.stuck_s == pytest.approx(11.0)
    assert watch.check(200.0) is None  # once per worker group
    _beats(watch, 201.0, {0: 0, 1: 0})  # the same pids: still the hung group, ignored
    assert watch.check(300.0) is None


def test_a_restarted_group_is_watched_again_from_its_second_step():
    watch = HangWatch(timeout_s=10, min_timeout_s=60)
    _beats(watch, 0.0, {0: 5, 1: 5})
    _beats(watch, 1.0, {0: 6, 1: 6})
    assert watch.check(20.0) is not None
    watch.retire_all()
    for rank in (0, 1):  # new processes, restored at step 5
        watch.beat(rank=rank, world_size=2, pid=200 + rank, node_id="n", step=5, start_step=5, phase="train", now=30.0)
    assert watch.check(60.0) is None
    for rank in (0, 1):
        watch.beat(rank=rank, world_size=2, pid=200 + rank, node_id="n", step=6, start_step=5, phase="train", now=61.0)
    assert watch.check(72.0) is not None


def test_a_save_is_not_watched_and_restarts_the_clock():
    watch = HangWatch(timeout_s=10, min_timeout_s=60)
    _beats(watch, 0.0, {0: 1, 1: 1})
    _beats(watch, 1.0, {0: 2, 1: 2})
    for second in range(5, 101):  # a long save: both ranks beat on, in the unwatched phase
        _beats(watch, float(second), {0: 2, 1: 2}, phase="save")
    assert watch.check(100.5) is None
    for second in range(101, 113):
        _beats(watch, float(second), {0: 2, 1: 2})
    assert watch.check(111.0) is None and watch.check(112.0) is not None


def test_a_rank_frozen_during_a_save_is_watched_once_its_heartbeats_stop():
    watch = HangWatch(timeout_s=10, min_timeout_s=60, beat_interval_s=1.0)
    _beats(watch, 0.0, {0: 1, 1: 1})
    _beats(watch, 1.0, {0: 2, 1: 2}, phase="save")  # rank 1 froze right after this beat
    for second in range(2, 20):  # rank 0 trains on, then waits in the next collective
        watch.beat(rank=0, world_size=2, pid=100, node_id="n", step=3, start_step=0, phase="train", now=float(second))
    stuck = watch.check(25.0)
    assert stuck is not None and [b.rank for b in stuck.ranks] == [0, 1]


def test_a_rank_that_froze_before_its_second_beat_is_watched():
    watch = HangWatch(timeout_s=10, min_timeout_s=60, beat_interval_s=1.0)
    watch.beat(rank=1, world_size=2, pid=101, node_id="n", step=0, start_step=0, phase="train", now=0.0)  # then froze
    for second in range(0, 5):
        watch.beat(rank=0, world_size=2, pid=100, node_id="n", step=4, start_step=0, phase="train", now=float(second))
    assert watch.check(16.0) is not None


def test_auto_timeout_is_twenty_step_times_with_a_floor():
    watch = HangWatch(timeout_s="auto", min_timeout_s=60)
    assert watch.timeout_s() == 60  # nothing measured yet: the floor
    for step in range(1, 40):  # 0.5 s per step after the first
        _beats(watch, step * 0.5, {0: step, 1: step})
    assert watch.timeout_s() == 60
    slow = HangWatch(timeout_s="auto", min_timeout_s=60)
    for step in range(1, 20):
        _beats(slow, step * 10.0, {0: step, 1: step})
    assert slow.timeout_s() == pytest.approx(200.0)


def test_the_rank_outside_the_collective_is_named():
    stacks = [
        RankStack(rank=0, pid=1, text=_WAITING, dumped=True, beat_age_s=0.5),
        RankStack(rank=1, pid=2, text=_COMPUTING, dumped=True, beat_age_s=30.0),
    ]
    assert stuck_ranks(stacks, beat_interval_s=1.0) == [1]
    # every rank in a collective: the one whose heartbeats stopped
    both = [RankStack(rank=r, pid=r, text=_WAITING, dumped=True, beat_age_s=age) for r, age in ((0, 0.5), (1, 30.0))]
    assert stuck_ranks(both, beat_interval_s=1.0) == [1]


def _actor_loop_ends(tmp_path: Path, *, ended: bool) -> None:
    """The coordinator actor's event loop with the hang watchdog running, gone as an actor's goes at
    the end of a run: with `ended`, after `end()` (what `Coordinator.end` asks of it before the kill)."""
    import asyncio
    import gc

    import pyarrow.fs as pafs

    from raytrain_fast.coordinator import _CoordinatorActor

    loop = asyncio.new_event_loop()
    actor = _CoordinatorActor("ending")
    loop.run_until_complete(actor.start_watchdog(
        timeout_s=60, min_timeout_s=10, beat_interval_s=1.0, filesystem=pafs.LocalFileSystem(), run_path=str(tmp_path),
    ))
    loop.run_until_complete(asyncio.sleep(0.01))  # the watchdog's task is waiting for its next check
    if ended:
        loop.run_until_complete(actor.end())
    loop.close()
    del actor, loop
    gc.collect()


def test_the_end_of_a_run_leaves_no_watchdog_task_pending(tmp_path, caplog):
    """asyncio printed "Task was destroyed but it is pending!" when a run ended: the watchdog's task was
    still pending when the actor's loop went."""
    with caplog.at_level("ERROR", logger="asyncio"):
        _actor_loop_ends(tmp_path, ended=False)  # the check sees the message where nothing ends the task
    assert "Task was destroyed but it is pending" in caplog.text
    caplog.clear()
    with caplog.at_level("ERROR", logger="asyncio"):
        _actor_loop_ends(tmp_path, ended=True)
    assert "Task was destroyed" not in caplog.text, caplog.text


def test_process_group_timeout_exceeds_the_watchdog():
    assert WatchdogConfig(hang_timeout_s=10).process_group_timeout_s() == 300
    assert WatchdogConfig().process_group_timeout_s() == 720  # auto: at most 600 s, then 2 minutes for the stacks
    assert WatchdogConfig(hang_timeout_s=0).process_group_timeout_s() == 1800  # off: Ray's default


_NEW_GROUP = r"""
import datetime, os, sys, time, torch, torch.distributed as dist
from raytrain_fast.watchdog.heartbeat import set_new_group_timeout
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
assert set_new_group_timeout(2)
group = dist.new_group(ranks=[0, 1])  # as DeepSpeed clones the world group: no timeout given
if rank == 1:
    time.sleep(60)
    os._exit(0)
started = time.monotonic()
try:
    dist.all_reduce(torch.ones(1), group=group)
except RuntimeError:
    print(f"timed out after {time.monotonic() - started:.1f} s")
os._exit(0)
"""


@pytest.mark.ray
def test_process_groups_made_later_time_out_with_the_watchdog(tmp_path):
    import subprocess
    import sys

    init = f"file://{tmp_path / 'rendezvous'}"
    other = subprocess.Popen([sys.executable, "-c", _NEW_GROUP, "1", init], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        done = subprocess.run([sys.executable, "-c", _NEW_GROUP, "0", init], capture_output=True, text=True, timeout=100)
    finally:
        other.kill()
    assert "timed out after" in done.stdout, done.stderr[-2000:]
    assert float(done.stdout.split("after ")[1].split(" s")[0]) < 10  # torch's own default: 30 minutes


def test_bad_watchdog_settings_are_named(tmp_path):
    from raytrain_fast.config import validate
    from raytrain_fast.errors import ConfigError

    config = load_config("tiny", ["watchdog.hang_timeout_s=-1", "watchdog.min_timeout_s=0", f"storage.uri={tmp_path}"])
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert "watchdog.hang_timeout_s" in str(error.value) and "watchdog.min_timeout_s" in str(error.value)


def test_the_hang_drill_spec_is_checked_before_a_run():
    from raytrain_fast.drills import Hang, LoopHooks, parse_drills

    assert parse_drills(["hang=30:/tmp/m:1"]) == LoopHooks(Hang(30, "/tmp/m", rank=1))
    for bad in ("hang=/tmp/m", "hang=0:/tmp/m", "hang=3:"):
        with pytest.raises(ValueError, match="malformed SPEC for hang"):
            parse_drills([bad])


def test_the_sleeping_hang_drill_freezes_its_step_once(tmp_path):
    import time

    from raytrain_fast.drills import plants as drills

    step = [0]
    marker = tmp_path / "froze"
    batches = drills.hang_data(iter(range(10)), drills.hang_spec(f"3:{marker}:0:0.3"), current_step=lambda: step[0])
    took = []
    for _ in range(2):  # the same step twice, as a restarted run would train it again
        for step[0] in range(5):
            started = time.monotonic()
            next(batches)
            took.append(time.monotonic() - started)
        step[0] = 0
    assert took[2] >= 0.3 and max(took[:2] + took[3:]) < 0.2 and marker.exists()


HANG_TIMEOUT_S = 10


@pytest.mark.ray
@pytest.mark.slow
def test_a_frozen_worker_is_named_with_its_stack_and_the_run_resumes(ray_session, tmp_path, capfd):
    from raytrain_fast.launch.trainer import run
    from raytrain_fast.drills import Hang, LoopHooks

    marker = tmp_path / "froze"
    config = load_config("tiny", [
        "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32", "data.seq_len=32",
        "data.max_tokens=60000", "train.micro_batch=4", "train.global_batch=8", "train.steps=30", "train.log_every=5",
        "checkpoint.every_steps=10", "optim.warmup_steps=3", "resources.num_workers=2", "resources.max_failures=1",
        "engine.precision=fp32", f"watchdog.hang_timeout_s={HANG_TIMEOUT_S}", f"storage.uri={tmp_path / 'runs'}",
    ], name="frozen")
    result = run(config, hooks=LoopHooks(Hang(15, str(marker), rank=1)))

    assert max(m["step"] for _, m in result.checkpoints) == 30  # resumed and finished
    froze_at = float(marker.read_text())
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "runs" / "frozen" / "hangs").glob("hang-*.json"))]
    assert len(records) == 1
    hang = records[0]
    assert hang["stuck_ranks"] == [1] and hang["waiting_ranks"] == [0]
    assert hang["time"] - froze_at <= HANG_TIMEOUT_S + 30
    assert hang["step"] == 14 and hang["stuck_s"] >= HANG_TIMEOUT_S
    stacks = (tmp_path / "runs" / "frozen" / hang["stacks_file"]).read_text()
    # Where rank 1's training thread was when the process froze (the batch producer froze it, so any frame
    # of the step): a frame of its own dump, never a pass-through wrapper.
    top = hang["ranks"]["1"]["top"]
    assert top in stacks.split("=== rank 1")[1] and "nvtx.py" not in top and "(" in top
    assert "=== rank 1" in stacks and "train_step" in stacks and "all_reduce" in stacks
    out = capfd.readouterr().out
    assert "HANG at step 14" in out and "Resumed at step 10 after a hang at step 14: rank 1" in out

    from raytrain_fast.report import diagnose, load_run

    findings = [f for f in diagnose(load_run(str(tmp_path / "runs"), "frozen")).findings if f.key == "hang"]
    assert len(findings) == 1 and findings[0].numbers["rank"] == 1 and findings[0].numbers["step"] == 14
    text = "\n".join(findings[0].evidence)
    assert hang["ranks"]["1"]["top"] in text and "trained 4 steps again" in text
    assert findings[0].numbers["lost_s"] >= hang["stuck_s"]


@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_trials_frozen_worker_is_named_and_the_sweep_goes_on(ray_session, tmp_path):
    """A sweep trial takes the run workflow pretrain takes, hang watchdog included: rank 1 of the first
    trial to reach step 4 freezes (SIGSTOP); the watchdog names it with its stack well before the
    process-group timeout and ends it; a trial has no restart, so it fails with the hang as its reason,
    and the next trial runs."""
    from raytrain_fast.drills import Hang, LoopHooks
    from raytrain_fast.sweep import SweepSpec, run_sweep

    marker = tmp_path / "froze"
    config = load_config("tiny", [
        "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32", "data.seq_len=32",
        "data.max_tokens=60000", "train.global_batch=8", "optim.warmup_steps=3", "resources.num_workers=2",
        "engine.precision=fp32", "metrics.peak_measure_s=0.2", f"watchdog.hang_timeout_s={HANG_TIMEOUT_S}",
        f"storage.uri={tmp_path / 'runs'}",
    ], name="frozen")
    result = run_sweep(config, SweepSpec(micro_batches=[2, 4], steps=8, num_reports=4), hooks=LoopHooks(Hang(4, str(marker), rank=1)))
    print(result.table)

    froze_at = float(marker.read_text())
    [hung] = [r for r in result.rows if r.status == "failed"]
    assert hung.reason.startswith("hang at step 3: rank 1 completed no step for "), hung.reason
    assert "the hang watchdog ended the workers" in hung.reason and "/hangs/stacks-" in hung.reason
    [other] = [r for r in result.rows if r is not hung]
    assert other.status in ("ok", "stopped") and other.steps_done > 4, other  # the sweep went on past the hang's step

    records = sorted((tmp_path / "runs" / result.name / "trials").glob("*/hangs/hang-*.json"))
    assert len(records) == 1, records
    hang = json.loads(records[0].read_text())
    assert hang["stuck_ranks"] == [1] and hang["waiting_ranks"] == [0] and hang["step"] == 3
    assert hang["time"] - froze_at <= HANG_TIMEOUT_S + 30  # the watchdog, not the 300 s process-group timeout
    assert hang["ranks"]["1"]["top"] in hung.reason
    assert records[0].parent.parent.name == hung.run_name
