"""Our models in Hugging Face `transformers` terms: config.json fields and weight names, both ways.

Pure dictionaries and tensors, no `transformers` import: the export (checkpoint/hf_export.py) and
`checkpoint.init_from` of a Hugging Face directory (checkpoint/hf_import.py) use them.

- llama <-> the class of its `model.family` (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
  Qwen3ForCausalLM): our fused q|k|v (weights and Qwen2's biases) and gate|up matrices are split into
  (joined from) q_proj, k_proj, v_proj and gate_proj, up_proj; the rest (Qwen3's q_norm and k_norm
  too) are renames. Exact: the same numerics (model/llama.py) give the same logits.
- GPT with learned positions -> GPT2LMHeadModel: GPT-2's Conv1D stores weights as (in, out), so each
  linear is transposed; GPT-2 has biases where we have none, written as zeros (exact). The GPT with
  rotary positions has no GPT-2 counterpart and is refused (see `hf_refusal`).
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_fast.config.model import ModelConfig, head_size, kv_heads, llama_mlp_hidden

FAMILY_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}
"""model.family -> the transformers class its export is (and the config.json model_type it reads)."""


def hf_refusal(config: ModelConfig) -> str | None:
    """Why `config` cannot be exported in the Hugging Face format, or None when it can."""
    if config.architecture == "gpt" and config.positions != "learned":
        return (
            "a GPT with model.positions=rotary has no Hugging Face counterpart (GPT-2 has learned positions, and "
            "our rotary layout is not Llama's): export it with --format native, or train with "
            "model.architecture=llama (e.g. --config llama-tiny), which exports as LlamaForCausalLM"
        )
    return None


def hf_config(config: ModelConfig, *, eos_token_id: int | None, dtype: str, bos_token_id: int | None = None) -> dict[str, Any]:
    """config.json of the Hugging Face model class that holds `config`'s weights (every field
    the family's class / GPT2LMHeadModel read, so nothing falls back to a class default)."""
    if config.architecture == "llama":
        return _llama_config(config, bos_token_id=bos_token_id, eos_token_id=eos_token_id, dtype=dtype)
    dropout = config.dropout
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.max_seq_len, "n_embd": config.d_model,
        "n_layer": config.num_layers, "n_head": config.num_heads, "n_inner": config.mlp_ratio * config.d_model,
        "activation_function": "gelu_new",  # GELU with the tanh approximation, as our MLP
        "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout,
        "layer_norm_epsilon": 1e-5, "initializer_range": config.init_std,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "use_cache": True, "bos_token_id": eos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id,
        "tie_word_embeddings": config.tie_embeddings, "torch_dtype": dtype, "dtype": dtype,
    }


def to_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict (names as GPT/Llama.state_dict) in the Hugging Face class's names; a tied
    output layer is left out (transformers ties it again from tie_word_embeddings)."""
    if config.architecture == "llama":
        return _to_llama(state, config)
    return _to_gpt2(state, config)


def _llama_config(config: ModelConfig, *, bos_token_id: int | None, eos_token_id: int | None, dtype: str) -> dict[str, Any]:
    theta, family = float(config.rope_theta), config.family
    rope: dict[str, Any] = {"rope_type": config.rope_scaling if config.rope_scaling != "none" else "default", "rope_theta": theta}
    if config.rope_scaling != "none":
        rope["factor"] = float(config.rope_factor)
    if config.rope_scaling == "llama3":
        rope.update(low_freq_factor=float(config.rope_low_freq_factor), high_freq_factor=float(config.rope_high_freq_factor),
                    original_max_position_embeddings=config.rope_original_max_seq_len)
    out = {
        "architectures": [FAMILY_CLASSES[family]], "model_type": family,
        "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": llama_mlp_hidden(config), "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": kv_heads(config),
        "head_dim": head_size(config), "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len, "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps, "use_cache": True,
        # pad = the end-of-document token, as the exported tokenizer's pad_token (the mask hides it).
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id,
        "tie_word_embeddings": config.tie_embeddings,
        # transformers >= 5 reads rope_parameters; older readers (and vLLM's) rope_theta and rope_scaling.
        "rope_theta": theta, "rope_parameters": rope, "rope_scaling": rope if config.rope_scaling != "none" else None,
        "attention_dropout": config.dropout, "torch_dtype": dtype, "dtype": dtype,
    }
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif family == "mistral":
        out["sliding_window"] = config.sliding_window or None
    else:
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.num_layers,
                   layer_types=["full_attention"] * config.num_layers, **({"attention_bias": False} if family == "qwen3" else {}))
    return out


def _llama_names(config: ModelConfig) -> dict[str, tuple[list[str], list[int]]]:
    """Our weight (after blocks.<i>.) -> (the transformers weights it joins, after model.layers.<i>.;
    the sizes of their first dimensions, [] for a plain rename)."""
    head = head_size(config)
    q, kv, hidden = config.num_heads * head, kv_heads(config) * head, llama_mlp_hidden(config)
    qkv = [f"self_attn.{p}_proj" for p in "qkv"]
    names = {
        "norm_attn.weight": (["input_layernorm.weight"], []), "attn.proj.weight": (["self_attn.o_proj.weight"], []),
        "norm_mlp.weight": (["post_attention_layernorm.weight"], []), "mlp.down.weight": (["mlp.down_proj.weight"], []),
        "attn.qkv.weight": ([f"{n}.weight" for n in qkv], [q, kv, kv]),
        "mlp.gate_up.weight": (["mlp.gate_proj.weight", "mlp.up_proj.weight"], [hidden, hidden]),
    }
    if config.qkv_bias:
        names["attn.qkv.bias"] = ([f"{n}.bias" for n in qkv], [q, kv, kv])
    if config.qk_norm:
        names.update({f"attn.{n}.weight": ([f"self_attn.{n}.weight"], []) for n in ("q_norm", "k_norm")})
    return names


def _to_llama(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    out = {"model.embed_tokens.weight": state["token_emb.weight"], "model.norm.weight": state["norm_out.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    names = _llama_names(config)
    for i in range(config.num_layers):
        for mine, (theirs, sizes) in names.items():
            ours = state[f"blocks.{i}.{mine}"]
            out.update(zip((f"model.layers.{i}.{name}" for name in theirs), ours.split(sizes) if sizes else [ours]))
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf_llama(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A state dict of the family's transformers class in our Llama's names (the inverse of
    `to_hf_state_dict`). Raises KeyError naming the first missing Hugging Face weight."""
    state = {"token_emb.weight": hf_state["model.embed_tokens.weight"], "norm_out.weight": hf_state["model.norm.weight"]}
    state["lm_head.weight"] = state["token_emb.weight"] if config.tie_embeddings else hf_state["lm_head.weight"]
    names = _llama_names(config)
    for i in range(config.num_layers):
        for mine, (theirs, _) in names.items():
            state[f"blocks.{i}.{mine}"] = torch.cat([hf_state[f"model.layers.{i}.{name}"] for name in theirs])
    return state


