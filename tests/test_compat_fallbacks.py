"""The compat modules (raytrain_fast/_ray_compat.py, engine/deepspeed_compat.py): each reach into Ray,
DeepSpeed or torch internals checked against the installed release, and the fallback each takes on
a release where the private name moved, with one warning line."""

from __future__ import annotations

import logging

import pytest
import torch

from raytrain_fast import _ray_compat
from raytrain_fast.engine import deepspeed_compat

pytestmark = pytest.mark.unit


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "raytrain_fast.compat" and r.levelno == logging.WARNING]


@pytest.fixture
def fresh_warnings(monkeypatch):
    """Every fallback warns again (each warns once per process)."""
    monkeypatch.setattr(_ray_compat, "_WARNED", set())
    monkeypatch.setattr(deepspeed_compat, "_WARNED", set())


def test_the_trainer_leaves_out_rays_sigint_handler_and_wraps_its_failure_policy(fresh_warnings, caplog):
    from ray.train.torch import TorchTrainer

    from raytrain_fast.launch.trainer import will_repeat

    trainer = _ray_compat.trainer_class(TorchTrainer, is_final=will_repeat)
    assert issubclass(trainer, TorchTrainer)
    assert {"_register_sigint_handler", "_initialize_and_run_controller"} <= set(vars(trainer))
    assert trainer._register_sigint_handler(object.__new__(trainer), controller=None) is None
    assert _warnings(caplog) == []


@pytest.mark.parametrize("change", ["missing", "signature"])
def test_a_ray_whose_private_trainer_methods_changed_keeps_its_own_with_one_warning(change, fresh_warnings, caplog, monkeypatch):
    """What another Ray release gets: its own Ctrl-C handler and controller start, and a line saying what that means."""
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    if change == "missing":
        monkeypatch.delattr(DataParallelTrainer, "_register_sigint_handler")
    else:
        monkeypatch.setattr(DataParallelTrainer, "_register_sigint_handler", lambda self, controller, signals: None)
    monkeypatch.setattr(DataParallelTrainer, "_initialize_and_run_controller", lambda self, controller_kwargs: None)
    for _ in range(2):
        trainer = _ray_compat.trainer_class(TorchTrainer, is_final=lambda error: False)
    assert not {"_register_sigint_handler", "_initialize_and_run_controller"} & set(vars(trainer))
    lines = _warnings(caplog)
    assert len(lines) == 2, lines  # one per method, not one per call
    assert "Ctrl-C aborts a run without a checkpoint" in lines[0] and "an error that will repeat is retried" in lines[1]
    assert all(line.startswith("Ray 2.60") and "tested on 2.60.0" in line for line in lines)


def test_the_controller_poll_interval_is_set_for_the_block_and_a_users_value_stays(monkeypatch):
    from ray.train.v2._internal.constants import HEALTH_CHECK_INTERVAL_S_ENV_VAR

    monkeypatch.delenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR, raising=False)
    default = _ray_compat.health_check_interval_s()
    with _ray_compat.controller_poll_interval(0.2):
        assert _ray_compat.health_check_interval_s() == 0.2
    assert _ray_compat.health_check_interval_s() == default == 2.0
    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR, "0.05")
    with _ray_compat.controller_poll_interval(0.2):
        assert _ray_compat.health_check_interval_s() == 0.05


def test_the_internal_flags_are_the_ones_ray_reads(monkeypatch):
    from ray._private.ray_constants import RAY_WORKER_NICENESS
    from ray.air.constants import AIR_ENV_VARS
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME, ENABLE_PRINT_PATCH_ENV_VAR

    assert _ray_compat.worker_env_flags() == {ENABLE_PRINT_PATCH_ENV_VAR: "0"}
    assert _ray_compat.TRAIN_SNAPSHOT_FILE == CHECKPOINT_MANAGER_SNAPSHOT_FILENAME == _ray_compat.checkpoint_snapshot_name()
    monkeypatch.delenv(RAY_WORKER_NICENESS, raising=False)
    _ray_compat.workers_at_normal_priority()
    assert __import__("os").environ[RAY_WORKER_NICENESS] == "0"
    monkeypatch.delenv("RAY_AIR_NEW_OUTPUT", raising=False)
    with _ray_compat.quiet_tune_output():
        assert "RAY_AIR_NEW_OUTPUT" in AIR_ENV_VARS and __import__("os").environ["RAY_AIR_NEW_OUTPUT"] == "0"
    assert "RAY_AIR_NEW_OUTPUT" not in __import__("os").environ


