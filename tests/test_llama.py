"""The Llama-family model and the Hugging Face format, without Ray: our llama (and the GPT with
learned positions) written by the export's writer load in transformers with the same logits; the
FLOPs formula, activation checkpointing and the chunked loss hold for llama as for the GPT; the
byte tokenizer's tokenizer.json gives today's byte ids."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from raytrain_fast.checkpoint.hf_export import write_hf_export
from raytrain_fast.config import load_config, validate
from raytrain_fast.data.tokenizer import byte_tokenizer, load_tokenizer
from raytrain_fast.errors import CheckpointError, ConfigError
from raytrain_fast.model import GPT, ModelConfig, build_model, flops_per_token
from raytrain_fast.config.model import llama_mlp_hidden
from raytrain_fast.model.flops import count_training_flops_per_token
from raytrain_fast.model.llama import Llama

pytestmark = pytest.mark.unit

transformers = pytest.importorskip("transformers")

LLAMA = ModelConfig(
    architecture="llama", vocab_size=300, max_seq_len=32, num_layers=2, num_heads=4, num_kv_heads=2, d_model=32,
    mlp_multiple_of=16, rope_theta=500000.0, tie_embeddings=False,
)


def _variant(base: ModelConfig, **changes) -> ModelConfig:
    return ModelConfig(**{**base.__dict__, **changes})


def _random_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Norm weights away from 1 too, so a norm mapped to the wrong place shows in the logits."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.5 * torch.randn_like(param))
    return model.eval()


def _export_and_load(model: GPT, tmp_path, **kwargs):
    state = {k: v.detach() for k, v in model.state_dict().items()}
    files = write_hf_export(state, model.config, str(tmp_path), tokenizer=byte_tokenizer(), dtype="float32", **kwargs)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    return files, loaded


@pytest.mark.parametrize("changes", [{}, {"tie_embeddings": True, "num_kv_heads": 0}, {"num_kv_heads": 1}],
                         ids=["gqa-untied", "mha-tied", "mqa"])
def test_a_llama_export_loads_in_transformers_with_our_logits(changes, tmp_path):
    config = _variant(LLAMA, **changes)
    torch.manual_seed(0)
    ours = _random_weights(Llama(config))
    files, theirs = _export_and_load(ours, tmp_path)
    assert type(theirs).__name__ == "LlamaForCausalLM" and files[0] == "model.safetensors"
    assert theirs.config.num_key_value_heads == (changes.get("num_kv_heads") or 4 if changes else 2)
    assert theirs.config.tie_word_embeddings == config.tie_embeddings
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        expected, got = ours(tokens), theirs(tokens).logits
    assert (got - expected).abs().max().item() <= 1e-4
    with torch.no_grad():  # a second, differently seeded model is far away: the test can fail
        assert (Llama(config).eval()(tokens) - got).abs().max().item() > 1e-2


def test_weights_above_the_shard_size_are_sharded_with_an_index(tmp_path):
    torch.manual_seed(0)
    ours = _random_weights(Llama(LLAMA))
    files, theirs = _export_and_load(ours, tmp_path, max_shard_bytes=40_000)
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards) and not (tmp_path / "model.safetensors").exists()
    tokens = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tied", [True, False])
def test_a_gpt_with_learned_positions_exports_as_gpt2_with_our_logits(tied, tmp_path):
    config = ModelConfig(vocab_size=300, max_seq_len=32, num_layers=2, num_heads=4, d_model=32, tie_embeddings=tied)
    torch.manual_seed(0)
    ours = GPT(config)
    with torch.no_grad():  # LayerNorm biases away from 0 too
        for name, param in ours.named_parameters():
            if name.endswith("bias"):
                param.normal_()
    _, theirs = _export_and_load(_random_weights(ours), tmp_path)
    assert type(theirs).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours(tokens)).abs().max().item() <= 1e-4


def test_a_rotary_gpt_is_refused_naming_the_llama_architecture(tmp_path):
    config = ModelConfig(vocab_size=300, max_seq_len=32, num_layers=1, num_heads=2, d_model=32, positions="rotary")
    with pytest.raises(CheckpointError, match="model.architecture=llama"):
        write_hf_export(GPT(config).state_dict(), config, str(tmp_path), tokenizer=byte_tokenizer(), dtype="float32")
    assert not list(tmp_path.iterdir())  # refused before writing anything


def test_generate_returns_text_through_the_exported_byte_tokenizer(tmp_path):
    torch.manual_seed(0)
    _, theirs = _export_and_load(Llama(LLAMA), tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = tokenizer("def main():", return_tensors="pt")
    out = theirs.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]
    text = tokenizer.decode(out[0])
    assert isinstance(text, str) and text.startswith("def main():")


def test_the_exported_byte_tokenizer_gives_todays_byte_ids(tmp_path):
    write_hf_export(Llama(LLAMA).state_dict(), LLAMA, str(tmp_path), tokenizer=byte_tokenizer(), dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    rng = np.random.default_rng(0)
    documents = [
        "plain ascii\n\tand tabs  ", "héllo wörld, ünïcode ✓ 😀 日本語", "".join(chr(c) for c in range(0, 256)),
        "".join(chr(c) for c in rng.integers(32, 0x2FFF, 200)),
    ]
    for text in documents:
        assert tokenizer(text)["input_ids"] == list(text.encode("utf-8")), text[:20]
        assert tokenizer.decode(list(text.encode("utf-8"))) == text
    assert tokenizer.eos_token_id == 256 and tokenizer("<|endoftext|>")["input_ids"] == [256]
    # The same file as a prepare-data tokenizer: every document and its end-of-document id as `byte`.
    spec = load_tokenizer(str(tmp_path / "tokenizer.json"))
    encoded = [d.encode("utf-8") for d in documents]
    assert spec.info.eod_id == 256 and spec.info.vocab_size == 257
    np.testing.assert_array_equal(spec.encode_documents(encoded), byte_tokenizer().encode_documents(encoded))


# --------------------------------------------------------------------------- what the GPT has


def test_llama_flops_formula_matches_the_flop_counter_within_10_percent():
    config = load_config("llama-tiny").model  # grouped-query: 2 key/value heads for 4 query heads
    model = build_model(config)
    counted = count_training_flops_per_token(model, torch.randint(0, 257, (1, 128)))
    formula = flops_per_token(config, 128)
    assert abs(counted - formula) / formula < 0.10, (counted, formula)
    assert flops_per_token(_variant(config, num_kv_heads=1), 128) < flops_per_token(config, 128)  # GQA counted


@pytest.mark.parametrize("changes", [{"activation_checkpointing": "full"}, {"chunked_loss": "on"}], ids=["ac", "chunked"])
def test_llama_checkpointing_and_the_chunked_loss_keep_the_loss_and_gradients(changes):
    torch.manual_seed(0)
    plain = Llama(LLAMA)
    featured = Llama(_variant(LLAMA, **changes))
    featured.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 33))
    results = []
    for model in (plain, featured):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in model.named_parameters()}))
    assert results[1][0] == pytest.approx(results[0][0], rel=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_swiglu_width_follows_llamas_rule_and_the_presets_have_their_sizes():
    assert llama_mlp_hidden(ModelConfig(architecture="llama", d_model=4096)) == 11008  # Llama 2 7B
    assert llama_mlp_hidden(ModelConfig(architecture="llama", d_model=4096, mlp_hidden=14336)) == 14336
    sizes = {}
    for preset in ("llama-150m", "llama-1b", "llama-3b", "llama-8b"):
        with torch.device("meta"):
            sizes[preset] = build_model(load_config(preset).model).num_params() / 1e9
    assert sizes == pytest.approx({"llama-150m": 0.153, "llama-1b": 1.236, "llama-3b": 3.213, "llama-8b": 8.030}, abs=0.002)


def test_gpt_is_still_the_default_and_bad_llama_fields_are_named():
    assert type(build_model(load_config("tiny").model)) is GPT
    with pytest.raises(ConfigError, match=r"model.num_kv_heads \(3\) must divide model.num_heads \(4\)"):
        validate(load_config("llama-tiny", ["model.num_kv_heads=3"]))


def test_a_bpe_tokenizer_exports_with_the_ids_prepare_data_makes(tmp_path):
    """A run's own tokenizer.json (trained here: nothing downloaded), with a post-processor that adds
    a BOS: the data has it before each document, and the export gives AutoTokenizer those ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    from raytrain_fast.checkpoint.hf_export import run_tokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator(["def main(): return 1", "class Model: pass"] * 50,
                            trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.save(str(tmp_path / "bpe.json"))
    spec = run_tokenizer({"data": {"source": "stdlib", "tokenizer": str(tmp_path / "bpe.json")}}, None)
    out = tmp_path / "export"
    write_hf_export(Llama(LLAMA).state_dict(), LLAMA, str(out), tokenizer=spec, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "def main(): pass"
    trained_on = spec.encode_documents([text.encode()]).tolist()
    assert tokenizer(text)["input_ids"] + [tokenizer.eos_token_id] == trained_on and tokenizer.eos_token == "</s>"
    assert bpe.encode(text).ids[0] == 1  # the file itself adds the BOS