def _to_gpt2(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    d, hidden = config.d_model, config.mlp_ratio * config.d_model

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=state["token_emb.weight"].dtype)

    out = {
        "transformer.wte.weight": state["token_emb.weight"], "transformer.wpe.weight": state["pos_emb.weight"],
        "transformer.ln_f.weight": state["norm_out.weight"], "transformer.ln_f.bias": state["norm_out.bias"],
    }
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.", f"transformer.h.{i}."
        out.update({
            theirs + "ln_1.weight": state[ours + "norm_attn.weight"], theirs + "ln_1.bias": state[ours + "norm_attn.bias"],
            theirs + "ln_2.weight": state[ours + "norm_mlp.weight"], theirs + "ln_2.bias": state[ours + "norm_mlp.bias"],
            # Conv1D keeps (in, out): our nn.Linear (out, in) transposed; our linears have no bias.
            theirs + "attn.c_attn.weight": state[ours + "attn.qkv.weight"].t(), theirs + "attn.c_attn.bias": zeros(3 * d),
            theirs + "attn.c_proj.weight": state[ours + "attn.proj.weight"].t(), theirs + "attn.c_proj.bias": zeros(d),
            theirs + "mlp.c_fc.weight": state[ours + "mlp.up.weight"].t(), theirs + "mlp.c_fc.bias": zeros(hidden),
            theirs + "mlp.c_proj.weight": state[ours + "mlp.down.weight"].t(), theirs + "mlp.c_proj.bias": zeros(d),
        })
    return {name: tensor.contiguous() for name, tensor in out.items()}


