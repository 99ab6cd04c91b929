"""Export round trip: a real DeepSpeed engine (ZeRO-2, fp32, world size 1 on gloo) trains a tiny GPT,
its checkpoint goes to a real S3 bucket, export writes safetensors, and the loaded model gives the
engine's logits."""

from __future__ import annotations

import json
import shutil
import uuid

import pyarrow.fs as pafs
import pytest
import torch
import yaml

from raytrain_fast.checkpoint.export import export_checkpoint, export_local_checkpoint, load_exported
from raytrain_fast.checkpoint.rank_manifest import write_rank_manifest
from raytrain_fast.config import Config
from raytrain_fast.errors import CheckpointError
from raytrain_fast.model import GPT, ModelConfig
from raytrain_fast.storage import StorageConfig, redact, resolve_filesystem
from tests.s3_server import free_port

pytestmark = pytest.mark.ray

# fp32 end to end and the same weights: the only difference allowed is float reassociation.
ATOL, RTOL = 1e-6, 1e-5
MODEL = ModelConfig(vocab_size=64, max_seq_len=16, num_layers=2, num_heads=2, d_model=32, tie_embeddings=True)
STEPS = 3



@pytest.fixture(scope="module")
def trained_checkpoint(tmp_path_factory):
    """(engine, local checkpoint dir) after STEPS optimizer steps, saved as the loop saves it.

    One engine for the module: DeepSpeed caches process groups, so a second init_process_group in
    the same process breaks it.
    """
    import os

    import torch.distributed as dist

    from raytrain_fast.engine import EngineConfig, OptimConfig, build_engine

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        engine = build_engine(
            GPT(MODEL), engine=EngineConfig(precision="fp32", zero_stage=2), optim=OptimConfig(lr=1e-2, warmup_steps=1),
            micro_batch=2, grad_accum=1, world_size=1, total_steps=STEPS,
        )
        for _ in range(STEPS):
            tokens = torch.randint(0, MODEL.vocab_size, (2, MODEL.max_seq_len + 1))
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        local = tmp_path_factory.mktemp("checkpoint") / "rank0"
        engine.save_checkpoint(str(local), tag="deepspeed")
        config = Config(name="exp", model=MODEL).to_dict()
        (local / "config.yaml").write_text(yaml.safe_dump(redact(config), sort_keys=False))
        # The loop's state file, with the metrics it saves (an evaluation ran before the save).
        (local / "train_state.json").write_text(json.dumps({"step": STEPS, "metrics": {"val/loss": 2.5, "train/loss": 3.25}}))
        write_rank_manifest(str(local), rank=0, world_size=1, step=STEPS)
        yield engine, local
    finally:
        dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def test_export_round_trip_from_s3_gives_the_engines_logits(trained_checkpoint, s3_server, monkeypatch, tmp_path):
    engine, local = trained_checkpoint
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.make_bucket(f"export-{uuid.uuid4().hex[:8]}")
    storage = StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=s3_server.endpoint_url)
    filesystem, root = resolve_filesystem(storage.uri, storage)
    pafs.copy_files(str(local), f"{root}/exp/checkpoint_{STEPS:08d}", destination_filesystem=filesystem)

    out = tmp_path / "exported"
    assert export_checkpoint(storage_uri=storage.uri, storage=storage, name="exp", step=None, out_dir=str(out)) == str(out)
    model = load_exported(str(out))

    assert model.lm_head.weight is model.token_emb.weight  # tied again after loading
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), framework="pt") as weights:
        stored = set(weights.keys())
        assert weights.metadata()["weights"] == "fp32 master weights from the ZeRO optimizer shards"
        assert weights.metadata()["step"] == str(STEPS)
    assert len(stored & {"lm_head.weight", "token_emb.weight"}) == 1  # the shared matrix is stored once
    exported = yaml.safe_load((out / "config.yaml").read_text())["export"]
    assert (float(exported["val_loss"]), float(exported["train_loss"])) == (2.5, 3.25)  # the exported step's, as saved

    tokens = torch.randint(0, MODEL.vocab_size, (3, MODEL.max_seq_len))
    engine.module.eval()
    with torch.no_grad():
        expected, got = engine.module(tokens), model(tokens)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
    with torch.no_grad():  # and the weights are the trained ones, not a fresh init
        assert not torch.allclose(GPT(MODEL).eval()(tokens), expected, atol=1e-3)

    with pytest.raises(CheckpointError, match=r"no checkpoint at step 99 \(steps: \[3\]\)"):
        export_checkpoint(storage_uri=storage.uri, storage=storage, name="exp", step=99, out_dir=str(tmp_path / "x"))

    # A newer checkpoint that never finished (no manifest) is skipped, named with the reason.
    with filesystem.open_output_stream(f"{root}/exp/checkpoint_{STEPS + 5:08d}/train_state.json") as stream:
        stream.write(b'{"step": 8}')
    with pytest.raises(CheckpointError, match="already holds model.safetensors and config.yaml: pass --overwrite"):
        export_checkpoint(storage_uri=storage.uri, storage=storage, name="exp", step=None, out_dir=str(out))
    export_checkpoint(storage_uri=storage.uri, storage=storage, name="exp", step=None, out_dir=str(out), overwrite=True,
                      dtype="bf16")
    info = yaml.safe_load((out / "config.yaml").read_text())["export"]
    assert info["step"] == STEPS and isinstance(info["step"], int) and info["dtype"] == "bfloat16"
    assert info["skipped"] == [{"checkpoint": f"checkpoint_{STEPS + 5:08d}", "reason": info["skipped"][0]["reason"]}]
    assert "manifest" in info["skipped"][0]["reason"]
    modes = {oct((out / name).stat().st_mode & 0o777) for name in ("model.safetensors", "config.yaml")}
    assert len(modes) == 1, modes  # both files readable alike


def test_export_without_optimizer_shards_uses_module_weights(trained_checkpoint, tmp_path):
    _, local = trained_checkpoint
    from_master = load_exported(export_local_checkpoint(str(local), str(tmp_path / "master")))

    module_only = tmp_path / "module-only"
    shutil.copytree(local, module_only)
    for shard in module_only.glob("deepspeed/*optim_states.pt"):
        shard.unlink()
    (module_only / "config.yaml").unlink()
    with pytest.raises(CheckpointError, match="no config.yaml"):
        export_local_checkpoint(str(module_only), str(tmp_path / "fails"))
    from_module = load_exported(export_local_checkpoint(str(module_only), str(tmp_path / "module"), model_config=MODEL))

    master_state, module_state = from_master.state_dict(), from_module.state_dict()
    assert master_state.keys() == module_state.keys()
    for key in master_state:  # fp32 training: the module weights ARE the master weights
        torch.testing.assert_close(module_state[key], master_state[key], atol=0.0, rtol=0.0)


def test_export_draws_no_progress_bar(trained_checkpoint, tmp_path, capfd):
    _, local = trained_checkpoint
    capfd.readouterr()
    export_local_checkpoint(str(local), str(tmp_path / "quiet"))
    captured = capfd.readouterr()
    assert "checkpoint shards" not in captured.err + captured.out, captured.err  # DeepSpeed's tqdm bar
