"""checkpoint.write=background: DeepSpeed's files are written from a snapshot by a background thread.
The snapshot must hold the values at save time even when training changes the tensors right after."""

from __future__ import annotations

import collections

import pytest
import torch

from raytrain_fast.checkpoint.snapshot import SnapshotWriter
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
def test_on_a_gpu_the_snapshot_is_a_device_copy_when_it_fits_and_pinned_host_memory_when_not(tmp_path, monkeypatch):
    writer = _save_then_train_on("cuda", tmp_path)
    assert writer.last_snapshot == "device"
    import raytrain_fast.checkpoint.snapshot as snapshot

    monkeypatch.setattr(snapshot, "DEVICE_HEADROOM", 1e9)  # no GPU has that much room: pinned host memory
    (tmp_path / "second").mkdir()
    writer2 = _save_then_train_on("cuda", tmp_path / "second")
    assert writer2.last_snapshot == "pinned_host"
    writer.close()
    writer2.close()
