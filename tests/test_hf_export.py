"""Continued pretraining end to end, on the path every family shares: a Llama 3.2-style model that
transformers itself saved (fp32, random weights, `rope_scaling` llama3 in the published spelling) and
its own byte-level BPE tokenizer (a BOS before each text, `<|end_of_text|>` ending each document) is
read by `checkpoint.init_from` (the driver checks its config.json and tokenizer first), trained with
document masking, bf16 (its fp32 values kept as master weights), validation and `eval.tasks` on
Ray and DeepSpeed, fails once and resumes, then exports from local storage and from the S3 test
server: transformers loads LlamaForCausalLM with its RoPE scaling and no code of ours, its logits are
ours, and generate() gives text through the exported tokenizer, which starts a text with the BOS.
What the families differ in (q/k/v biases, per-head norms, head width, the class) is proven against
transformers in-process, each family on its own: tests/test_families.py, test_document_masking.py."""

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
from raytrain_fast.drills import parse_drills
from raytrain_fast.errors import CheckpointError
from raytrain_fast.launch.trainer import run
from raytrain_fast.storage import StorageConfig, resolve_filesystem
from tests.families import FAMILIES, RUN_SHAPE, family_model, family_tokenizer, published_spelling
from tests.test_train import by_step

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.ray]

STEPS = 4
HF_NAMES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
SOURCE = Path(__file__).resolve().parent.parent / "raytrain_fast" / "model"
"""The corpus: this package's model sources (prepared in a second, unlike the whole standard library)."""


@pytest.fixture(scope="module")
def family_run(ray_session, tmp_path_factory) -> tuple[Path, Path, dict]:
    """(storage root of the finished run 'll', the Hugging Face directory it started from, its last
    checkpoint's metrics)."""
    root = tmp_path_factory.mktemp("family-run")
    start = root / "llama-3.2-style"
    family_model("llama3.2").save_pretrained(str(start))
    published_spelling(start)
    family_tokenizer(start, bos=True, texts=[path.read_text() for path in SOURCE.glob("*.py")])
    config = load_config("llama-tiny", [
        *RUN_SHAPE, *FAMILIES["llama3.2"][2], f"checkpoint.init_from={start}", f"data.tokenizer={start}",
        f"data.source={SOURCE}", "data.seq_len=64", "data.val_fraction=0.25", "data.document_masking=true",
        "eval.tasks=[arc_easy]", "eval.task_limit=4", "eval.sequences=4", "train.micro_batch=4", "train.global_batch=4",
        f"train.steps={STEPS}", "train.log_every=2", "checkpoint.every_steps=2", "optim.warmup_steps=1",
        "engine.precision=bf16", "metrics.peak_measure_s=0.2", "resources.max_failures=1", f"storage.uri={root / 'runs'}",
    ], name="ll")
    result = run(config, hooks=parse_drills([f"fail_once_at=3:{root / 'failed-once'}"]))  # restarts from step 2
    return root / "runs", start, by_step(result)


def test_a_continued_llama_resumes_and_exports_for_transformers_with_our_logits(family_run, tmp_path):
    runs, start, steps = family_run
    assert sorted(steps) == [2, 4] and steps[4]["start_step"] == 2  # failed after step 3, went on from step 2
    assert steps[4]["eval/arc_easy/items"] == 4 and "val/loss" in steps[4]
    out = tmp_path / "hf"
    export_checkpoint(storage_uri=str(runs), storage=StorageConfig(), name="ll", step=None, out_dir=str(out))
    assert HF_NAMES <= {p.name for p in out.iterdir()}  # auto = hf for llama
    info = yaml.safe_load((out / "config.yaml").read_text())["export"]
    assert (info["format"], info["step"], info["tokenizer"]) == ("hf", STEPS, str(start))
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 1  # <|end_of_text|>
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"

    native = tmp_path / "native"
    export_checkpoint(storage_uri=str(runs), storage=StorageConfig(), name="ll", step=None, out_dir=str(native),
                      format="native")
    ours = load_exported(str(native))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(theirs).__name__ == "LlamaForCausalLM" and theirs.config.rope_parameters["factor"] == 32.0
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def forward(self, x):\n        return x"
    tokens = tokenizer(text, return_tensors="pt")["input_ids"]
    assert tokens[0, 0].item() == 0 and tokenizer.decode(tokens[0, 1:]) == text  # <|begin_of_text|>, as each document
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
        assert (got - expected).abs().max().item() <= 1e-4
        original = transformers.AutoModelForCausalLM.from_pretrained(str(start)).eval()
        assert (original(tokens).logits - expected).abs().max().item() > 1e-3  # trained from it, not left as it was
    generated = theirs.generate(tokens, max_new_tokens=10, do_sample=False)
    assert generated.shape[1] == tokens.shape[1] + 10 or generated[0, -1].item() == 1
    assert tokenizer.decode(generated[0], skip_special_tokens=True).startswith(text)

    with pytest.raises(CheckpointError, match="already holds .*config.json.*pass --overwrite"):
        export_checkpoint(storage_uri=str(runs), storage=StorageConfig(), name="ll", step=None, out_dir=str(out))
    with pytest.raises(CheckpointError, match="Hugging Face export: load it with transformers"):
        load_exported(str(out))


def test_the_export_from_s3_has_the_local_exports_weights(family_run, aws_env, tmp_path):
    llama_run = family_run[0]
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
