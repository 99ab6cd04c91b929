"""The loops of `raytrain-fast bench overhead` outside Ray, each in a fresh subprocess: `bare` (the
plain PyTorch loop, the ceiling) and `bare_deepspeed` (the same through our DeepSpeed engine)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from raytrain_fast.bench.overhead_setup import OverheadSetup, measurement, run_config, token_batches

if TYPE_CHECKING:
    from raytrain_fast.engine.step import TorchEngine


def build_bare(setup: OverheadSetup, device: Any) -> tuple[TorchEngine, Any]:
    """The plain PyTorch engine (engine/step.py: the run's model and optim config as training builds
    them, autocast, clipping) and the in-memory batches. Call it right after `prepare_process`
    (engine/program.py), which seeds the weights alike in every variant."""
    from raytrain_fast.engine import build_optimizer
    from raytrain_fast.engine.step import TorchEngine
    from raytrain_fast.model import build_model

    config = run_config(setup)
    model = build_model(config.model, device)
    optimizer = build_optimizer(list(model.parameters()), optim=config.optim, device=device)
    engine = TorchEngine(model, optimizer, precision=setup.precision, grad_clip=setup.grad_clip)
    return engine, token_batches(setup.micro_batch, setup.seq_len, setup.seed, device)


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


def _timed_train_steps(setup: OverheadSetup, engine: Any, batches: Any, device: Any) -> tuple[float, int, dict[str, Any]]:
    """`timed_steps` of the one training step (engine/step.py) over the in-memory batches, without
    the loop's metrics: the baseline's step."""
    from raytrain_fast.engine.step import train_step

    cycled = itertools.cycle([(tokens, None) for tokens in batches])
    return timed_steps(setup, lambda i: train_step(engine, cycled, grad_accum=1), device)


def bare(setup: OverheadSetup) -> dict[str, Any]:
    """The plain loop, in this process (the bench runs it in a fresh one: `in_fresh_process`)."""
    from raytrain_fast.engine.program import prepare_process

    setup = setup.resolved()
    device = prepare_process(threads=setup.threads, seed=setup.seed)  # as a training worker
    engine, batches = build_bare(setup, device)
    seconds, threads, proc = _timed_train_steps(setup, engine, batches, device)
    return measurement(setup, seconds=seconds, precision=setup.precision, threads=threads, niceness=os.nice(0), proc=proc)


def bare_deepspeed(setup: OverheadSetup) -> dict[str, Any]:
    """The bare loop through the training worker's program (`engine.program.build_program` on the
    run's config: its model and DeepSpeed engine), no Ray. Makes a process group: call it in a fresh
    process (`in_fresh_process`)."""
    import torch.distributed as dist

    from raytrain_fast.engine.process_group import single_process_group
    from raytrain_fast.engine.program import build_program, prepare_process

    setup = setup.resolved()
    device = prepare_process(threads=setup.threads, seed=setup.seed)  # as a training worker
    single_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        engine = build_program(run_config(setup), device=device).engine
        batches = token_batches(setup.micro_batch, setup.seq_len, setup.seed, device)
        seconds, threads, proc = _timed_train_steps(setup, engine, batches, device)
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
