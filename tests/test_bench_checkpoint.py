"""`bench checkpoint` end to end on a small model: the loopback S3 server, async and sync (1 worker
here for time; the bench itself defaults to 2)."""

from __future__ import annotations

import pytest

from raytrain_fast.bench.checkpoint import measure_checkpoint_blocking, model_for_checkpoint_mb
from raytrain_fast.storage import StorageConfig

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_model_size_reaches_the_target():
    small, large = model_for_checkpoint_mb(5), model_for_checkpoint_mb(200)
    assert small.d_model < large.d_model
    assert model_for_checkpoint_mb(200).d_model == 512  # 4 layers: the first multiple of 64 past 200 MB


def test_bench_times_both_modes_and_leaves_complete_checkpoints(ray_session, s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.env["AWS_ACCESS_KEY_ID"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.env["AWS_SECRET_ACCESS_KEY"])
    bucket = s3_server.make_bucket("bench-checkpoint")
    storage = StorageConfig(uri=f"s3://{bucket}/bench", endpoint_url=s3_server.endpoint_url)
    result = measure_checkpoint_blocking(
        storage=storage, checkpoint_mb=4, num_workers=1, num_checkpoints=2, seconds_between=1.0,
    )
    for mode in ("async", "sync"):
        assert result[f"last_checkpoint_complete_{mode}"] is True
        assert len(result[f"blocked_s_{mode}_all"]) == 2
        assert all(blocked > 0 for blocked in result[f"blocked_s_{mode}_all"])
        assert result[f"write_s_{mode}"] > 0
    # A sync save uploads inside Ray's report; an async one never waits for an upload there.
    assert result["report_s_sync"] >= result["upload_s_sync"] * 0.5
    assert result["checkpoint_mb"] >= 4
    assert result["ratio"] == pytest.approx(result["blocked_s_async"] / result["blocked_s_sync"])
