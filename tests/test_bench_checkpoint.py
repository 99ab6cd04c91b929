"""`bench checkpoint`'s model sizing. The bench end to end (2 ranks, its own loopback S3 server, async
and sync timed, the last checkpoint of each complete): tests/test_fresh_shell.py runs it as
documented and checks its JSON (`assert_checkpoint_bench`)."""

from __future__ import annotations

import pytest

from raytrain_fast.bench.checkpoint import model_for_checkpoint_mb

pytestmark = pytest.mark.unit


def test_model_size_reaches_the_target():
    small, large = model_for_checkpoint_mb(5), model_for_checkpoint_mb(200)
    assert small.d_model < large.d_model
    assert model_for_checkpoint_mb(200).d_model == 512  # 4 layers: the first multiple of 64 past 200 MB
