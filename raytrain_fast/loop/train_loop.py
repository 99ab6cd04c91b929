"""The per-worker step loop that Ray's TorchTrainer runs on every worker.

Hot path: `train_step` only. Every side concern (progress/metrics, checkpoint) asks whether this
step is its step. The loss stays on the device; the host reads it only on log steps.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_fast.checkpoint import TrainState, restore_checkpoint, save_checkpoint
from raytrain_fast.config import Config
from raytrain_fast.data import batches
from raytrain_fast.engine import build_engine, select_accelerator
from raytrain_fast.metrics import Progress
from raytrain_fast.model import GPT


def train_step(engine: Any, data: Iterator[torch.Tensor], *, grad_accum: int, loss_sum: torch.Tensor) -> None:
    """One optimizer step: grad_accum micro-batches of forward + backward, then DeepSpeed's step.

    The detached loss is added to `loss_sum` on the device: no host sync here.
    """
    for _ in range(grad_accum):
        tokens = next(data)  # (B, T + 1)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()  # applies the optimizer only at the accumulation boundary
        loss_sum += loss.detach()


def _maybe_inject_failure(step: int, rank: int) -> None:
    """Fault injection for tests and drills: RAYTRAIN_FAST_FAIL_ONCE_AT="<step>:<marker file>[:<rank>]"
    makes one worker raise when it completes <step>, once (the marker file records that it happened)."""
    spec = os.environ.get("RAYTRAIN_FAST_FAIL_ONCE_AT")
    if not spec:
        return
    fail_step, marker, *fail_rank = spec.split(":")
    if step == int(fail_step) and rank == int(fail_rank[0] if fail_rank else 0) and not os.path.exists(marker):
        open(marker, "w").close()
        raise RuntimeError(f"injected failure at step {step} on rank {rank} (RAYTRAIN_FAST_FAIL_ONCE_AT)")


def _setup_threads(cpus: int) -> None:
    # Ray starts actors with OMP_NUM_THREADS=1; torch must be told how many cores it may use.
    if cpus > 0:
        torch.set_num_threads(cpus)
        os.environ["OMP_NUM_THREADS"] = str(cpus)


def train_loop_per_worker(config_dict: dict[str, Any]) -> None:
    import ray.train

    config = Config.from_dict(config_dict)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    _setup_threads(config.resources.cpus_per_worker)
    select_accelerator()
    torch.manual_seed(config.train.seed)
    random.seed(config.train.seed)

    train, grad_accum = config.train, config.grad_accum()
    engine = build_engine(
        GPT(config.model),
        engine=config.engine,
        optim=config.optim,
        micro_batch=train.micro_batch,
        grad_accum=grad_accum,
        world_size=world_size,
        total_steps=train.steps,
    )
    state = restore_checkpoint(engine, world_size=world_size) or TrainState(
        world_size=world_size, zero_stage=config.engine.zero_stage, precision=config.engine.precision
    )
    if rank == 0 and state.step:
        print(f"Resumed from checkpoint at step {state.step} ({state.tokens:,} tokens seen).", flush=True)
    if state.step >= train.steps:
        if rank == 0:
            print(
                f"Run '{config.name}' already reached train.steps={train.steps} (checkpoint at step {state.step}); "
                f"nothing to do. To train further: --set train.steps={train.steps * 2}",
                flush=True,
            )
        return

    data = batches(
        ray.train.get_dataset_shard("train"),
        micro_batch=train.micro_batch,
        prefetch_batches=config.data.prefetch_batches,
        device=engine.device,
    )
    tokens_per_step = train.micro_batch * grad_accum * world_size * config.data.seq_len
    progress = Progress(total_steps=train.steps, start_step=state.step, tokens_per_step=tokens_per_step, enabled=rank == 0)
    loss_sum = torch.zeros((), device=engine.device)
    last: dict[str, float] = {}
    window_start = start_step = state.step

    while state.step < train.steps:
        train_step(engine, data, grad_accum=grad_accum, loss_sum=loss_sum)
        state.step += 1
        state.tokens += tokens_per_step
        _maybe_inject_failure(state.step, rank)

        if state.step % train.log_every == 0 or state.step == train.steps:
            torch.distributed.all_reduce(loss_sum)  # mean over ranks, log steps only
            mean_loss = loss_sum.item() / (world_size * grad_accum * (state.step - window_start))  # host sync
            loss_sum.zero_()
            window_start = state.step
            last = progress.log(step=state.step, loss=mean_loss, lr=engine.get_lr()[0])

        if state.step % config.checkpoint.every_steps == 0 or state.step == train.steps:
            save_checkpoint(engine, state, metrics={"step": state.step, "tokens": state.tokens, "start_step": start_step, **last}, rank=rank)
            progress.restart_clock(state.step)
