"""The model families people continue pretraining (Llama 3.x with its RoPE scaling, SmolLM2, Mistral,
Qwen2/2.5, Qwen3), each as transformers itself builds and saves it (random weights, nothing
downloaded): `checkpoint.init_from` gives transformers' loss at step 0 and the export is the family's
class with our logits (fp32, within 1e-4); every config.json field is mapped or refused by name, a
weight with no place is refused, the run's tokenizer must be the directory's; the presets have the
published shapes; a tokenizer that puts a BOS before a text puts it before every document, context
and export; an fp32 checkpoint stays fp32 in a bf16 engine's master weights. The continued-pretraining
run itself (train, resume, export, generate) is tests/test_hf_export.py's."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from raytrain_fast.checkpoint.hf_export import write_hf_export
from raytrain_fast.checkpoint.hf_import import init_from_problems, read_hf_weights
from raytrain_fast.checkpoint.init_from import load_initial_weights
from raytrain_fast.config import load_config, validate
from raytrain_fast.data.tokenizer import byte_tokenizer, load_tokenizer
from raytrain_fast.errors import CheckpointError, ConfigError
from raytrain_fast.model import build_model
from raytrain_fast.model.hf import model_differences, model_fields_from_hf
from raytrain_fast.storage import StorageConfig, resolve_filesystem
from tests.families import CLASSES, FAMILIES, RUN_SHAPE, family_model, family_tokenizer, published_spelling

pytestmark = pytest.mark.unit

transformers = pytest.importorskip("transformers")


def run_config(family: str, *extra: str):
    return load_config("llama-tiny", [*RUN_SHAPE, *FAMILIES[family][2], *extra])


def saved(family: str, directory) -> tuple:
    model = family_model(family)
    model.save_pretrained(str(directory))
    if family == "llama3.2":  # as published Llama 3.x files spell it: rope_scaling + rope_theta
        published_spelling(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()  # transformers' reading of it
    return model, str(directory)


def random_weights(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.copy_(float("norm" in name) + 0.3 * torch.randn_like(param))
    return model.eval()


TOKENS = torch.randint(0, 320, (3, 49), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("family", FAMILIES)
def test_init_from_a_family_gives_transformers_loss_at_step_0(family, tmp_path):
    theirs, directory = saved(family, tmp_path / "hf")
    config = run_config(family, f"checkpoint.init_from={directory}")
    assert init_from_problems(config) == []
    ours = build_model(config.model).eval()
    before = {n: p.clone() for n, p in ours.named_parameters()}
    assert load_initial_weights(ours, directory, storage=StorageConfig()) == "Hugging Face weights"
    assert all(not torch.equal(before[n], p) for n, p in ours.named_parameters())  # every weight was loaded
    with torch.no_grad():
        loss = ours(TOKENS[:, :-1], TOKENS[:, 1:]).item()
        expected = theirs(input_ids=TOKENS, labels=TOKENS).loss.item()  # transformers shifts the labels itself
        assert abs(loss - expected) <= 1e-4
        if config.model.rope_scaling != "none":  # the scaling is read, not left out: without it the loss moves
            plain = build_model(dataclasses.replace(config.model, rope_scaling="none")).eval()
            plain.load_state_dict(ours.state_dict())
            assert abs(plain(TOKENS[:, :-1], TOKENS[:, 1:]).item() - expected) > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_is_the_familys_class_with_our_logits(family, tmp_path):
    config = run_config(family).model
    torch.manual_seed(0)
    ours = random_weights(build_model(config))
    write_hf_export({k: v.detach() for k, v in ours.state_dict().items()}, config, str(tmp_path), tokenizer=byte_tokenizer(),
                    dtype="float32")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(theirs).__name__ == CLASSES[family]
    with torch.no_grad():
        assert (theirs(TOKENS).logits - ours(TOKENS)).abs().max().item() <= 1e-4
    # Read back as init_from reads it, the export is the run's model again.
    assert model_differences(config, model_fields_from_hf(json.loads((tmp_path / "config.json").read_text()))) == []
    assert theirs.generate(TOKENS[:1, :5], max_new_tokens=3, do_sample=False).shape[1] > 5


@pytest.mark.parametrize(("family", "edit", "named"), [
    ("llama3.2", {"model_type": "gemma"}, "model_type 'gemma' is not one of the families read"),
    ("smollm2", {"attention_bias": True}, "attention_bias True"),
    ("smollm2", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ("smollm2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ("llama3.2", {"rope_scaling": {**FAMILIES["llama3.2"][1]["rope_parameters"], "beta_fast": 32}}, "rope_parameters.beta_fast"),
    ("qwen2.5", {"use_sliding_window": True}, "use_sliding_window True"),
    ("qwen3", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
    ("qwen3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config (the weights are quantized"),
    ("mistral", {"some_new_field": 1}, "some_new_field (a field this package does not map"),
])
def test_every_config_field_is_mapped_or_refused_by_name(family, edit, named, tmp_path):
    _, directory = saved(family, tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    (problem,) = init_from_problems(run_config(family, f"checkpoint.init_from={directory}"))
    assert named in problem and problem.startswith(f"checkpoint.init_from={directory}: its config.json cannot be loaded")


def test_a_family_the_run_does_not_match_is_refused_with_the_settings_that_match(tmp_path):
    _, directory = saved("qwen3", tmp_path / "hf")
    (message,) = init_from_problems(run_config("smollm2", f"checkpoint.init_from={directory}"))
    for field in ("model.family: run 'llama', checkpoint 'qwen3'", "model.qk_norm: run False, checkpoint True",
                  "model.head_dim: run 16, checkpoint 24", "--set model.family=qwen3 "):
        assert field in message
    with pytest.raises(ConfigError, match="model.family=qwen3 has no biases on q/k/v and a per-head q/k norm: set "
                                          "model.qkv_bias=false and model.qk_norm=true"):
        validate(run_config("smollm2", "model.family=qwen3"))


def test_a_mistral_window_shorter_than_the_sequence_is_refused_and_a_longer_one_exported_back(tmp_path):
    model = family_model("mistral")
    model.config.sliding_window = 64
    model.save_pretrained(str(tmp_path / "hf"))
    config = run_config("mistral", f"checkpoint.init_from={tmp_path / 'hf'}", "model.sliding_window=64")
    (problem,) = init_from_problems(config)
    assert "model.sliding_window (64) is shorter than data.seq_len (128)" in problem and "data.seq_len <= 64" in problem
    kept = run_config("mistral", f"checkpoint.init_from={tmp_path / 'hf'}", "model.sliding_window=64", "data.seq_len=64")
    assert init_from_problems(kept) == []
    write_hf_export(build_model(kept.model).state_dict(), kept.model, str(tmp_path / "out"), tokenizer=byte_tokenizer(),
                    dtype="float32")
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "out")).sliding_window == 64


def test_a_weight_with_no_place_is_refused_never_dropped(tmp_path):
    from safetensors.torch import load_file, save_file

    _, directory = saved("qwen3", tmp_path / "hf")
    weights = load_file(f"{directory}/model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(weights, f"{directory}/model.safetensors", metadata={"format": "pt"})
    filesystem, path = resolve_filesystem(directory, StorageConfig())
    with pytest.raises(CheckpointError, match=r"weights our llama has no place for: \['model.layers.0.self_attn.o_proj.bias'\]"):
        read_hf_weights(filesystem, path, run_config("qwen3").model)


def test_the_run_tokenizes_with_the_directorys_own_tokenizer(tmp_path):
    """Checked with the run's sources (check_sources), from the tokenizer they settle: data.tokenizer
    for text prepared on the fly, the manifest's for a prepared source."""
    from raytrain_fast.data.mixture import check_sources
    from raytrain_fast.data.prepare import prepare_data
    from raytrain_fast.errors import ConfigError

    _, directory = saved("qwen2.5", tmp_path / "hf")
    family_tokenizer(tmp_path / "hf", bos=False, texts=["def main(): return 1"] * 20)
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text("def main(): return 1\n" * 400)
    on_the_fly = ("data.source=" + str(tmp_path / "texts"), f"checkpoint.init_from={directory}")
    assert init_from_problems(run_config("qwen2.5", *on_the_fly)) == []  # the model matches; the data is not read here
    with pytest.raises(ConfigError) as refused:
        check_sources(run_config("qwen2.5", *on_the_fly))
    (problem,) = refused.value.problems
    assert f"comes with its own tokenizer (tokenizer.json), but this run's data is tokenized with byte" in problem
    assert problem.endswith(f"set data.tokenizer={directory}")
    assert check_sources(run_config("qwen2.5", *on_the_fly, f"data.tokenizer={directory}")) == []

    prepare_data(inputs=[str(tmp_path / "texts")], output=str(tmp_path / "prepared"), seq_len=128, parallel=False, verbose=False)
    with pytest.raises(ConfigError) as refused:
        check_sources(run_config("qwen2.5", f"data.source={tmp_path / 'prepared'}", f"checkpoint.init_from={directory}"))
    (problem,) = refused.value.problems
    assert "this run's data is tokenized with byte" in problem
    assert problem.endswith(f"prepare {tmp_path / 'prepared'} again with `raytrain-fast prepare-data --tokenizer {directory}`")


