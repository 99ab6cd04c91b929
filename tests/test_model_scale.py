"""What real model sizes need, checked on the tiny shapes: activation checkpointing, the chunked
loss, cached rotary tables, the model built on its device, regional compile (and its eager
fallback), the CUDA-ready RNG states, precision kept on resume and the peak-memory reset.

Every feature is compared with the plain path on the same weights and data: the same loss and
gradients, and the same 20-step training curve."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch

from raytrain_fast.checkpoint.checkpointing import TrainState, rng_states, set_rng_states
from raytrain_fast.config import load_config
from raytrain_fast.engine.compile import compile_blocks, resolve_compile
from raytrain_fast.errors import CheckpointError
from raytrain_fast.launch.resume import keep_checkpoint_precision
from raytrain_fast.metrics.memory import peak_memory_gb, reset_peak_memory
from raytrain_fast.model import GPT, ModelConfig, build_model, chunked_cross_entropy

pytestmark = pytest.mark.unit

SMALL = ModelConfig(vocab_size=96, max_seq_len=32, num_layers=3, num_heads=2, d_model=32, positions="rotary")


def _variant(**changes) -> ModelConfig:
    return ModelConfig(**{**SMALL.__dict__, **changes})


def _loss_and_grads(model: GPT, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _train_curve(config: ModelConfig, *, steps: int = 20, seed: int = 0) -> list[float]:
    """Losses of `steps` AdamW steps of a model built from `seed`, on batches drawn from `seed`."""
    torch.manual_seed(seed)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, config.vocab_size, (4, 1), generator=data)  # learnable: each token + 1
        tokens = (starts + torch.arange(config.max_seq_len + 1)) % config.vocab_size
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# --------------------------------------------------------------------------- chunked loss


def test_chunked_loss_equals_the_plain_loss_and_gradients_in_fp32():
    torch.manual_seed(0)
    hidden = torch.randn(300, 32, requires_grad=True)
    weight = torch.randn(96, 32, requires_grad=True)
    targets = torch.randint(0, 96, (300,))
    plain = torch.nn.functional.cross_entropy(hidden @ weight.t(), targets)
    plain.backward()
    expected = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_rows=64)  # 5 chunks, the last one short
    (chunked * 3).backward()  # a scaled upstream gradient goes through
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-6)
    torch.testing.assert_close(hidden.grad, 3 * expected[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, 3 * expected[1], rtol=1e-5, atol=1e-7)


def test_chunked_loss_in_bf16_is_within_the_stated_tolerance_of_the_plain_bf16_loss():
    # Stated in docs/configuration.md: bf16 loss within 0.5%, gradients within 2% (relative norm).
    torch.manual_seed(0)
    hidden = torch.randn(512, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.1 * torch.randn(1000, 64)).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 1000, (512,))
    plain = torch.nn.functional.cross_entropy((hidden @ weight.t()).float(), targets)
    plain.backward()
    expected = hidden.grad.float().clone(), weight.grad.float().clone()
    hidden.grad = weight.grad = None
    chunked_cross_entropy(hidden, weight, targets, chunk_rows=128).backward()
    assert torch.linalg.vector_norm(hidden.grad.float() - expected[0]) / expected[0].norm() < 0.02
    assert torch.linalg.vector_norm(weight.grad.float() - expected[1]) / expected[1].norm() < 0.02
    with torch.no_grad():
        again = chunked_cross_entropy(hidden, weight, targets, chunk_rows=128)
    assert again.item() == pytest.approx(plain.item(), rel=5e-3)


def test_chunked_loss_is_on_from_a_large_vocabulary_and_never_holds_the_full_logits():
    assert GPT(_variant(vocab_size=8192)).chunked_loss and not GPT(SMALL).chunked_loss  # auto
    assert GPT(_variant(chunked_loss="on")).chunked_loss and not GPT(_variant(vocab_size=8192, chunked_loss="off")).chunked_loss
    # The largest tensor autograd keeps for backward: with the chunked loss no (B*T, V) logits.
    torch.manual_seed(0)
    model = GPT(_variant(vocab_size=4096, chunked_loss="on"))
    tokens = torch.randint(0, 4096, (4, 33))
    largest = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        largest.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens[:, :-1], tokens[:, 1:])
    assert max(largest) < 4 * 32 * 4096  # the plain path saves the (128, 4096) logits


# --------------------------------------------------------------------------- each feature keeps the result


@pytest.mark.e2e  # two 20-step training runs per case: 25-45 s each on the 2-core machine
@pytest.mark.parametrize("changes", [
    {"activation_checkpointing": "full"},
    {"activation_checkpointing": "every_n", "activation_checkpointing_n": 2},
    {"chunked_loss": "on"},
], ids=["ac-full", "ac-every-2", "chunked-loss"])
def test_a_feature_gives_the_same_loss_gradients_and_20_step_curve(changes):
    torch.manual_seed(0)
    plain = GPT(SMALL)
    featured = GPT(_variant(**changes))
    featured.load_state_dict(plain.state_dict())
    tokens = torch.randint(0, SMALL.vocab_size, (4, SMALL.max_seq_len + 1))
    loss, grads = _loss_and_grads(plain, tokens)
    loss_f, grads_f = _loss_and_grads(featured, tokens)
    assert loss_f == pytest.approx(loss, rel=1e-6)
    assert grads.keys() == grads_f.keys()
    for name in grads:
        torch.testing.assert_close(grads_f[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    curve, curve_f = _train_curve(SMALL), _train_curve(_variant(**changes))
    assert curve[-1] < 0.8 * curve[0]  # it trains
    assert curve_f == pytest.approx(curve, rel=1e-4)


def test_activation_checkpointing_recomputes_only_in_training_and_not_while_flops_are_counted():
    from raytrain_fast.model.flops import count_training_flops_per_token

    torch.manual_seed(0)
    plain, checkpointed = GPT(SMALL), GPT(_variant(activation_checkpointing="full"))
    tokens = torch.randint(0, SMALL.vocab_size, (2, SMALL.max_seq_len))
    # MFU counts useful work: the recomputed forward is not counted.
    assert count_training_flops_per_token(checkpointed, tokens) == count_training_flops_per_token(plain, tokens)
    assert checkpointed.checkpointing  # restored after counting
    forwards = []
    handle = checkpointed.blocks[0].register_forward_pre_hook(lambda *_: forwards.append(1))
    loss = checkpointed(tokens, tokens)
    loss.backward()
    assert len(forwards) == 2  # the block ran again in backward
    forwards.clear()
    checkpointed.eval()
    with torch.no_grad():
        checkpointed(tokens)
    handle.remove()
    assert len(forwards) == 1


# --------------------------------------------------------------------------- rotary, device, init


def test_rotary_tables_are_built_once_per_length_device_and_dtype():
    torch.manual_seed(0)
    model = GPT(SMALL)
    tokens = torch.randint(0, SMALL.vocab_size, (2, 16))
    model(tokens)
    model(tokens)
    assert list(model._rotary_cache) == [(16, torch.device("cpu"), torch.float32)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens[:, :8])
    assert len(model._rotary_cache) == 2  # another length: its own tables
    assert "_rotary_cache" not in str(model.state_dict().keys())  # not part of checkpoints


def test_build_model_makes_the_weights_on_the_device_with_the_same_init_statistics():
    config = _variant(d_model=128, num_layers=4, num_heads=4, vocab_size=2048, positions="learned")
    on_meta = build_model(config, "meta")  # no host memory at all: nothing is materialised on the CPU
    assert {p.device.type for p in on_meta.parameters()} == {"meta"}
    torch.manual_seed(0)
    reference = GPT(config)
    torch.manual_seed(1)
    built = build_model(config, "cpu")
    assert reference.state_dict().keys() == built.state_dict().keys()
    for (name, a), b in zip(reference.state_dict().items(), built.state_dict().values()):
        if a.numel() >= 4096:  # enough values for the statistics to be stable
            assert b.std().item() == pytest.approx(a.std().item(), rel=0.05), name
            assert abs(b.mean().item() - a.mean().item()) < 0.05 * a.std().item() + 1e-6, name


# --------------------------------------------------------------------------- compile


def test_compile_auto_is_on_for_cuda_and_off_on_cpus():
    assert resolve_compile("auto", torch.device("cuda"))[0] is True
    assert resolve_compile("auto", torch.device("cpu"))[0] is False
    assert resolve_compile("on", torch.device("cpu"))[0] is True
    assert resolve_compile("off", torch.device("cuda"))[0] is False
    model = GPT(SMALL)
    assert compile_blocks(model, setting="auto", device=torch.device("cpu")) == (False, None)  # nothing printed
    # YAML reads a bare on/off as a boolean: on/off settings take it as meant.
    config = load_config("tiny", ["engine.compile=on", "model.chunked_loss=off"])
    assert (config.engine.compile, config.model.chunked_loss) == ("on", "off")


@pytest.mark.e2e  # compiles in a fresh process: 25-30 s here
def test_compiled_blocks_keep_the_checkpoint_names_and_give_the_eager_results():
    """A checkpoint written with compile on loads with it off and the other way round: the compiled
    model's state_dict has the eager names, and the same weights give the same loss and gradients.
    Runs in a fresh process: compiling changes torch._dynamo settings process-wide."""
    script = textwrap.dedent("""
        import torch
        from raytrain_fast.engine.compile import compile_blocks
        from raytrain_fast.model import GPT, ModelConfig
        torch.set_num_threads(2)
        config = ModelConfig(vocab_size=96, max_seq_len=32, num_layers=2, num_heads=2, d_model=32, positions="rotary")
        torch.manual_seed(0)
        eager = GPT(config)
        compiled = GPT(config)
        compiled.load_state_dict(eager.state_dict())
        done, line = compile_blocks(compiled, setting="on", device=torch.device("cpu"))
        print(line)
        assert done, line
        assert list(compiled.state_dict()) == list(eager.state_dict())
        tokens = torch.randint(0, 96, (2, 33))
        results = []
        for model in (eager, compiled):
            loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            results.append((loss.detach(), [p.grad for p in model.parameters()]))
        torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
        for a, b in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)
        again = GPT(config)
        again.load_state_dict(compiled.state_dict())  # compiled -> eager
        print("OK")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Compile: on, 2 blocks compiled" in done.stdout and done.stdout.strip().endswith("OK")


