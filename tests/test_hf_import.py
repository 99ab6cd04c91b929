"""checkpoint.init_from of a Hugging Face directory: a random LlamaForCausalLM saved by transformers
itself (nothing downloaded), sharded, initialises our llama from the S3 test server to the loss
transformers computes on the same batch; a model that differs is refused before any worker starts,
with every differing field. Each family from a local directory, and what is refused: test_families.py."""

from __future__ import annotations

import dataclasses
import uuid

import pyarrow.fs as pafs
import pytest
import torch

from raytrain_fast.checkpoint.init_from import load_initial_weights
from raytrain_fast.checkpoint.hf_import import init_from_problems
from raytrain_fast.config import load_config
from raytrain_fast.errors import ConfigError
from raytrain_fast.launch.checks import check_run
from raytrain_fast.model import build_model
from raytrain_fast.storage import StorageConfig, resolve_filesystem

pytestmark = pytest.mark.unit

transformers = pytest.importorskip("transformers")

RUN_MODEL = ["model.d_model=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_hidden=160",
             "model.rope_theta=500000"]


def _saved_llama(directory, **save_kwargs) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, initializer_range=0.2,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1: a misplaced norm weight must change the loss
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.3)
    model.save_pretrained(str(directory), **save_kwargs)
    return model


def _same_loss_at_step_0(hf_model, uri: str, storage: StorageConfig) -> None:
    config = dataclasses.replace(load_config("llama-tiny", [*RUN_MODEL, f"checkpoint.init_from={uri}"]), storage=storage)
    assert init_from_problems(config) == []
    ours = build_model(config.model).eval()
    before = {n: p.clone() for n, p in ours.named_parameters()}
    assert load_initial_weights(ours, uri, storage=storage) == "Hugging Face weights"
    tokens = torch.randint(0, 257, (4, 65), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loss = ours(tokens[:, :-1], tokens[:, 1:]).item()
        expected = hf_model(input_ids=tokens, labels=tokens).loss.item()  # transformers shifts the labels itself
    assert loss == pytest.approx(expected, rel=1e-5, abs=1e-5)
    assert all(not torch.equal(before[n], p) for n, p in ours.named_parameters())  # every weight was loaded


def test_a_sharded_llama_initialises_a_run_from_s3(aws_env, tmp_path):
    hf_model = _saved_llama(tmp_path / "hf", max_shard_size="100KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    bucket = aws_env.make_bucket(f"hfin-{uuid.uuid4().hex[:8]}")
    storage = StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=aws_env.endpoint_url)
    filesystem, root = resolve_filesystem(f"s3://{bucket}/llama", storage)
    pafs.copy_files(str(tmp_path / "hf"), root, destination_filesystem=filesystem)
    _same_loss_at_step_0(hf_model, f"s3://{bucket}/llama", storage)


def test_a_model_that_differs_is_refused_before_any_worker_with_every_field(tmp_path):
    _saved_llama(tmp_path / "hf")
    config = load_config("llama-tiny", [
        "model.d_model=64", "model.num_layers=3", "model.num_heads=4", "model.num_kv_heads=0", "model.mlp_hidden=160",
        f"checkpoint.init_from={tmp_path / 'hf'}", f"storage.uri={tmp_path / 'runs'}", "train.steps=10", "optim.warmup_steps=20",
    ])
    with pytest.raises(ConfigError) as raised:
        check_run(config)
    message = str(raised.value)
    assert "optim.warmup_steps (20) exceeds train.steps (10)" in message  # named in the same message: one try fixes both
    assert "model.num_layers: run 3, checkpoint 2" in message and "model.rope_theta: run 10000.0, checkpoint 500000.0" in message
    assert "model.num_kv_heads: run 4, checkpoint 2" in message  # 0 = num_heads, compared as derived
    assert "model.d_model" not in message and "model.mlp_hidden" not in message  # equal: not listed
    assert "3 field(s)" in message and "--set model.num_layers=2" in message and "--set model.num_kv_heads=2" in message