PUBLISHED = {"qwen2.5-0.5b": 494_032_768, "qwen3-0.6b": 596_049_920, "smollm2-360m": 361_821_120, "llama3.2-1b": 1_235_814_400}
"""Parameter counts of Qwen2.5-0.5B, Qwen3-0.6B, SmolLM2-360M and Llama-3.2-1B (their model cards and safetensors)."""


@pytest.mark.parametrize("preset", PUBLISHED)
def test_the_family_presets_have_the_published_shapes(preset):
    from raytrain_fast.model.hf import hf_config

    model = load_config(preset).model
    config = hf_config(model, eos_token_id=0, dtype="bfloat16")
    theirs = transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k not in ("architectures", "model_type", "dtype", "torch_dtype")})
    with torch.device("meta"):
        ours = build_model(model)
        theirs = transformers.AutoModelForCausalLM.from_config(theirs)
    assert ours.num_params() == PUBLISHED[preset] == sum(p.numel() for p in theirs.parameters())
    assert type(theirs).__name__ == config["architectures"][0]


def test_a_bos_tokenizer_starts_every_document_context_and_export_with_it(tmp_path):
    from raytrain_fast.data.hf_tokenizer import hf_tokenizer_files
    from raytrain_fast.downstream.encode import encode_task
    from raytrain_fast.downstream.run import encoder_for
    from raytrain_fast.downstream.tasks import Item, Task

    texts = ["def main():\n    return 1\n", "class Model:\n    pass\n"] * 30
    family_tokenizer(tmp_path / "llama", bos=True, texts=texts)
    family_tokenizer(tmp_path / "qwen", bos=False, texts=texts)
    llama, qwen = load_tokenizer(str(tmp_path / "llama")), load_tokenizer(str(tmp_path / "qwen"))
    bos, eod = llama.info.bos_id, llama.info.eod_id
    assert (bos, eod) == (0, 1) and qwen.info.bos_id is None  # <|begin_of_text|>, <|end_of_text|>; Qwen adds none
    documents = [b"def main():", b"class Model:"]
    ids = llama.encode_documents(documents).tolist()
    body = [llama.encode_text(d.decode()) for d in documents]
    assert ids == [bos, *body[0], eod, bos, *body[1], eod]
    assert qwen.encode_documents(documents).tolist() == [*qwen.encode_text("def main():"), qwen.info.eod_id,
                                                         *qwen.encode_text("class Model:"), qwen.info.eod_id]
    assert llama.info.identity() != dataclasses.replace(llama.info, bos_id=None).identity()  # prepared data of its own
    # Exported, AutoTokenizer gives the ids a document was trained on (its BOS first).
    export = tmp_path / "export"
    export.mkdir()
    for name, text in hf_tokenizer_files(llama, model_max_length=128).items():
        (export / name).write_text(text)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(export))
    assert tokenizer("def main():")["input_ids"] + [tokenizer.eos_token_id] == ids[:len(body[0]) + 2]
    # Scored, each choice's context starts with the BOS, as its document did in training.
    task = Task(name="t", items=(Item(index=0, contexts=("def", ""), continuations=(" main", "class"), gold=0),), total=1,
                source="here")
    encoded = encode_task(task, encoder_for(llama, load_config("llama-tiny").model))
    assert [s[0] for s in encoded.sequences] == [bos, bos] and encoded.context_tokens.tolist()[1] == 1


