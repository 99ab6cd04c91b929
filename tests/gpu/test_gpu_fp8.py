"""engine.precision=fp8 on a GPU (skipped without CUDA, marker `gpu`; the GPU check runs it): training
steps run float8 matmuls in the blocks' linear layers, evaluation runs none, and the loss falls; a
GPU without FP8 tensor cores refuses it in one line. Each run is its own process with DeepSpeed's
CUDA accelerator, as in test_gpu_smoke.py."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.gpu.test_gpu_smoke import _gpu_env

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]
ROOT = Path(__file__).resolve().parents[2]

STEPS = textwrap.dedent("""
    import json, sys
    import torch
    from raytrain_fast.config import load_config
    from raytrain_fast.engine.process_group import single_process_group
    from raytrain_fast.engine.program import build_program, one_process, prepare_process

    precision, steps = sys.argv[1], 12
    config = one_process(load_config("llama-tiny", [
        "model.d_model=1024", "model.num_heads=8", "model.num_kv_heads=4", "model.mlp_hidden=4096", "model.num_layers=2",
        "model.vocab_size=512", "model.max_seq_len=512", "data.seq_len=512", f"engine.precision={precision}",
        "engine.compile=on", "optim.warmup_steps=2", "optim.lr=1e-3"]), micro_batch=4, grad_accum=1, steps=steps)
    device = prepare_process(threads=4, seed=0)
    single_process_group("nccl")
    lines = []
    engine = build_program(config, device=device, say=lines.append).engine
    text = open(sys.argv[2], "rb").read()  # this package's own source: bytes a model learns from in a few steps
    need = steps * 4 * 513
    text = text * -(-need // len(text))  # repeated: the file is shorter than the batches ask for
    rows = torch.tensor(list(text[:need]), dtype=torch.long).view(steps, 4, 513).to(device)

    def scaled_matmuls(run) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            run()
            torch.cuda.synchronize()
        return sum(e.count for e in profile.key_averages() if "scaled_mm" in e.key)

    losses = []
    def step(batch):
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())

    step(rows[0])  # compiles
    in_training = scaled_matmuls(lambda: step(rows[1]))
    for batch in rows[2:]:
        step(batch)
    engine.module.eval()
    with torch.no_grad():
        in_eval = scaled_matmuls(lambda: engine.module(rows[0][:, :-1]))
    print(json.dumps({"lines": lines, "losses": [float(l) for l in losses], "in_training": in_training, "in_eval": in_eval}))
    torch.distributed.destroy_process_group()
""")


def _run(precision: str) -> subprocess.CompletedProcess:
    source = ROOT / "raytrain_fast" / "model" / "gpt.py"
    return subprocess.run([sys.executable, "-c", STEPS, precision, str(source)], capture_output=True, text=True,
                          timeout=600, env=_gpu_env())


def _fp8_tensor_cores() -> bool:
    import torch

    return torch.cuda.get_device_capability() >= (8, 9)


def test_fp8_trains_in_float8_and_evaluates_in_bf16():
    """The loss against bf16's on the same data is the GPU check's fp8_8b stage, at the 8B width."""
    if not _fp8_tensor_cores():
        pytest.skip("needs FP8 tensor cores (compute capability 8.9+)")
    done = _run("fp8")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    fp8 = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(line.startswith("FP8: 4 linear layers of 2 blocks") for line in fp8["lines"]), fp8["lines"]  # qkv and gate_up of each
    assert fp8["in_training"] > 0 and fp8["in_eval"] == 0
    assert all(0 < loss < 12 for loss in fp8["losses"]) and fp8["losses"][-1] < fp8["losses"][0]


def test_a_gpu_without_fp8_tensor_cores_refuses_it_in_one_line():
    if _fp8_tensor_cores():
        pytest.skip("this GPU has FP8 tensor cores")
    done = _run("fp8")
    assert done.returncode != 0 and "has no FP8 tensor cores" in done.stderr and "use engine.precision=bf16" in done.stderr
