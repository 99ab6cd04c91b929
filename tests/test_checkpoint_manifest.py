"""Checkpoint manifests in a real S3 bucket: incomplete or altered checkpoints are skipped on resume,
and `list_runs` shows steps and completeness."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest

from raytrain_fast.checkpoint.download import IncompleteCheckpointError, download_checkpoint, find_resumable_checkpoint
from raytrain_fast.checkpoint.rank_manifest import manifest_name, write_rank_manifest
from raytrain_fast.checkpoint.verify import verify_checkpoint
from raytrain_fast.checkpoint.runs import format_runs_table, list_runs
from raytrain_fast.storage import StorageConfig, resolve_filesystem

pytestmark = pytest.mark.unit

WORLD_SIZE = 2


@pytest.fixture
def bucket_storage(s3_server, monkeypatch, tmp_path):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    bucket = s3_server.make_bucket(f"ckpt-{uuid.uuid4().hex[:8]}")
    storage = StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=s3_server.endpoint_url)
    filesystem, root = resolve_filesystem(storage.uri, storage)
    return storage, filesystem, root, s3_server, bucket


def _save_rank(local_dir: Path, *, rank: int, step: int) -> None:
    """What one rank of the loop writes: DeepSpeed-like files, rank 0 the train state, then the manifest."""
    shard = local_dir / "deepspeed" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(os.urandom(300_000 + rank))
    if rank == 0:
        (local_dir / "deepspeed" / "mp_rank_00_model_states.pt").write_bytes(os.urandom(100_000))
        (local_dir / "latest").write_text("deepspeed")
        (local_dir / "train_state.json").write_text(json.dumps({"step": step, "world_size": WORLD_SIZE}))
    write_rank_manifest(str(local_dir), rank=rank, world_size=WORLD_SIZE, step=step)


def _save_checkpoint(tmp_path: Path, filesystem, run_path: str, step: int, *, ranks=range(WORLD_SIZE)) -> str:
    """Every rank saves locally; their directories are merged into one storage directory, as Ray does."""
    destination = f"{run_path}/checkpoint_{step:08d}"
    for rank in ranks:
        local = tmp_path / f"step{step}-rank{rank}"
        _save_rank(local, rank=rank, step=step)
        pafs.copy_files(str(local), destination, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=filesystem)
    return destination


def _build_run(tmp_path, filesystem, run_path, server, bucket):
    """step 10: complete; step 20: a file altered after upload (same size); step 30: a rank's file lost;
    step 40: rank 1 never uploaded anything."""
    complete = _save_checkpoint(tmp_path, filesystem, run_path, 10)
    altered = _save_checkpoint(tmp_path, filesystem, run_path, 20)
    lost_file = _save_checkpoint(tmp_path, filesystem, run_path, 30)
    half = _save_checkpoint(tmp_path, filesystem, run_path, 40, ranks=[0])

    client = server.client()
    key = altered.split("/", 1)[1] + "/deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[1000] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    client.delete_object(Bucket=bucket, Key=lost_file.split("/", 1)[1] + "/deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    return complete, altered, lost_file, half


def test_manifest_lists_every_file_of_the_rank(tmp_path):
    local = tmp_path / "rank0"
    _save_rank(local, rank=0, step=5)
    manifest = json.loads((local / manifest_name(0)).read_text())
    assert {f["path"] for f in manifest["files"]} == {
        "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt", "deepspeed/mp_rank_00_model_states.pt",
        "latest", "train_state.json",
    }
    assert (manifest["rank"], manifest["world_size"], manifest["step"]) == (0, WORLD_SIZE, 5)
    sizes = {f["path"]: f["size"] for f in manifest["files"]}
    assert sizes["deepspeed/mp_rank_00_model_states.pt"] == 100_000
    assert not list(local.glob(".manifest*"))  # the temporary file was renamed into place


def test_resume_skips_incomplete_and_altered_checkpoints(bucket_storage, tmp_path):
    storage, filesystem, root, server, bucket = bucket_storage
    run_path = f"{root}/run-a"
    complete, altered, lost_file, half = _build_run(tmp_path, filesystem, run_path, server, bucket)

    path, skipped = find_resumable_checkpoint(filesystem, run_path)
    assert path == complete
    reasons = dict(skipped)
    assert list(reasons) == [half, lost_file, altered]  # newest first
    assert "manifest missing for rank(s) 1 of 2" in reasons[half]
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt (written by rank 1) is missing" in reasons[lost_file]
    assert "does not match its checksum" in reasons[altered]

    # Sizes alone cannot see a same-size alteration: that is what the checksums are for.
    assert verify_checkpoint(filesystem, altered, checksums=False) == (True, "")
    assert verify_checkpoint(filesystem, altered)[0] is False


def test_download_verifies_while_downloading(bucket_storage, tmp_path):
    storage, filesystem, root, server, bucket = bucket_storage
    run_path = f"{root}/run-b"
    complete, altered, _, _ = _build_run(tmp_path, filesystem, run_path, server, bucket)

    target = tmp_path / "resume"
    path, skipped = find_resumable_checkpoint(filesystem, run_path, download_to=str(target))
    assert path == complete and len(skipped) == 3
    for rank in range(WORLD_SIZE):
        original = tmp_path / f"step10-rank{rank}"
        for file in original.rglob("*"):
            if file.is_file():
                assert (target / file.relative_to(original)).read_bytes() == file.read_bytes()

    with pytest.raises(IncompleteCheckpointError, match="does not match its checksum"):
        download_checkpoint(filesystem, altered, str(target))
    assert list(target.iterdir()) == []  # nothing half-verified is left to load


def test_run_without_complete_checkpoint_resumes_from_nothing(bucket_storage, tmp_path):
    storage, filesystem, root, server, bucket = bucket_storage
    run_path = f"{root}/run-c"
    _save_checkpoint(tmp_path, filesystem, run_path, 7, ranks=[1])
    path, skipped = find_resumable_checkpoint(filesystem, run_path)
    assert path is None and "manifest missing for rank(s) 0 of 2" in skipped[0][1]
    assert find_resumable_checkpoint(filesystem, f"{root}/never-ran") == (None, [])


def test_list_runs_shows_steps_and_completeness(bucket_storage, tmp_path):
    storage, filesystem, root, server, bucket = bucket_storage
    _build_run(tmp_path, filesystem, f"{root}/alpha", server, bucket)
    _save_checkpoint(tmp_path / "beta", filesystem, f"{root}/beta", 5)
    filesystem.create_dir(f"{root}/not-a-run")

    runs = list_runs(storage.uri, storage)
    assert [r.name for r in runs] == ["alpha", "beta"]
    alpha, beta = runs
    assert [(c.step, c.complete) for c in alpha.checkpoints] == [(40, False), (30, False), (20, True), (10, True)]
    assert alpha.latest_complete.step == 20  # sizes only: the altered step 20 looks complete without checksums
    assert [(c.step, c.complete, len(c.ranks_found), c.world_size) for c in beta.checkpoints] == [(5, True, 2, 2)]

    deep = list_runs(f"{storage.uri}/alpha", storage, checksums=True)  # a run's own URI; every byte read
    assert [(c.step, c.complete) for c in deep[0].checkpoints] == [(40, False), (30, False), (20, False), (10, True)]

    table = format_runs_table(runs, storage_uri=storage.uri)
    lines = table.splitlines()
    assert lines[0].split() == ["RUN", "CHECKPOINT", "STEP", "RANKS", "SIZE", "VAL/LOSS", "STATUS"]
    assert any("checkpoint_00000040" in line and "1/2" in line and "INCOMPLETE: manifest missing" in line for line in lines)
    assert any("checkpoint_00000020" in line and "complete (newest complete)" in line for line in lines)
    assert any(line.startswith("beta") and "checkpoint_00000005" in line for line in lines)
    assert "not-a-run" not in table


def test_download_for_rank_reads_only_that_ranks_share_once_per_node(bucket_storage, tmp_path):
    """Two ranks of one node (same base dir), in threads: each gets the common files and its own
    shard only; the common files are fetched once; a rank whose own shard was altered fails, the
    other does not (the caller's all-gather makes both move on)."""
    from concurrent.futures import ThreadPoolExecutor

    from raytrain_fast.checkpoint.download import download_for_rank, file_rank

    _, filesystem, root, server, bucket = bucket_storage
    path = _save_checkpoint(tmp_path, filesystem, f"{root}/node-share", 100)
    base = tmp_path / "node"
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda r: download_for_rank(filesystem, path, rank=r, base_dir=str(base)), range(WORLD_SIZE)))
    assert got[0].local_dir == got[1].local_dir
    names = {str(p.relative_to(got[0].local_dir)) for p in Path(got[0].local_dir).rglob("*") if p.is_file() and ".locks" not in p.parts}
    sizes = {name: size for name, size in ((n, Path(got[0].local_dir, n).stat().st_size) for n in names)}
    common = sum(size for name, size in sizes.items() if file_rank(name) is None)
    own = {r: sum(size for name, size in sizes.items() if file_rank(name) == r) for r in range(WORLD_SIZE)}
    assert own[0] == 300_000 and own[1] == 300_001  # both shards there: one per rank
    assert sum(g.downloaded_bytes for g in got) == common + own[0] + own[1]  # the common files once
    for rank in range(WORLD_SIZE):
        assert got[rank].needed_bytes <= got[rank].downloaded_bytes + common
        assert got[rank].downloaded_bytes <= common + own[rank]

    key = f"{path.split('/', 1)[1]}/deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    body = bytearray(server.client().get_object(Bucket=bucket, Key=key)["Body"].read())
    body[:8] = bytes(255 - b for b in body[:8])
    server.client().put_object(Bucket=bucket, Key=key, Body=bytes(body))
    fresh = tmp_path / "other-node"
    assert download_for_rank(filesystem, path, rank=0, base_dir=str(fresh)).downloaded_bytes == common + own[0]
    with pytest.raises(IncompleteCheckpointError, match="zero_pp_rank_1_.* does not match its checksum"):
        download_for_rank(filesystem, path, rank=1, base_dir=str(fresh))
    assert not any(p.name.endswith(".partial") for p in fresh.rglob("*"))
