"""checkpoint.write=background: DeepSpeed's files are written from a snapshot by a background thread.
The snapshot must hold the values at save time even when training changes the tensors right after,
and it goes into host buffers reserved before the first step (sized from the engine's state), which
every save reuses: no save allocates while training runs."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading

import pytest
import torch

from raytrain_fast.checkpoint.snapshot import SnapshotWriter, _nbytes, _tensors
from raytrain_fast.errors import CheckpointError

pytestmark = pytest.mark.unit


def _state(device: str) -> dict:
    weight = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4)
    moments = torch.full((1 << 16,), 2.0, device=device)
    return {
        "module": collections.OrderedDict(wte=weight, lm_head=weight),  # tied: one tensor, two names
        "optimizer_state_dict": {"state": {0: {"exp_avg": moments, "step": 7}}, "param_groups": [{"lr": 1e-3, "params": [0]}]},
        "ds_version": "0.19.8",
    }


def _check_written(path, device: str) -> None:
    loaded = torch.load(path, weights_only=False)
    assert torch.equal(loaded["module"]["wte"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert loaded["module"]["wte"].data_ptr() == loaded["module"]["lm_head"].data_ptr()  # still one tensor
    assert torch.equal(loaded["optimizer_state_dict"]["state"][0]["exp_avg"], torch.full((1 << 16,), 2.0))
    assert loaded["optimizer_state_dict"]["state"][0]["step"] == 7 and loaded["ds_version"] == "0.19.8"
    assert isinstance(loaded["module"], collections.OrderedDict)


def _save_then_train_on(device: str, tmp_path) -> SnapshotWriter:
    writer = SnapshotWriter()
    state = _state(device)
    writer.save(state, str(tmp_path / "mp_rank_00_model_states.pt"))
    state["module"]["wte"].mul_(-1)  # the next optimizer step, the moment save returns
    state["optimizer_state_dict"]["state"][0]["exp_avg"].zero_()
    writer.wait()
    _check_written(tmp_path / "mp_rank_00_model_states.pt", device)
    return writer


def test_the_file_holds_the_values_at_save_time_although_training_changed_them_right_after(tmp_path):
    writer = _save_then_train_on("cpu", tmp_path)
    assert writer.last_snapshot == "host"
    writer.close()


def test_a_failed_write_is_raised_by_wait_and_the_next_save_still_works(tmp_path):
    writer = SnapshotWriter()
    writer.save(_state("cpu"), str(tmp_path / "missing-folder" / "x.pt"))
    with pytest.raises(CheckpointError, match="writing the checkpoint's files failed"):
        writer.wait()
    writer.save(_state("cpu"), str(tmp_path / "y.pt"))
    writer.wait()
    _check_written(tmp_path / "y.pt", "cpu")
    writer.close()


@pytest.mark.gpu
def test_on_a_gpu_a_save_without_a_guarded_optimizer_has_copied_when_it_returns(tmp_path):
    writer = _save_then_train_on("cuda", tmp_path)
    assert writer.last_snapshot == "pinned_host"
    writer.close()


@pytest.mark.gpu
def test_on_a_gpu_a_guarded_save_returns_at_once_and_the_optimizers_next_step_waits_for_its_copies(tmp_path):
    """The step is queued the moment save returns; without the wait it would change the weights while
    their copy to the host (1 GiB: tens of milliseconds) still reads them."""
    weights = torch.nn.Parameter(torch.full((1 << 28,), 1.0, device="cuda"))
    optimizer = torch.optim.AdamW([weights], lr=0.5, fused=True)
    weights.grad = torch.ones_like(weights)
    writer = SnapshotWriter()
    assert writer.guard(optimizer)
    state, path = {"module": {"w": weights}}, str(tmp_path / "w.pt")
    writer.reserve(lambda: writer.save(state, path))
    writer.save(state, path)
    optimizer.step()
    writer.wait()
    assert writer.last_snapshot == "pinned_host_async" and writer.buffers.missed_bytes == 0
    assert torch.equal(torch.load(path)["module"]["w"], torch.full((1 << 28,), 1.0))  # the values at save time
    assert float(weights.detach()[0]) < 1.0  # and the step did change them
    writer.close()


def _free_buffers(writer: SnapshotWriter) -> set[int]:
    return {b.data_ptr() for free in writer.buffers._free.values() for b in free}


def test_reserved_buffers_serve_every_save_and_each_save_reuses_them(tmp_path):
    writer = SnapshotWriter()
    state = _state("cpu")
    path = tmp_path / "mp_rank_00_model_states.pt"
    added, _ = writer.reserve(lambda: writer.save(state, str(path)))
    assert added == _nbytes(_tensors(state)) and not path.exists()  # sized from the state; nothing written
    reserved = _free_buffers(writer)
    assert len(reserved) == 2  # the tied weight is one tensor, one buffer
    for _ in range(2):
        writer.save(state, str(path))
        state["module"]["wte"].mul_(-1)  # the next optimizer step, the moment save returns
        writer.wait()
        assert writer.buffers.missed_bytes == 0 and writer.buffers.allocated_bytes == added  # the save allocated nothing
        assert _free_buffers(writer) == reserved  # the same buffers, back for the next save
        state["module"]["wte"].mul_(-1)
        _check_written(path, "cpu")
    writer.close()


def test_a_save_while_the_last_one_is_still_being_written_copies_into_new_buffers(tmp_path, monkeypatch):
    """Buffers are lent until their file is written: a second save meanwhile must not overwrite them."""
    writer = SnapshotWriter()
    state = _state("cpu")
    writer.reserve(lambda: writer.save(state, str(tmp_path / "x.pt")))
    release, real_save = threading.Event(), torch.save
    monkeypatch.setattr(torch, "save", lambda *args, **kwargs: (release.wait(30), real_save(*args, **kwargs)))
    writer.save(state, str(tmp_path / "first.pt"))
    state["module"]["wte"].mul_(-1)
    writer.save(state, str(tmp_path / "second.pt"))
    release.set()
    writer.wait()
    assert writer.buffers.missed_bytes == _nbytes(_tensors(state))
    _check_written(tmp_path / "first.pt", "cpu")
    second = torch.load(tmp_path / "second.pt", weights_only=False)
    assert torch.equal(second["module"]["wte"], -torch.arange(12, dtype=torch.float32).reshape(3, 4))
    writer.close()


_RESERVE_FROM_AN_ENGINE = r"""
import glob, tempfile
import torch
from raytrain_fast.checkpoint.snapshot import SnapshotWriter, _nbytes, _tensors, optimizer_state_as_after_a_step, training_optimizer
from raytrain_fast.config import load_config
from raytrain_fast.engine.deepspeed_compat import write_checkpoints_in_background
from raytrain_fast.engine.process_group import single_process_group
from raytrain_fast.engine.program import build_program, one_process, prepare_process

