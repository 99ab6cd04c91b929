"""Our models in Hugging Face `transformers` terms: config.json fields and weight names, both ways.

Pure dictionaries and tensors, no `transformers` import: the export (checkpoint/hf_export.py) and
`checkpoint.init_from` of a Hugging Face directory (checkpoint/hf_import.py) use them.

- llama <-> LlamaForCausalLM: our fused q|k|v and gate|up matrices are split into (joined from)
  q_proj, k_proj, v_proj and gate_proj, up_proj; the rest are renames. Exact: the same numerics
  (model/llama.py) give the same logits.
- GPT with learned positions -> GPT2LMHeadModel: GPT-2's Conv1D stores weights as (in, out), so each
  linear is transposed; GPT-2 has biases where we have none, written as zeros (exact). The GPT with
  rotary positions has no GPT-2 counterpart and is refused (see `hf_refusal`).
"""

from __future__ import annotations

from typing import Any

import torch

from raytrain_fast.config.model import ModelConfig, kv_heads, llama_mlp_hidden

_LLAMA_BLOCK = {  # ours (after blocks.<i>.) -> theirs (after model.layers.<i>.), the unfused ones
    "norm_attn.weight": "input_layernorm.weight",
    "attn.proj.weight": "self_attn.o_proj.weight",
    "norm_mlp.weight": "post_attention_layernorm.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def hf_refusal(config: ModelConfig) -> str | None:
    """Why `config` cannot be exported in the Hugging Face format, or None when it can."""
    if config.architecture == "gpt" and config.positions != "learned":
        return (
            "a GPT with model.positions=rotary has no Hugging Face counterpart (GPT-2 has learned positions, and "
            "our rotary layout is not Llama's): export it with --format native, or train with "
            "model.architecture=llama (e.g. --config llama-tiny), which exports as LlamaForCausalLM"
        )
    return None


def hf_config(config: ModelConfig, *, eos_token_id: int | None, dtype: str) -> dict[str, Any]:
    """config.json of the Hugging Face model class that holds `config`'s weights (every field
    LlamaForCausalLM / GPT2LMHeadModel read, so nothing falls back to a class default)."""
    if config.architecture == "llama":
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": config.vocab_size, "hidden_size": config.d_model,
            "intermediate_size": llama_mlp_hidden(config), "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": kv_heads(config),
            "head_dim": config.d_model // config.num_heads, "hidden_act": "silu",
            "max_position_embeddings": config.max_seq_len, "initializer_range": config.init_std,
            "rms_norm_eps": config.norm_eps, "use_cache": True, "pretraining_tp": 1,
            # pad = the end-of-document token, as the exported tokenizer's pad_token (the mask hides it).
            "bos_token_id": None, "eos_token_id": eos_token_id, "pad_token_id": eos_token_id,
            "tie_word_embeddings": config.tie_embeddings,
            # transformers >= 5 reads rope_parameters; older readers (and vLLM's) rope_theta.
            "rope_theta": float(config.rope_theta),
            "rope_parameters": {"rope_type": "default", "rope_theta": float(config.rope_theta)},
            "rope_scaling": None, "attention_bias": False, "attention_dropout": config.dropout,
            "mlp_bias": False, "torch_dtype": dtype, "dtype": dtype,
        }
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


def _to_llama(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    kv_width = kv_heads(config) * (config.d_model // config.num_heads)
    hidden = llama_mlp_hidden(config)
    out = {"model.embed_tokens.weight": state["token_emb.weight"], "model.norm.weight": state["norm_out.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.qkv.weight"].split((config.d_model, kv_width, kv_width))
        gate, up = state[ours + "mlp.gate_up.weight"].split(hidden)
        out.update({
            theirs + "self_attn.q_proj.weight": q, theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v, theirs + "mlp.gate_proj.weight": gate, theirs + "mlp.up_proj.weight": up,
        })
        out.update({theirs + name: state[ours + mine] for mine, name in _LLAMA_BLOCK.items()})
    return {name: tensor.contiguous() for name, tensor in out.items()}


def from_hf_llama(hf_state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict in our Llama's names (the inverse of `to_hf_state_dict`).
    Raises KeyError naming the first missing Hugging Face weight."""
    state = {"token_emb.weight": hf_state["model.embed_tokens.weight"], "norm_out.weight": hf_state["model.norm.weight"]}
    state["lm_head.weight"] = state["token_emb.weight"] if config.tie_embeddings else hf_state["lm_head.weight"]
    for i in range(config.num_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        attn = [hf_state[f"{theirs}self_attn.{p}_proj.weight"] for p in ("q", "k", "v")]
        state[ours + "attn.qkv.weight"] = torch.cat(attn)
        state[ours + "mlp.gate_up.weight"] = torch.cat([hf_state[f"{theirs}mlp.{p}_proj.weight"] for p in ("gate", "up")])
        state.update({ours + mine: hf_state[theirs + name] for mine, name in _LLAMA_BLOCK.items()})
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


def model_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """Our model.* values that a Llama-family config.json fixes (for `checkpoint.init_from`), or
    raises ValueError saying why the config is not one we can load."""
    # qwen2 is left out: its q/k/v projections always have biases, which our llama does not.
    if hf.get("model_type") not in ("llama", "mistral") or hf.get("attention_bias") or hf.get("mlp_bias"):
        raise ValueError(
            f"model_type '{hf.get('model_type')}'"
            + (" with biases" if hf.get("attention_bias") or hf.get("mlp_bias") else "")
            + " is not a Llama-family model without biases (model_type llama or mistral, no attention or MLP biases)"
        )
    if hf.get("sliding_window"):
        raise ValueError(f"sliding_window {hf['sliding_window']}: our attention is full causal attention")
    if hf.get("hidden_act", "silu") != "silu" or (hf.get("rope_scaling") or {}).get("rope_type", "default") != "default":
        raise ValueError("only hidden_act silu and plain rotary (no rope_scaling) are supported")
    width, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    if int(hf.get("head_dim") or width // heads) * heads != width:
        raise ValueError(f"head_dim {hf.get('head_dim')} x {heads} heads != hidden_size {width}")
    rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    return {
        "architecture": "llama", "vocab_size": int(hf["vocab_size"]), "num_layers": int(hf["num_hidden_layers"]),
        "num_heads": heads, "num_kv_heads": int(hf.get("num_key_value_heads") or heads), "d_model": width,
        "mlp_hidden": int(hf["intermediate_size"]), "rope_theta": float(rope),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)), "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }


def model_differences(config: ModelConfig, fields: dict[str, Any]) -> list[str]:
    """`model.<field>: run <ours>, checkpoint <theirs>` for each field the checkpoint fixes and the
    run's model differs in (derived values compared as derived: num_kv_heads 0 = num_heads, and
    mlp_hidden 0 = the hidden width Llama's rule gives)."""
    ours = {
        **{name: getattr(config, name) for name in fields},
        "num_kv_heads": kv_heads(config), "mlp_hidden": llama_mlp_hidden(config),
    }
    return [
        f"model.{name}: run {ours[name]!r}, checkpoint {value!r}"
        for name, value in fields.items()
        if (float(ours[name]) != float(value) if isinstance(value, float) else ours[name] != value)
    ]
