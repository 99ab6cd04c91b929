"""Checkpoint I/O that scales, on the loopback S3 server with 2 real gloo workers and
real DeepSpeed ZeRO-2 in bf16:
- on resume each rank reads from storage only what it loads: the files every rank loads (model
  states, train state, config, `latest`, every manifest) and its own optimizer shard and RNG
  states; the node's ranks share one download of the common files;
- a checkpoint whose optimizer shard of rank 1 was altered in storage (same size: only rank 1's
  checksum sees it) is skipped by every rank together, and the run resumes from the one before;
- the W&B (offline) and TensorBoard files rank 0 writes in a node-local temp dir are copied into
  `<run>/` in storage, and after a restart (a new temp dir: another node, as far as files go) the
  new files land beside the old ones, so storage holds both attempts' scalars.
One run of 4 steps (checkpoints at 2 and 4), its resume to 6 and a 1-step init_from run serve every
assertion (about 2 minutes on 2 busy cores)."""

from __future__ import annotations

import dataclasses

import pytest

from raytrain_fast.checkpoint.download import file_rank
from raytrain_fast.checkpoint.rank_manifest import RankManifest
from raytrain_fast.config import load_config
from raytrain_fast.launch.trainer import run

pytestmark = [pytest.mark.slow, pytest.mark.ray]

MARGIN_BYTES = 0  # the counter counts exactly the files a rank fetched: no slack is needed


@pytest.fixture(scope="module")
def resumed(ray_session, s3_server):
    """(config, first result, resumed result, bucket), W&B offline and TensorBoard on."""
    import json as json_package
    import os

    bucket = s3_server.make_bucket("ckptio-tests")
    source = os.path.dirname(json_package.__file__)  # a few real text files: prepared in a second, not stdlib's 20 s
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_server.env.items():
            patch.setenv(key, value)
        patch.delenv("WANDB_API_KEY", raising=False)
        config = load_config(
            "tiny",
            [
                "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
                "data.seq_len=32", "data.max_tokens=20000", "train.micro_batch=4", "train.global_batch=8",
                "train.steps=4", "train.log_every=1", "checkpoint.every_steps=2", "checkpoint.keep_last=3", "optim.warmup_steps=1",
                "resources.num_workers=2", "engine.precision=bf16", "metrics.peak_measure_s=0.2", "eval.enabled=false",
                "metrics.tensorboard=true", "metrics.tensorboard_flush_every_s=1", "metrics.wandb=true",
                "metrics.wandb_mode=offline", f"data.source={source}", f"storage.uri=s3://{bucket}/runs", f"storage.endpoint_url={s3_server.endpoint_url}",
            ],
            name="ckptio",
        )
        first = run(config)
        # Alter rank 1's optimizer shard of the newest checkpoint, keeping its size.
        client, prefix = s3_server.client(), "runs/ckptio/checkpoint_00000004/deepspeed/"
        shard = f"{prefix}bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
        body = bytearray(client.get_object(Bucket=bucket, Key=shard)["Body"].read())
        body[-100:] = bytes(255 - b for b in body[-100:])
        client.put_object(Bucket=bucket, Key=shard, Body=bytes(body))
        longer = dataclasses.replace(config, train=dataclasses.replace(config.train, steps=6))
        second = run(longer)
        return config, first, second, bucket


def _objects(s3_server, bucket: str, prefix: str) -> dict[str, int]:
    """key -> size, listed with boto3 (independently of pyarrow)."""
    sizes = {}
    for page in s3_server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            sizes[item["Key"]] = item["Size"]
    return sizes


def test_a_shard_altered_in_storage_makes_every_rank_take_the_previous_checkpoint(resumed):
    _, first, second, _ = resumed
    assert first.checkpoint.endswith("checkpoint_00000004")
    saved = dict(second.checkpoints)[second.checkpoint]
    assert saved["start_step"] == 2, "the resume did not skip the altered checkpoint at step 4 for the one at 2"


