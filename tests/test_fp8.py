"""engine.precision=fp8 (engine/fp8.py): which linear layers compute in float8 (the blocks' layers that
float8 speeds up; the LM head, embeddings and norms never), that a converted model trains through the
float8 casts and evaluates exactly as the unconverted one, with the same parameter names (bf16
checkpoints), and the one-line refusal wherever it cannot run. The float8 matmuls themselves need a
GPU with FP8 tensor cores: tests/gpu/test_gpu_fp8.py, run by the GPU check."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torchao  # noqa: F401 - a test dependency: a missing install fails here, loudly

from raytrain_fast.config import load_config, validate
from raytrain_fast.engine import resolve_precision
from raytrain_fast.engine.fp8 import apply_fp8, convert_blocks, float8_speeds_up
from raytrain_fast.errors import ConfigError
from raytrain_fast.model import build_model

pytestmark = pytest.mark.unit

BLOCK_LAYERS = ("attn.qkv", "attn.proj", "mlp.gate_up", "mlp.down")


@pytest.mark.parametrize("preset, overrides, blocks", [("llama-1b", [], 16), ("llama-8b", ["model.num_layers=8"], 8)])
def test_at_the_1b_and_8b_widths_every_linear_layer_of_every_block_is_converted_and_the_lm_head_is_not(preset, overrides, blocks):
    config = load_config(preset, overrides)
    model = build_model(config.model, torch.device("meta"))  # the real shapes, no memory
    names = {n for n, _ in model.named_parameters()}
    converted = convert_blocks(model)
    assert sorted(converted) == sorted(f"blocks.{i}.{layer}" for i in range(blocks) for layer in BLOCK_LAYERS)
    assert type(model.lm_head) is torch.nn.Linear and type(model.token_emb) is torch.nn.Embedding
    assert {n for n, _ in model.named_parameters()} == names  # bf16 checkpoints: the same names


def test_layers_too_small_or_oddly_shaped_for_float8_stay_as_they_are():
    shapes = {(4096, 2048): True, (2048, 2048): True, (1024, 4096): False, (1024, 4112): True, (2048, 1000): False}
    for (out_features, in_features), converted in shapes.items():
        linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
        assert float8_speeds_up(linear) is converted, (out_features, in_features)


def _small_llama():
    config = load_config("llama-tiny", ["model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
                                        "model.mlp_hidden=2048", "model.num_layers=2"])
    torch.manual_seed(0)
    return build_model(config.model, torch.device("cpu")), config


def test_a_converted_model_trains_through_float8_casts_and_evaluates_exactly_as_before():
    """Emulated float8 (casts and scales as on a GPU, matmuls in high precision) on the CPU."""
    model, config = _small_llama()
    plain = copy.deepcopy(model)
    assert convert_blocks(model, emulate=True) == ["blocks.0.mlp.gate_up", "blocks.1.mlp.gate_up"]  # the one wide enough
    tokens = torch.randint(0, config.model.vocab_size, (2, 65), generator=torch.Generator().manual_seed(1))
    loss, reference = model(tokens[:, :-1], tokens[:, 1:]), plain(tokens[:, :-1], tokens[:, 1:])
    assert loss != reference and loss.item() == pytest.approx(reference.item(), rel=1e-2)  # float8's rounding, and only that
    loss.backward()
    assert model.blocks[0].mlp.gate_up.weight.grad is not None and torch.isfinite(model.blocks[0].mlp.gate_up.weight.grad).all()
    model.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), plain(tokens))  # evaluation: the weights' dtype, bit for bit


def test_fp8_is_refused_in_one_line_on_cpus_and_without_compiled_blocks():
    with pytest.raises(ConfigError) as refused:
        resolve_precision("fp8", use_gpu=False)
    assert len(refused.value.problems) == 1 and "use engine.precision=bf16" in str(refused.value)
    model, _ = _small_llama()
    with pytest.raises(ConfigError, match="needs a GPU with FP8 tensor cores"):
        apply_fp8(model, precision="fp8", device=torch.device("cpu"))
    assert type(model.blocks[0].mlp.gate_up) is torch.nn.Linear  # refused before anything changed
    assert apply_fp8(model, precision="bf16", device=torch.device("cpu")) is None
    config = load_config("llama-1b", ["engine.precision=fp8", "engine.compile=off"])
    with pytest.raises(ConfigError) as refused:
        validate(dataclasses.replace(config, resources=dataclasses.replace(config.resources, use_gpu="auto")), cluster_gpus=0)
    assert [p.split(" needs ")[1][:14] for p in refused.value.problems] == ["a GPU with FP8", "compiled block"]
