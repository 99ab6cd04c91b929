"""What a training worker runs, built in one place: the process's device, threads, TF32 and seed
(`prepare_process`), then the model with its activation checkpointing, the compiled blocks and the
DeepSpeed engine at the config's precision (`build_program`). The step loop, `train.micro_batch:
auto`'s probe and the benches all build through it and step it with engine/step.py's `train_step`,
so each times and sizes the program that trains.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from raytrain_fast.config import Config
from raytrain_fast.config.train import Batch
from raytrain_fast.engine.compile import compile_blocks
from raytrain_fast.engine.deepspeed_engine import (
    build_engine,
    build_optimizer,
    enable_tf32,
    select_accelerator,
    training_device,
)
from raytrain_fast.engine.fp8 import apply_fp8
from raytrain_fast.engine.step import TorchEngine

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from raytrain_fast.model import GPT, DocumentMasking


@dataclass(kw_only=True)
class WorkerProgram:
    """The model and engine one worker trains with."""

    device: torch.device
    model: GPT
    compiled: bool
    """Whether the blocks are compiled (they compile in the first step: time it apart)."""
    compile_line: str | None
    """engine.compile's startup line (None when auto left it off)."""
    engine: DeepSpeedEngine | TorchEngine
    """DeepSpeed's engine, or plain PyTorch's for a bench's `bare` baseline (engine/step.py)."""


def prepare_process(*, threads: int, seed: int) -> torch.device:
    """This process set up as a training worker: DeepSpeed's accelerator chosen (before deepspeed is
    first imported), torch's threads (`threads` > 0: Ray starts workers with OMP_NUM_THREADS=1, so
    torch must be told how many cores it has), TF32 for fp32 matmuls on CUDA, the seeds. Returns
    the device it trains on."""
    select_accelerator()
    if threads > 0:
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    device = training_device()
    enable_tf32(device)
    torch.manual_seed(seed)
    random.seed(seed)
    return device


def eager_model(config: Config, *, device: torch.device, documents: DocumentMasking | None = None) -> GPT:
    """The model of `config.model` on `device`, its blocks not compiled yet: what the loop loads its
    initial weights into and measures before `build_program` takes it."""
    from raytrain_fast.model import build_model

    return build_model(config.model, device, documents=documents)  # weights made on the device: no host copy first


def build_program(
    config: Config, *, device: torch.device, model: GPT | None = None, batch: Batch | None = None,
    documents: DocumentMasking | None = None, engine: Literal["deepspeed", "torch"] = "deepspeed",
    masters: list | None = None, load_universal: bool = False, say: Callable[[str], None] | None = None,
) -> WorkerProgram:
    """The model of `config.model` (activation checkpointing included) on `device`, its blocks
    compiled as `engine.compile` says, then the DeepSpeed engine for `batch` (None: the config's own,
    `Config.batch()`) at `config.engine.precision` (resolved).

    `model`: the eager model when the caller built it already (`eager_model`: the loop measures it
    before its blocks compile). `masters`: the fp32 values the master weights start from (checkpoint/
    init_from.py `fp32_values`: a bf16 engine makes them from its bf16 copy otherwise). `engine="torch"`: torch's optimizer behind a `TorchEngine` instead of DeepSpeed (a
    bench's `bare` baseline). `say`: where the compile and DeepSpeed patch startup lines (and a
    patch's warning) go, as they happen; None: not said (a patch's warning is still printed)."""
    if model is None:
        model = eager_model(config, device=device, documents=documents)
    if (fp8_line := apply_fp8(model, precision=config.engine.precision, device=device)) and say is not None:
        say(fp8_line)  # engine/fp8.py: the blocks' linear layers in float8, converted before they are compiled
    compiled, compile_line = compile_blocks(model, setting=config.engine.compile, device=device)
    if compile_line and say is not None:
        say(compile_line)
    batch = batch or config.batch()
    if engine == "torch":
        optimizer = build_optimizer(list(model.parameters()), optim=config.optim, device=device)
        built = TorchEngine(model, optimizer, precision=config.engine.precision, grad_accum=batch.grad_accum,
                            grad_clip=config.optim.grad_clip)
    else:
        built = build_engine(
            model, engine=config.engine, optim=config.optim, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum,
            world_size=batch.world_size, total_steps=config.train.steps, load_universal=load_universal, say_line=say,
        )
        if masters:  # float8 conversion keeps each layer's Parameter, so they are still the engine's
            keep_as_master_weights(masters)
    return WorkerProgram(device=device, model=model, compiled=compiled, compile_line=compile_line, engine=built)


def keep_as_master_weights(values: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> None:
    """Each parameter's fp32 master weight (this rank's part of it: ZeRO partitions them) set to the
    kept value, on the engine built since (DeepSpeed's fragment mapping, `safe_set_full_fp32_param`)."""
    from deepspeed.utils import safe_set_full_fp32_param

    with torch.no_grad():
        for param, value in values:
            safe_set_full_fp32_param(param, value)


def one_process(config: Config, *, micro_batch: int, grad_accum: int, steps: int) -> Config:
    """`config` as a program of its own in one process runs it (a micro-batch probe, a bench
    variant): one worker at `micro_batch` x `grad_accum`, a schedule of `steps` steps."""
    train = replace(config.train, micro_batch=micro_batch, grad_accum=grad_accum, steps=steps)
    return replace(config, train=train, resources=replace(config.resources, num_workers=1, min_workers=None))