@pytest.mark.e2e  # compiles in a fresh process: 25-30 s here
def test_a_compiler_that_does_not_work_falls_back_to_eager_with_one_line():
    # A real failure: inductor's C++ compiler is a path that does not exist (no cached kernels).
    script = textwrap.dedent("""
        import torch, torch._inductor.config as inductor
        inductor.cpp.cxx = ("/nonexistent/c++",)
        inductor.fx_graph_cache = False
        from raytrain_fast.engine.compile import compile_blocks
        from raytrain_fast.model import GPT, ModelConfig
        model = GPT(ModelConfig(vocab_size=96, max_seq_len=32, num_layers=2, num_heads=2, d_model=32))
        done, line = compile_blocks(model, setting="on", device=torch.device("cpu"))
        print(done)
        print(line)
        tokens = torch.randint(0, 96, (2, 9))
        model(tokens[:, :-1], tokens[:, 1:]).backward()  # trains eagerly
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    first, line = done.stdout.splitlines()[:2]
    assert first == "False"
    assert line.startswith("Compile: off, torch.compile does not work here (") and "training runs eager" in line


# --------------------------------------------------------------------------- RNG, precision, memory


def test_rng_states_round_trip_and_an_older_cpu_only_file_still_loads():
    states = rng_states("cpu")
    assert set(states) == {"cpu"}  # and "cuda" on a GPU
    expected = torch.rand(3)
    torch.rand(5)
    set_rng_states(states, "cpu")
    assert torch.equal(torch.rand(3), expected)
    old = torch.get_rng_state()  # what checkpoints held before: the CPU state alone
    expected = torch.rand(2)
    set_rng_states(old, "cpu")
    assert torch.equal(torch.rand(2), expected)


def _config(precision: str):
    return load_config("tiny", [f"engine.precision={precision}", "storage.uri=/tmp/unused"], name="kept")


def test_a_resumed_run_keeps_its_checkpoints_precision():
    saved = TrainState(step=40, precision="fp32")
    for asked in ("auto", "fp32"):  # set and kept: said too
        config, lines = keep_checkpoint_precision(_config(asked), saved)
        assert config.engine.precision == "fp32" and lines == ["Precision: fp32 (kept from the checkpoint at step 40)"]
    assert keep_checkpoint_precision(_config("auto"), None)[0].engine.precision == "auto"  # a new run measures
    with pytest.raises(CheckpointError, match=r"engine.precision=bf16, but run 'kept' was checkpointed in fp32 \(step 40\).*engine.precision=fp32"):
        keep_checkpoint_precision(_config("bf16"), saved)


def test_the_peak_memory_starts_over_after_setup():
    reset_peak_memory("cpu")
    before = peak_memory_gb("cpu")
    setup = torch.ones(160_000_000, dtype=torch.uint8)  # 0.16 GB touched, as setup's transients are
    del setup
    assert peak_memory_gb("cpu") > before + 0.12
    reset_peak_memory("cpu")  # what the loop and autobatch's probes do once set up
    assert peak_memory_gb("cpu") < before + 0.06


def test_the_same_weights_give_the_same_result_on_a_deepcopy_of_a_checkpointed_model():
    # Activation checkpointing is a training-time setting, not a weight format: a model trained
    # with it is the same module tree (used by export and init_from).
    model = GPT(_variant(activation_checkpointing="full"))
    assert list(copy.deepcopy(model).state_dict()) == list(GPT(SMALL).state_dict())


def test_the_chunked_loss_computes_no_gradients_when_none_are_wanted():
    # Evaluation runs under torch.no_grad: the loss alone, nothing kept for a backward pass.
    torch.manual_seed(0)
    hidden, weight = torch.randn(64, 16, requires_grad=True), torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (64,))
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss = chunked_cross_entropy(hidden, weight, targets, chunk_rows=16)
    assert loss.grad_fn is None
    assert counter.get_total_flops() == 2 * 64 * 16 * 50  # the logits' matmul only, no gradient matmuls
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(hidden @ weight.t(), targets).item(), rel=1e-6)
