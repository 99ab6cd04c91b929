"""The model families `checkpoint.init_from` reads, at a tiny size, as transformers itself builds and
saves them (random weights, nothing downloaded), with a family-style tokenizer trained here; and the
run settings that describe each one (what a user writes, as the presets do)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, initializer_range=0.2)
RUN_SHAPE = ["model.vocab_size=320", "model.d_model=64", "model.mlp_hidden=160", "model.num_layers=2", "model.num_heads=4",
             "model.num_kv_heads=2", "model.max_seq_len=128", "model.norm_eps=1e-5"]
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}  # 16, not 8192: at 128 positions the scaling must show

FAMILIES: dict[str, tuple[str, dict[str, Any], list[str]]] = {
    # name: (transformers config class, its family-specific config, the run's model settings for it)
    "llama3.2": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": {"rope_theta": 500000.0, **LLAMA3_ROPE}},
                 ["model.tie_embeddings=true", "model.rope_theta=500000", "model.rope_scaling=llama3", "model.rope_factor=32",
                  "model.rope_original_max_seq_len=16"]),
    "llama-linear": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
                     ["model.rope_scaling=linear", "model.rope_factor=4"]),
    "smollm2": ("LlamaConfig", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0}},
                ["model.tie_embeddings=true", "model.rope_theta=100000"]),
    "mistral": ("MistralConfig", {"sliding_window": None}, ["model.family=mistral"]),
    "qwen2.5": ("Qwen2Config", {"tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                ["model.family=qwen2", "model.qkv_bias=true", "model.tie_embeddings=true", "model.rope_theta=1000000"]),
    "qwen3": ("Qwen3Config", {"head_dim": 24},  # 4 heads x 24 = 96, not d_model 64
              ["model.family=qwen3", "model.qk_norm=true", "model.head_dim=24"]),
}
CLASSES = {"llama3.2": "LlamaForCausalLM", "llama-linear": "LlamaForCausalLM", "smollm2": "LlamaForCausalLM",
           "mistral": "MistralForCausalLM", "qwen2.5": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def family_model(name: str, *, vocab_size: int = 320):
    """transformers' model of family `name` with random weights: norms away from 1 and biases away
    from 0 too, so a norm or bias mapped to the wrong place changes the loss."""
    import transformers

    class_name, specific, _ = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, class_name)(**{**SHAPE, "vocab_size": vocab_size}, **specific)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for parameter_name, param in model.named_parameters():
            if "norm" in parameter_name:
                param.normal_(1.0, 0.3)
            elif parameter_name.endswith("bias"):
                param.normal_(0.0, 0.3)
    return model


def published_spelling(directory: Path) -> None:
    """Rewrite a saved config.json's RoPE settings as published Llama 3.x files spell them:
    `rope_scaling` beside `rope_theta`, no `rope_parameters` (transformers 5 writes that one)."""
    path = directory / "config.json"
    config = json.loads(path.read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope if rope["rope_type"] != "default" else None
    path.write_text(json.dumps(config, indent=2))


def family_tokenizer(directory: Path, *, bos: bool, texts: list[str], vocab_size: int = 320, mistral: bool = False) -> None:
    """A byte-level BPE trained on `texts` into directory/tokenizer.json: Llama 3's special tokens
    and post-processor (`<|begin_of_text|>` before each text) with `bos`, else Qwen's
    (`<|endoftext|>`, nothing added); with `mistral`, Mistral's (`<unk>`, `<s>`, `</s>` as ids 0-2,
    the ids its config.json names, and `<s>` before each text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if mistral:
        specials, bos_token = ["<unk>", "<s>", "</s>"], "<s>"
    else:
        specials = ["<|begin_of_text|>", "<|end_of_text|>"] if bos else ["<|endoftext|>", "<|im_start|>"]
        bos_token = "<|begin_of_text|>" if bos else None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    if bos_token:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A", special_tokens=[(bos_token, tokenizer.token_to_id(bos_token))])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))


MODEL_SOURCES = Path(__file__).resolve().parent.parent / "raytrain_fast" / "model"
"""The corpus of the family runs on Ray: this package's model sources (53 KB: a BPE tokenizes them in a
second, where the whole standard library takes minutes)."""


def family_start(name: str, directory: Path, *, bos: bool, mistral: bool = False) -> tuple[str, ...]:
    """transformers' model of family `name` and a family-style tokenizer (family_tokenizer's `bos` and
    `mistral`) trained on MODEL_SOURCES, saved in `directory`; returns the run settings that continue
    pretraining from it on MODEL_SOURCES."""
    family_model(name).save_pretrained(str(directory))
    family_tokenizer(directory, bos=bos, mistral=mistral, texts=[path.read_text() for path in MODEL_SOURCES.glob("*.py")])
    return (*RUN_SHAPE, *FAMILIES[name][2], f"checkpoint.init_from={directory}", f"data.tokenizer={directory}",
            f"data.source={MODEL_SOURCES}")


def assert_generates(directory: Path, class_name: str, prompt: str = "def forward(self, x):") -> None:
    """An exported directory loads in transformers as `class_name`, and generate() goes on from `prompt`
    (which its tokenizer gives back, special tokens aside)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()
    assert type(model).__name__ == class_name
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    tokens = tokenizer(prompt, return_tensors="pt")["input_ids"]
    generated = model.generate(tokens, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > tokens.shape[1] and tokenizer.decode(generated[0, :tokens.shape[1]], skip_special_tokens=True) == prompt