_FP32_MASTERS = r"""
import torch
from raytrain_fast.checkpoint.init_from import fp32_values
from raytrain_fast.config import load_config
from raytrain_fast.engine import select_accelerator
from raytrain_fast.engine.process_group import single_process_group
from raytrain_fast.engine.program import build_program, eager_model

select_accelerator()
single_process_group("gloo")
from deepspeed.utils import safe_get_full_fp32_param

config = load_config("llama-tiny", ["model.family=qwen2", "model.qkv_bias=true", "engine.precision=bf16", "engine.compile=off",
                                    "train.micro_batch=2", "train.global_batch=2", "model.num_layers=1"])
for keep in (False, True):
    model = eager_model(config, device=torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():  # as an fp32 checkpoint's: values a bf16 copy rounds
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    values = fp32_values(model)
    engine = build_program(config, device=torch.device("cpu"), model=model, masters=values if keep else None).engine
    error = max((safe_get_full_fp32_param(p) - v).abs().max().item() for p, v in values)
    print("masters", keep, len(values), error)
torch.distributed.destroy_process_group()
"""


@pytest.mark.ray  # DeepSpeed in a subprocess: about 5-15 s
def test_an_fp32_checkpoint_keeps_its_values_as_a_bf16_engines_master_weights():
    import os
    import subprocess
    import sys

    found = subprocess.run([sys.executable, "-c", _FP32_MASTERS], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert found.returncode == 0, found.stderr[-3000:]
    results = {line.split()[1]: line.split()[2:] for line in found.stdout.splitlines() if line.startswith("masters ")}
    (dropped, error_dropped), (kept, error_kept) = results["False"], results["True"]
    assert int(dropped) == int(kept) > 5  # every weight of the module (norms and biases included)
    assert float(error_dropped) > 1e-4 and float(error_kept) == 0.0  # rounded to bf16 by DeepSpeed, unless kept
