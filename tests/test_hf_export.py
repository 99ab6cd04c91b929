"""A real tiny llama run (Ray, DeepSpeed ZeRO-2, fp32, a few steps) exported with `--format hf`
from local storage and from the S3 test server: transformers loads it with no code of ours, its
logits are ours, generate() gives text through the exported tokenizer."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch
import yaml

from raytrain_fast.checkpoint.export import export_checkpoint, load_exported
from raytrain_fast.config import load_config
from raytrain_fast.errors import CheckpointError
from raytrain_fast.launch.trainer import run
from raytrain_fast.storage import StorageConfig, resolve_filesystem

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.ray]

STEPS = 4
HF_NAMES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def llama_run(ray_session, tmp_path_factory) -> Path:
    """The storage root of a finished llama-tiny run ('ll') on a small corpus (this package's model
    sources: prepared in a second, unlike the whole standard library)."""
    root = tmp_path_factory.mktemp("llama-run")
    source = Path(__file__).resolve().parent.parent / "raytrain_fast" / "model"
    config = load_config("llama-tiny", [
        f"data.source={source}", "data.seq_len=64", "model.num_layers=2", "train.micro_batch=4",
        "train.global_batch=4", f"train.steps={STEPS}", "train.log_every=2", f"checkpoint.every_steps={STEPS}",
        "optim.warmup_steps=1", "engine.precision=fp32", "metrics.peak_measure_s=0.2", "resources.max_failures=0",
        f"storage.uri={root / 'runs'}",
    ], name="ll")
    run(config)
    return root / "runs"


def test_a_trained_llama_exports_for_transformers_with_our_logits(llama_run, tmp_path):
    out = tmp_path / "hf"
    export_checkpoint(storage_uri=str(llama_run), storage=StorageConfig(), name="ll", step=None, out_dir=str(out))
    assert HF_NAMES <= {p.name for p in out.iterdir()}  # auto = hf for llama
    info = yaml.safe_load((out / "config.yaml").read_text())["export"]
    assert (info["format"], info["step"], info["tokenizer"]) == ("hf", STEPS, "byte")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256

    native = tmp_path / "native"
    export_checkpoint(storage_uri=str(llama_run), storage=StorageConfig(), name="ll", step=None, out_dir=str(native),
                      format="native")
    ours = load_exported(str(native))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def forward(self, x):\n        return x"
    tokens = tokenizer(text, return_tensors="pt")["input_ids"]
    assert tokens[0].tolist() == list(text.encode())  # the ids it trained on
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    assert (got - expected).abs().max().item() <= 1e-4
    with torch.no_grad():  # trained weights, not a fresh init
        assert (type(ours)(ours.config).eval()(tokens) - expected).abs().max().item() > 1e-2
    generated = theirs.generate(tokens, max_new_tokens=10, do_sample=False)
    assert generated.shape[1] == tokens.shape[1] + 10 or generated[0, -1].item() == 256
    assert tokenizer.decode(generated[0]).startswith(text)

    with pytest.raises(CheckpointError, match="already holds .*config.json.*pass --overwrite"):
        export_checkpoint(storage_uri=str(llama_run), storage=StorageConfig(), name="ll", step=None, out_dir=str(out))
    with pytest.raises(CheckpointError, match="Hugging Face export: load it with transformers"):
        load_exported(str(out))


def test_the_export_from_s3_has_the_local_exports_weights(llama_run, aws_env, tmp_path):
    bucket = aws_env.make_bucket(f"hf-{uuid.uuid4().hex[:8]}")
    storage = StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=aws_env.endpoint_url)
    filesystem, root = resolve_filesystem(storage.uri, storage)
    pafs.copy_files(str(llama_run / "ll"), f"{root}/ll", destination_filesystem=filesystem)
    local, remote = tmp_path / "local", tmp_path / "s3"
    export_checkpoint(storage_uri=str(llama_run), storage=StorageConfig(), name="ll", step=STEPS, out_dir=str(local),
                      dtype="bf16")
    export_checkpoint(storage_uri=storage.uri, storage=storage, name="ll", step=None, out_dir=str(remote), dtype="bf16")
    from safetensors.torch import load_file

    a, b = load_file(str(local / "model.safetensors")), load_file(str(remote / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and b[k].dtype == torch.bfloat16 for k in a)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(remote))
    assert model.dtype == torch.bfloat16 and (remote / "tokenizer.json").read_text() == (local / "tokenizer.json").read_text()
