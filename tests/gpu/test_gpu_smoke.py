"""GPU smoke tests: skipped without CUDA (marker `gpu`), meant to pass the first time a GPU appears.

Each runs in a fresh process with DeepSpeed's CUDA accelerator: the suite's conftest selects the
CPU accelerator for everything else (DS_ACCELERATOR=cpu), and DeepSpeed reads it once per process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.ray]


def _gpu_env() -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in ("DS_ACCELERATOR", "RAY_ADDRESS")}
    return {**env, "DS_ACCELERATOR": "cuda"}


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


ONE_STEP = textwrap.dedent("""
    import collections, json, sys
    import torch
    from raytrain_fast.engine.process_group import single_process_group
    from raytrain_fast.config import load_config
    from raytrain_fast.engine import build_engine
    from raytrain_fast.engine.deepspeed_engine import enable_tf32
    from raytrain_fast.engine.compile import compile_blocks
    from raytrain_fast.model import build_model

    config = load_config("gpt-124m", ["data.seq_len=256", "train.micro_batch=4", "engine.precision=bf16",
                                      "engine.compile=on", "model.activation_checkpointing=full"])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    enable_tf32(device)
    single_process_group("nccl")
    torch.manual_seed(0)
    model = build_model(config.model, device)
    compiled, line = compile_blocks(model, setting=config.engine.compile, device=device)
    engine = build_engine(model, engine=config.engine, optim=config.optim, micro_batch=4, grad_accum=1,
                          world_size=1, total_steps=10)
    tokens = torch.randint(0, config.model.vocab_size, (4, 257), device=device)

    def step():
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        return loss

    step()  # compiles
    reads = collections.Counter()
    for name in ("item", "tolist", "cpu", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)
        def counting(self, *args, _name=name, _original=original, **kwargs):
            caller = sys._getframe(1).f_code
            if not (caller.co_name == "_get_value" and caller.co_filename.endswith("optimizer.py")):
                reads[_name] += 1  # torch's host-side Adam step counters never wait for the device
            return _original(self, *args, **kwargs)
        setattr(torch.Tensor, name, counting)
    losses = [step() for _ in range(3)]
    torch.cuda.synchronize()
    reads_in_steps = dict(reads)
    print(json.dumps({"compiled": compiled, "line": line, "reads": reads_in_steps,
                      "losses": [float(l) for l in losses], "dtype": str(next(engine.module.parameters()).dtype),
                      "peak_gb": torch.cuda.max_memory_reserved(device) / 1e9}))
    torch.distributed.destroy_process_group()
""")


def test_one_gpt_124m_step_compiled_with_activation_checkpointing_in_bf16_reads_nothing_from_the_device():
    import json

    done = subprocess.run([sys.executable, "-c", ONE_STEP], capture_output=True, text=True, timeout=900, env=_gpu_env())
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["compiled"] is True, result["line"]
    assert result["dtype"] == "torch.bfloat16"
    assert result["reads"] == {}, result  # no host read inside a step: the GPU never waits on Python
    assert all(0 < loss < 12 for loss in result["losses"]), result


def test_two_gpu_zero2_steps_through_the_cli(tmp_path: Path):
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")
    storage = tmp_path / "runs"
    done = subprocess.run(
        [sys.executable, "-m", "raytrain_fast.cli", "pretrain", "--config", "tiny", "--storage", str(storage), "--name", "gpu2",
         "--set", "resources.num_workers=2", "--set", "resources.use_gpu=true", "--set", "engine.precision=bf16",
         "--set", "train.steps=4", "--set", "train.log_every=2", "--set", "checkpoint.every_steps=4"],
        capture_output=True, text=True, timeout=900, env=_gpu_env(),
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    shards = sorted(p.name for p in storage.glob("gpu2/checkpoint_00000004/deepspeed/*optim_states.pt"))
    assert shards == ["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