def test_each_rank_downloads_only_what_it_loads(resumed, s3_server):
    _, _, second, bucket = resumed
    saved = dict(second.checkpoints)[second.checkpoint]
    assert saved["start_step"] == 2
    downloaded = [saved[f"checkpoint/restore_download_bytes/rank{r}"] for r in range(2)]
    assert saved["checkpoint/restore_download_bytes_max"] == max(downloaded)

    # What the checkpoint it resumed from (step 2) holds.
    prefix = "runs/ckptio/checkpoint_00000002/"
    objects = _objects(s3_server, bucket, prefix)
    manifests = [
        RankManifest.from_json(s3_server.client().get_object(Bucket=bucket, Key=f"{prefix}manifest.rank{r}.json")["Body"].read())
        for r in range(2)
    ]
    common = sum(size for key, size in objects.items() if file_rank(key[len(prefix):]) is None)  # manifests included
    own = {r: sum(e.size for m in manifests for e in m.files if file_rank(e.path) == r) for r in range(2)}
    shards = [e for m in manifests for e in m.files if "optim_states" in e.path]
    assert len(shards) == 2 and all(e.path.split("/")[-1].startswith("bf16_zero_pp_rank_") for e in shards), shards
    total = sum(objects.values())
    for rank in range(2):
        assert downloaded[rank] <= common + own[rank] + MARGIN_BYTES, (rank, downloaded, common, own)
        # The other rank's shard is what a rank does not read.
        assert downloaded[rank] <= total - own[1 - rank], (rank, downloaded, total, own)
    # One node: the common files were fetched once, by one rank, not once per rank.
    assert sum(downloaded) == common + own[0] + own[1], (downloaded, common, own)


def test_wandb_and_tensorboard_files_are_in_the_runs_storage_across_restarts(resumed, s3_server, tmp_path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    _, _, _, bucket = resumed
    objects = _objects(s3_server, bucket, "runs/ckptio/")
    events = sorted(key for key in objects if key.startswith("runs/ckptio/tensorboard/events.out.tfevents."))
    wandb_runs = {key.split("/")[3] for key in objects if key.startswith("runs/ckptio/wandb/offline-run-") and key.endswith(".wandb")}
    assert len(events) == 2, f"one TensorBoard event file per attempt expected: {events}"
    assert len(wandb_runs) == 2, f"one W&B offline run directory per attempt expected: {sorted(objects)}"

    steps = set()
    for number, key in enumerate(events):
        path = tmp_path / f"{number}.tfevents"
        path.write_bytes(s3_server.client().get_object(Bucket=bucket, Key=key)["Body"].read())
        for event in EventFileLoader(str(path)).Load():
            steps.update(event.step for value in event.summary.value if value.tag == "train/loss")
    assert steps == set(range(1, 7)), f"train/loss steps in storage's TensorBoard files: {sorted(steps)}"


def test_init_from_on_two_workers_starts_from_the_checkpoints_weights(resumed, s3_server, tmp_path):
    """checkpoint.init_from is read by rank 0 alone and broadcast: a 2-worker run from another seed
    (other random weights) ends its first step, at a negligible LR, with the source's weights."""
    import torch

    from raytrain_fast.checkpoint.export import consolidated_state_dict
    from raytrain_fast.checkpoint.download import download_checkpoint
    from raytrain_fast.storage import resolve_filesystem

    config, _, second, bucket = resumed
    source = f"s3://{bucket}/runs/ckptio/checkpoint_00000006"
    assert second.checkpoint.endswith("checkpoint_00000006")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_server.env.items():
            patch.setenv(key, value)
        init = dataclasses.replace(
            config, name="ckptio-init",
            train=dataclasses.replace(config.train, steps=1, seed=config.train.seed + 1),
            optim=dataclasses.replace(config.optim, lr=1e-9, warmup_steps=0),
            checkpoint=dataclasses.replace(config.checkpoint, init_from=source, every_steps=1),
            metrics=dataclasses.replace(config.metrics, wandb=False, tensorboard=False),
        )
        result = run(init)
        assert result.checkpoint.startswith(f"s3://{bucket}/runs/ckptio-init/"), result.checkpoint  # a URI, as printed
        weights = {}
        for name, uri in (("source", source), ("init", result.checkpoint)):
            filesystem, path = resolve_filesystem(uri, config.storage)
            download_checkpoint(filesystem, path, str(tmp_path / name))
            weights[name] = consolidated_state_dict(str(tmp_path / name))[0]
    assert weights["source"].keys() == weights["init"].keys()
    for key, value in weights["source"].items():
        # bf16 model weights in between (the engine's master copy starts from them): bf16's rounding.
        assert torch.allclose(weights["init"][key].float(), value.float(), rtol=1e-2, atol=1e-3), key