_METADATA = frozenset("""
    architectures model_type transformers_version torch_dtype dtype _name_or_path use_cache initializer_range
    bos_token_id eos_token_id pad_token_id pretraining_tp is_llama_config transformers.js_config max_window_layers
    output_attentions output_hidden_states return_dict torchscript use_bfloat16 tie_encoder_decoder is_decoder
    is_encoder_decoder add_cross_attention chunk_size_feed_forward id2label label2id problem_type tokenizer_class
    prefix sep_token_id decoder_start_token_id finetuning_task task_specific_params pruned_heads
""".split())
"""config.json fields that leave the weights' function alone: who wrote the file, generation and
tokenizer defaults, the initialisation (pretraining_tp only splits the same matmuls; max_window_layers
counts only with use_sliding_window, which is refused)."""
_ROPE_KEYS = {"default": set(), "linear": {"factor"},
              "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}}


_CHECKED = (
    ("hidden_act", "silu", "the MLP here is SwiGLU with SiLU"),
    ("attention_bias", False, "biases here are Qwen2's, on q/k/v only"),
    ("mlp_bias", False, "the MLP here has no biases"),
    ("attention_dropout", 0.0, "attention here has no dropout of its own"),
    ("use_sliding_window", False, "attention here is full causal"),
    ("layer_types", "full_attention", "attention here is full causal in every layer"),
    ("use_mrope", False, "rotary positions here are 1-D"),
    ("rope_interleaved", False, "rotary here pairs the two halves of each head"),
    ("partial_rotary_factor", 1.0, "rotary here turns the whole head"),
)
"""config.json fields that must hold the value our model computes alike (for a list: every entry)."""
_MAPPED = {"model_type", "hidden_size", "num_attention_heads", "vocab_size", "num_hidden_layers", "num_key_value_heads",
           "head_dim", "intermediate_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
           "sliding_window", "rope_theta", "rope_scaling", "rope_parameters"}


def model_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our model.* values that the config.json of a Llama-family model (model_type llama, mistral,
    qwen2, qwen3) fixes, every field read: mapped to one of ours (`_MAPPED`), checked to hold a value
    our model computes alike (`_CHECKED`), or one of `_METADATA`. Raises ValueError naming every
    field it cannot map."""
    family = hf.get("model_type")
    if family not in FAMILY_CLASSES:
        raise ValueError(f"model_type {family!r} is not one of the families read ({', '.join(FAMILY_CLASSES)})")
    problems = [
        f"{key} {hf[key]!r} ({why})" for key, wanted, why in _CHECKED
        if hf.get(key) is not None and hf[key] != wanted and not (isinstance(hf[key], list) and all(v == wanted for v in hf[key]))
        and not (key == "attention_bias" and family == "qwen2")  # Qwen2's q/k/v always have biases, whatever it says
    ]
    fields = _rope_fields(hf, problems)
    if "quantization_config" in hf:
        problems.append("quantization_config (the weights are quantized: start from the unquantized model)")
    unknown = sorted(set(hf) - _MAPPED - {key for key, _, _ in _CHECKED} - _METADATA - {"quantization_config"})
    problems += [f"{key} (a field this package does not map: remove it if it leaves the model as it is)" for key in unknown]
    if problems:
        raise ValueError("; ".join(problems))
    width, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return {
        "architecture": "llama", "family": family, "vocab_size": int(hf["vocab_size"]),
        "num_layers": int(hf["num_hidden_layers"]), "num_heads": heads, "num_kv_heads": int(hf.get("num_key_value_heads") or heads),
        "d_model": width, "head_dim": int(hf.get("head_dim") or width // heads), "mlp_hidden": int(hf["intermediate_size"]),
        "max_seq_len": int(hf["max_position_embeddings"]), "norm_eps": float(hf.get("rms_norm_eps") or 1e-6),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "qkv_bias": family == "qwen2",
        "qk_norm": family == "qwen3", **fields,
        # Qwen's sliding_window counts only with use_sliding_window, refused above.
        "sliding_window": int(hf.get("sliding_window") or 0) if family == "mistral" else 0,
    }


def _rope_fields(hf: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """model.rope_* from `rope_scaling` (published Llama 3.x files, with `rope_theta` beside it) or
    `rope_parameters` (transformers 5); transformers reads rope_scaling over rope_parameters."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = float(rope.pop("rope_theta", None) or hf.get("rope_theta") or 10000.0)
    kind = rope.pop("rope_type", None) or rope.pop("type", "default")
    rope.pop("type", None)
    if rope.pop("partial_rotary_factor", 1.0) != 1.0:
        problems.append("rope_parameters.partial_rotary_factor (rotary here turns the whole head)")
    if kind not in _ROPE_KEYS:
        problems.append(f"rope type {kind!r} (read: {', '.join(_ROPE_KEYS)})")
        return {}
    problems += [f"rope_parameters.{key} (not part of rope type {kind})" for key in sorted(set(rope) - _ROPE_KEYS[kind])]
    fields: dict[str, Any] = {"rope_theta": theta, "rope_scaling": "none" if kind == "default" else kind}
    if kind != "default":
        fields["rope_factor"] = float(rope.get("factor", 1.0))
    if kind == "llama3":
        fields.update(rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                      rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                      rope_original_max_seq_len=int(rope.get("original_max_position_embeddings") or hf["max_position_embeddings"]))
    return fields


def model_differences(config: ModelConfig, fields: dict[str, Any]) -> list[str]:
    """`model.<field>: run <ours>, checkpoint <theirs>` for each field the checkpoint fixes and the
    run's model differs in (derived values compared as derived: num_kv_heads 0 = num_heads,
    head_dim 0 = d_model / num_heads, mlp_hidden 0 = the hidden width Llama's rule gives)."""
    ours = {
        **{name: getattr(config, name) for name in fields},
        "num_kv_heads": kv_heads(config), "mlp_hidden": llama_mlp_hidden(config), "head_dim": head_size(config),
    }
    return [
        f"model.{name}: run {ours[name]!r}, checkpoint {value!r}"
        for name, value in fields.items()
        if (float(ours[name]) != float(value) if isinstance(value, float) else ours[name] != value)
    ]