device = prepare_process(threads=1, seed=0)
single_process_group("gloo")
config = one_process(load_config("tiny", ["engine.precision=fp32", "data.seq_len=32"]), micro_batch=2, grad_accum=1, steps=10)
engine = build_program(config, device=device).engine
writer = SnapshotWriter()
assert write_checkpoints_in_background(engine, writer)
print("guarded", writer.guard(training_optimizer(engine)))  # ZeRO's own torch AdamW: the one whose step changes the state
folder = tempfile.mkdtemp()
with optimizer_state_as_after_a_step(engine):
    reserved, _ = writer.reserve(lambda: engine.save_checkpoint(folder + "/reserve", tag="checkpoint"))
adamw = engine.optimizer.optimizer
assert not any(adamw.state.values()), "the stand-in optimizer state outlived the reservation"
tokens = torch.randint(0, config.model.vocab_size, (2, 33))
for save in range(2):
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    engine.save_checkpoint(f"{folder}/save{save}", tag="checkpoint")
    writer.wait()
    written = sum(_nbytes(_tensors(torch.load(f, weights_only=False))) for f in glob.glob(f"{folder}/save{save}/checkpoint/*.pt"))
    print("save", save, "reserved", reserved, "written", written, "missed", writer.buffers.missed_bytes,
          "steps", [int(s["step"]) for s in adamw.state.values()])
writer.close()
torch.distributed.destroy_process_group()
"""


@pytest.mark.ray
def test_the_reservation_is_sized_from_the_engines_state_after_a_step_and_every_save_fits_in_it():
    """A DeepSpeed ZeRO-2 engine on the CPU, before its first step (no AdamW state yet): the
    reservation covers every tensor the saves after real steps write, no save allocates, the first
    step makes its own optimizer state (step count 1), as without the reservation, and the optimizer
    a GPU's saves would wait on is found."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, "-c", _RESERVE_FROM_AN_ENGINE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "guarded True" in done.stdout
    lines = [line.split() for line in done.stdout.splitlines() if line.startswith("save ")]
    assert len(lines) == 2, done.stdout
    for save, line in enumerate(lines):
        reserved, written, missed = int(line[3]), int(line[5]), int(line[7])
        assert reserved == written > 0 and missed == 0, line
    assert lines[0][9:] == ["[1]"] and lines[1][9:] == ["[2]"]  # one AdamW step count per save, from 1


@pytest.mark.gpu
def test_on_a_gpu_the_reserved_buffers_are_pinned_and_every_save_lands_in_them(tmp_path):
    writer = SnapshotWriter()
    state = _state("cuda")
    writer.reserve(lambda: writer.save(state, str(tmp_path / "x.pt")))
    assert all(b.is_pinned() for free in writer.buffers._free.values() for b in free)
    for name in ("first.pt", "second.pt"):
        writer.save(state, str(tmp_path / name))
        writer.wait()
        _check_written(tmp_path / name, "cuda")
    assert writer.buffers.missed_bytes == 0
    writer.close()


def test_tied_weights_from_a_real_state_dict_are_copied_once_and_load_back_tied(tmp_path):
    # module.state_dict() hands out a fresh tensor object per name, so the tie is only visible in the storage.
    model = torch.nn.Sequential(torch.nn.Embedding(64, 16), torch.nn.Linear(16, 64, bias=False))
    model[1].weight = model[0].weight
    state = model.state_dict()
    assert state["0.weight"] is not state["1.weight"]
    writer = SnapshotWriter()
    reserved, _ = writer.reserve(lambda: writer.save(state, str(tmp_path / "reserve.pt")))
    assert reserved == 64 * 16 * 4  # one buffer for the tied pair, not two
    writer.save(state, str(tmp_path / "model.pt"))
    writer.wait()
    writer.close()
    assert writer.buffers.missed_bytes == 0
    loaded = torch.load(tmp_path / "model.pt")
    assert loaded["0.weight"].data_ptr() == loaded["1.weight"].data_ptr()
    assert torch.equal(loaded["1.weight"], model[0].weight.detach())


def test_closing_the_writer_removes_its_hook_from_the_optimizer():
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    writer = SnapshotWriter()
    assert writer.guard(optimizer)
    assert len(optimizer._optimizer_step_pre_hooks) == 1
    writer.close()
    assert len(optimizer._optimizer_step_pre_hooks) == 0
