"""Resuming on another worker count, the pure parts: the batch kept across the change and the cache's name.
The real round trip (Ray, DeepSpeed, the conversion) is tests/test_train.py::test_resize_round_trip_two_one_two_workers."""

from __future__ import annotations

import pytest

from raytrain_fast.checkpoint.state import TrainState
from raytrain_fast.checkpoint.verify import step_from_name
from raytrain_fast.checkpoint.resize import fit_batch, saved_global_batch, universal_cache_path, worker_counts_that_fit
from raytrain_fast.errors import CheckpointError

pytestmark = pytest.mark.unit


def test_the_global_batch_is_kept_by_grad_accum_or_a_smaller_micro_batch():
    fit = lambda workers, micro_batch=4: fit_batch(  # noqa: E731
        global_batch=16, micro_batch=micro_batch, num_workers=workers, saved_workers=2, uri="runs/r/checkpoint_00000010"
    )
    assert fit(1) == (4, 4) and fit(2) == (4, 2) and fit(4) == (4, 1)
    assert fit(8) == (2, 1) and fit(16) == (1, 1)  # micro_batch lowered where it no longer fits
    assert fit(2, micro_batch=16) == (8, 1) and fit(2, micro_batch=3) == (2, 4)
    with pytest.raises(CheckpointError, match=r"3 workers cannot keep it .*one of 1, 2, 4, 8, 16.*checkpoint.init_from"):
        fit(3)
    assert worker_counts_that_fit(12) == [1, 2, 3, 4, 6, 12]


def test_the_saved_global_batch_comes_from_the_state_or_its_tokens():
    assert saved_global_batch(TrainState(step=10, tokens=10 * 8 * 32, global_batch=24), seq_len=32, default=1) == 24
    assert saved_global_batch(TrainState(step=10, tokens=10 * 8 * 32), seq_len=32, default=1) == 8  # older checkpoints
    assert saved_global_batch(TrainState(step=0), seq_len=32, default=16) == 16


def test_the_cache_is_never_taken_for_a_checkpoint():
    cache = universal_cache_path("s3://b/runs/r/checkpoint_00000010/")
    assert cache == "s3://b/runs/r/checkpoint_00000010.universal"
    assert step_from_name(cache) is None and step_from_name("s3://b/runs/r/checkpoint_00000010") == 10
