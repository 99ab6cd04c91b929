"""The loops of `raytrain-fast bench overhead` outside Ray, each in a fresh subprocess: `bare` (the
plain PyTorch loop, the ceiling) and `bare_deepspeed` (the same through our DeepSpeed engine)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from raytrain_fast.bench.overhead_setup import OverheadSetup, measurement, run_config, token_batches


def set_threads(setup: OverheadSetup, device: Any) -> None:
    import torch

    if device.type == "cpu":
        torch.set_num_threads(setup.threads)
        os.environ["OMP_NUM_THREADS"] = str(setup.threads)


def build_bare(setup: OverheadSetup, device: Any):
    """Model and AdamW (the run's model and optim config, as training builds them), in-memory
    batches and the autocast context."""
    import torch

    from raytrain_fast.engine import build_optimizer
    from raytrain_fast.model import build_model

    config = run_config(setup)
    torch.manual_seed(setup.seed)
    model = build_model(config.model, device)
    optimizer = build_optimizer(list(model.parameters()), optim=config.optim, device=device)
    if setup.precision == "bf16":
        autocast: Callable[[], Any] = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    return model, optimizer, token_batches(setup.micro_batch, setup.seq_len, setup.seed, device), autocast


def timed_steps(setup: OverheadSetup, step: Callable[[int], Any], device: Any) -> tuple[float, int, dict[str, Any]]:
    """(seconds from the end of warm-up to the end of the last step, torch threads in use, the
    process's /proc counters over those steps: bench/proc_counters.py)."""
    import torch

    from raytrain_fast.bench import proc_counters

    for i in range(setup.warmup_steps):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    threads = torch.get_num_threads()
    counters = proc_counters.snapshot()
    start = time.perf_counter()
    loss = None
    for i in range(setup.steps):
        loss = step(setup.warmup_steps + i)
    float(loss.detach())  # one host sync at the end: the clock stops when the device is done
    seconds = time.perf_counter() - start
    return seconds, threads, proc_counters.window(counters, proc_counters.snapshot(), steps=setup.steps)


def bare(setup: OverheadSetup) -> dict[str, Any]:
    """The plain loop, in this process (the bench runs it in a fresh one: `in_fresh_process`)."""
    import torch

    from raytrain_fast.engine import training_device

    setup = setup.resolved()
    device = training_device()
    set_threads(setup, device)
    model, optimizer, batches, autocast = build_bare(setup, device)

    def step(i: int) -> torch.Tensor:
        tokens = batches[i % batches.shape[0]]
        with autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    seconds, threads, proc = timed_steps(setup, step, device)
    return measurement(setup, seconds=seconds, precision=setup.precision, threads=threads, niceness=os.nice(0), proc=proc)


def bare_deepspeed(setup: OverheadSetup) -> dict[str, Any]:
    """The bare loop through the training worker's program (`engine.program.build_program` on the
    run's config: its model and DeepSpeed engine), no Ray. Makes a process group: call it in a fresh
    process (`in_fresh_process`)."""
    import torch
    import torch.distributed as dist

    from raytrain_fast.engine import select_accelerator, training_device
    from raytrain_fast.engine.process_group import single_process_group
    from raytrain_fast.engine.program import build_program

    setup = setup.resolved()
    select_accelerator()
    device = training_device()
    set_threads(setup, device)
    single_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        torch.manual_seed(setup.seed)
        engine = build_program(run_config(setup), device=device).engine
        batches = token_batches(setup.micro_batch, setup.seq_len, setup.seed, device)

        def step(i: int) -> torch.Tensor:
            tokens = batches[i % batches.shape[0]]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss

        seconds, threads, proc = timed_steps(setup, step, device)
        precision = "bf16" if engine.bfloat16_enabled() else "fp32"
    finally:
        dist.destroy_process_group()
    return measurement(setup, seconds=seconds, precision=precision, threads=threads, niceness=os.nice(0), proc=proc)


IN_PROCESS_VARIANTS = {"bare": bare, "bare_deepspeed": bare_deepspeed}


def in_fresh_process(variant: str, setup: OverheadSetup, *, timeout_s: float = 1800) -> dict[str, Any]:
    """Run `bare` or `bare_deepspeed` in a new Python process (DeepSpeed and process groups are
    per process; no state of an earlier variant carries over)."""
    setup = setup.resolved()
    with tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-") as scratch:
        out = os.path.join(scratch, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads)}
        code = "from raytrain_fast.bench.bare_loops import process_main; process_main()"
        done = subprocess.run(
            [sys.executable, "-c", code, variant, json.dumps(dataclasses.asdict(setup)), out],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False,
        )
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench variant {variant} failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
        with open(out) as stream:
            return json.load(stream)


def process_main() -> None:
    variant, setup_json, out = sys.argv[1:4]
    result = IN_PROCESS_VARIANTS[variant](OverheadSetup(**json.loads(setup_json)))
    with open(out, "w") as stream:
        json.dump(result, stream)