def test_the_shard_pattern_reads_the_names_deepspeed_gives_each_ranks_shard():
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine

    prefix = lambda dp_rank, bf16_mode: DeepSpeedEngine._get_zero_ckpt_prefix(None, dp_rank, bf16_mode)  # noqa: E731
    engine = SimpleNamespace(_get_zero_ckpt_prefix=prefix)
    for bf16 in (True, False):
        for rank in (0, 3, 12):
            path = DeepSpeedEngine._get_rank_zero_ckpt_name(engine, "/run/checkpoint_000010", "deepspeed", 0, rank, bf16)
            relative = path.split("/checkpoint_000010/", 1)[1]
            assert deepspeed_compat.zero_shard_rank(relative) == rank, relative
    assert deepspeed_compat.zero_shard_rank("deepspeed/mp_rank_00_model_states.pt") is None
    rank_0 = SimpleNamespace(checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: False)  # ZeRO-1/2
    path = DeepSpeedEngine._get_ckpt_name(rank_0, "/run/checkpoint_000010", "deepspeed")
    assert path.rsplit("/", 1)[1] == deepspeed_compat.MODEL_STATES_FILE


def test_a_conversion_deepspeed_refuses_raises_with_what_it_said(tmp_path, monkeypatch):
    monkeypatch.setattr(deepspeed_compat, "UNIVERSAL_FLAGS", ("--no_such_flag",))  # flags a release no longer takes
    with pytest.raises(RuntimeError, match="unrecognized arguments: --no_such_flag"):
        deepspeed_compat.convert_to_universal(str(tmp_path / "in"), str(tmp_path / "out"))


def test_a_deepspeed_without_the_scripts_functions_runs_its_script_with_one_warning(fresh_warnings, caplog, tmp_path, monkeypatch):
    from deepspeed.checkpoint import ds_to_universal

    monkeypatch.delattr(ds_to_universal, "parse_arguments")
    with pytest.raises(RuntimeError, match="exited with") as failed:  # the script ran, on a folder that holds no save
        deepspeed_compat.convert_to_universal(str(tmp_path / "no-save"), str(tmp_path / "out"))
    assert str(tmp_path / "no-save") in str(failed.value)  # what it printed comes with the error
    [line] = _warnings(caplog)
    assert "runs as a script" in line


def test_an_untested_deepspeed_reads_shard_names_as_the_tested_one_with_one_warning(fresh_warnings, caplog, monkeypatch):
    monkeypatch.setattr(deepspeed_compat, "TESTED_DEEPSPEED", ("0.0.1",))
    assert [deepspeed_compat.zero_shard_rank(f"d/bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt") for r in (1, 2)] == [1, 2]
    [line] = _warnings(caplog)
    assert "one named otherwise is downloaded by every rank" in line


def test_the_lr_record_and_the_clip_value_are_set_where_they_exist_else_one_warning(fresh_warnings, caplog):
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([parameter], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    assert deepspeed_compat.set_last_lr(scheduler, [0.004]) and scheduler.get_last_lr() == [0.004]
    del scheduler._last_lr  # a torch that keeps it elsewhere
    assert not deepspeed_compat.set_last_lr(scheduler, [0.004]) and not deepspeed_compat.set_last_lr(scheduler, [0.004])
    assert not deepspeed_compat.set_clip_grad(None, 0.5)  # no wrapper: nothing to set, nothing to say
    assert not deepspeed_compat.set_clip_grad(optimizer, 0.5)  # an optimizer without DeepSpeed's clip_grad
    lines = _warnings(caplog)
    assert len(lines) == 2 and "no _last_lr" in lines[0] and "AdamW has no clip_grad" in lines[1], lines


def test_a_build_lock_left_by_a_killed_build_is_removed_and_one_a_live_build_holds_is_kept(tmp_path, monkeypatch):
    """torch's FileBaton waits forever on a lock file a killed build left: every later run hung before
    its first step. A lock whose builder died goes (one line); one a live builder holds stays."""
    import subprocess
    import sys

    from torch.utils.file_baton import FileBaton

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    dead, live = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock", tmp_path / "py311_cpu" / "cpu_adam" / "lock"
    for lock in (dead, live):
        lock.parent.mkdir(parents=True)
    take = "import os, sys, time; from torch.utils.file_baton import FileBaton; assert FileBaton(sys.argv[1]).try_acquire(); "
    subprocess.run([sys.executable, "-c", take + "os._exit(0)", str(dead)], check=True)  # the builder killed mid-build
    holder = subprocess.Popen([sys.executable, "-c", take + "print('held', flush=True); time.sleep(60)", str(live)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lines: list[str] = []
        removed = deepspeed_compat.clear_stale_build_locks(warn=lines.append)
        assert removed == [str(dead.resolve())] and not dead.exists() and live.exists()
        assert len(lines) == 1 and str(dead.resolve()) in lines[0] and "deepspeed_shm_comm" in lines[0]
        assert FileBaton(str(dead)).try_acquire()  # the next build takes the baton instead of waiting
    finally:
        holder.kill()
        holder.wait()
    assert deepspeed_compat.clear_stale_build_locks(warn=lines.append) == [str(live.resolve())]  # its holder is gone now
