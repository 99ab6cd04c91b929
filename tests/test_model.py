"""The GPT and its FLOPs formula."""

from __future__ import annotations

import pytest
import torch

from raytrain_fast.model import GPT, ModelConfig, flops_per_token
from raytrain_fast.model.flops import count_training_flops_per_token

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("positions", ["learned", "rotary"])
def test_flops_formula_matches_flop_counter_within_5_percent(positions):
    config = ModelConfig(positions=positions)  # the tiny preset's shape
    model = GPT(config)
    tokens = torch.randint(0, 257, (2, 128))
    counted = count_training_flops_per_token(model, tokens)
    formula = flops_per_token(config, 128)
    assert abs(counted - formula) / formula < 0.05, (counted, formula)
    assert all(p.grad is None for p in model.parameters())


def test_cpu_attention_is_counted():
    # Without our registration FlopCounterMode misses the CPU SDPA kernels; attention grows with T^2.
    model = GPT(ModelConfig(num_layers=1, max_seq_len=512))
    short = count_training_flops_per_token(model, torch.randint(0, 257, (1, 64)))
    long = count_training_flops_per_token(model, torch.randint(0, 257, (1, 512)))
    assert long - short == pytest.approx(14 * 1 * 128 * (512 - 64), rel=0.01)


def test_forward_shapes_loss_and_tied_weights():
    config = ModelConfig(num_layers=2, d_model=64, num_heads=4, positions="rotary")
    model = GPT(config)
    tokens = torch.randint(0, 257, (3, 16))
    assert model(tokens).shape == (3, 16, config.vocab_size)
    loss = model(tokens, torch.randint(0, 257, (3, 16)))
    # At init the prediction is close to uniform over the vocabulary: loss ~ ln(V).
    assert loss.ndim == 0 and loss.item() == pytest.approx(torch.log(torch.tensor(320.0)).item(), rel=0.1)
    assert model.lm_head.weight is model.token_emb.weight
    untied = GPT(ModelConfig(num_layers=2, d_model=64, num_heads=4, tie_embeddings=False))
    assert untied.num_params() - model.num_params() == 320 * 64 + 128 * 64  # its own head + a position table

def test_attention_is_causal():
    model = GPT(ModelConfig(num_layers=2, d_model=64, num_heads=4)).eval()
    tokens = torch.randint(0, 257, (1, 32))
    changed = tokens.clone()
    changed[0, 20:] = (changed[0, 20:] + 1) % 257
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[0, :20], b[0, :20])
    assert not torch.allclose(a[0, 20:], b[0, 20:])
