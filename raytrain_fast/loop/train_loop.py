"""The per-worker step loop that Ray's TorchTrainer runs on every worker.

Hot path: `train_step` only. Every side concern (metrics, checkpoint) asks whether this step is
its step. The loss stays on the device; the host reads it only on log steps.
"""

from __future__ import annotations

import json
import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_fast.checkpoint import Checkpointer, TrainState
from raytrain_fast.checkpoint.checkpointing import load_initial_weights
from raytrain_fast.config import Config
from raytrain_fast.engine import build_engine, select_accelerator
from raytrain_fast.metrics import Progress
from raytrain_fast.model import GPT
from raytrain_fast.storage import redact


def train_step(engine: Any, data: Iterator[tuple[torch.Tensor, torch.Tensor]], *, grad_accum: int, loss_sum: torch.Tensor, on_batch=None) -> None:
    """One optimizer step: grad_accum micro-batches of forward + backward, then DeepSpeed's step.

    The detached loss is added to `loss_sum` on the device: no host sync here.
    """
    for _ in range(grad_accum):
        tokens, seq_ids = next(data)  # tokens: (B, T + 1)
        if on_batch is not None:
            on_batch(seq_ids)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()  # applies the optimizer only at the accumulation boundary
        loss_sum += loss.detach()


def _maybe_inject_failure(step: int, rank: int) -> None:
    """Fault injection for tests and drills: RAYTRAIN_FAST_FAIL_ONCE_AT="<step>:<marker file>[:<rank>[:kill]]"
    makes one worker raise (or, with `kill`, die by SIGKILL as on a lost node) when it completes
    <step>, once: the marker file records that it happened."""
    spec = os.environ.get("RAYTRAIN_FAST_FAIL_ONCE_AT")
    if not spec:
        return
    fail_step, marker, *rest = spec.split(":")
    fail_rank = int(rest[0]) if rest else 0
    if step == int(fail_step) and rank == fail_rank and not os.path.exists(marker):
        open(marker, "w").close()
        if rest[1:] == ["kill"]:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure at step {step} on rank {rank} (RAYTRAIN_FAST_FAIL_ONCE_AT)")


class _SequenceRecorder:
    """RAYTRAIN_FAST_RECORD_SEQUENCES=<dir>: append the sequence ids of every step to
    <dir>/rank<r>.jsonl (for tests that prove a resumed run sees exactly the same data)."""

    def __init__(self, rank: int) -> None:
        directory = os.environ.get("RAYTRAIN_FAST_RECORD_SEQUENCES")
        self.path = os.path.join(directory, f"rank{rank}.jsonl") if directory else None
        self._ids: list[int] = []

    def add(self, seq_ids: torch.Tensor) -> None:
        self._ids.extend(seq_ids.tolist())  # host read: only when recording is on (tests)

    def end_step(self, step: int) -> None:
        with open(self.path, "a") as out:  # type: ignore[arg-type]
            out.write(json.dumps({"step": step, "ids": self._ids}) + "\n")
        self._ids = []


def _agree(flag: bool) -> bool:
    """True on every rank if it is True on any rank (a tiny all-reduce; log steps only)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device="cuda" if torch.cuda.is_available() else "cpu")
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return bool(tensor.item())  # host sync: log steps only, and only with every_minutes set


def _setup_threads(cpus: int) -> None:
    # Ray starts actors with OMP_NUM_THREADS=1; torch must be told how many cores it may use.
    if cpus > 0:
        torch.set_num_threads(cpus)
        os.environ["OMP_NUM_THREADS"] = str(cpus)


def _device() -> torch.device:
    if torch.cuda.is_available():
        import ray.train.torch

        return ray.train.torch.get_device()
    return torch.device("cpu")


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    import ray.train

    from raytrain_fast.data import BatchIterator, DataPosition, load_manifest

    config = Config.from_dict(loop_config["config"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    _setup_threads(config.resources.cpus_per_worker)
    select_accelerator()
    torch.manual_seed(config.train.seed)
    random.seed(config.train.seed)
    train, grad_accum = config.train, config.grad_accum()

    # Restore first (state only), so the data reader starts at the saved position while the
    # engine is being built.
    checkpointer = Checkpointer(config.checkpoint, rank=rank, world_size=world_size, run_config=redact(config.to_dict()))
    restored = checkpointer.restore_state()
    state = restored or TrainState(world_size=world_size, zero_stage=config.engine.zero_stage, precision=config.engine.precision)
    if rank == 0 and restored:
        print(f"Resumed from checkpoint at step {state.step} ({state.tokens:,} tokens seen).", flush=True)
    if state.step >= train.steps:
        checkpointer.discard()
        if rank == 0:
            print(
                f"Run '{config.name}' already reached train.steps={train.steps} (checkpoint at step {state.step}); "
                f"nothing to do. To train further: --set train.steps={train.steps * 2}",
                flush=True,
            )
        return

    data = BatchIterator(
        load_manifest(loop_config["data_uri"], config.storage),
        rank=rank, world_size=world_size, micro_batch=train.micro_batch, seed=config.data.shuffle_seed,
        prefetch_batches=config.data.prefetch_batches, device=_device(), storage=config.storage,
        position=DataPosition.from_dict(state.data_position) if state.data_position else None,
        max_sequences=loop_config.get("max_sequences"),
    )
    model = GPT(config.model)
    if restored is None and config.checkpoint.init_from:
        source = load_initial_weights(model, config.checkpoint.init_from, storage=config.storage)
        if rank == 0:
            print(f"New run initialised from {config.checkpoint.init_from} ({source}).", flush=True)
    engine = build_engine(
        model, engine=config.engine, optim=config.optim, micro_batch=train.micro_batch,
        grad_accum=grad_accum, world_size=world_size, total_steps=train.steps,
    )
    if restored is not None:
        checkpointer.load_into(engine)

    tokens_per_step = train.micro_batch * grad_accum * world_size * config.data.seq_len
    progress = Progress(total_steps=train.steps, start_step=state.step, tokens_per_step=tokens_per_step, enabled=rank == 0)
    recorder = _SequenceRecorder(rank)
    loss_sum = torch.zeros((), device=engine.device)
    last: dict[str, float] = {}
    window_start = start_step = state.step

    try:
        while state.step < train.steps:
            train_step(engine, data, grad_accum=grad_accum, loss_sum=loss_sum, on_batch=recorder.add if recorder.path else None)
            state.step += 1
            state.tokens += tokens_per_step
            if recorder.path:
                recorder.end_step(state.step)
            _maybe_inject_failure(state.step, rank)

            is_log_step = state.step % train.log_every == 0 or state.step == train.steps
            if is_log_step:
                torch.distributed.all_reduce(loss_sum)  # mean over ranks, log steps only
                mean_loss = loss_sum.item() / (world_size * grad_accum * (state.step - window_start))  # host sync
                loss_sum.zero_()
                window_start = state.step
                last = progress.log(step=state.step, loss=mean_loss, lr=engine.get_lr()[0])

            if checkpointer.due_by_steps(state.step, train.steps) or (
                is_log_step and config.checkpoint.every_minutes > 0 and _agree(checkpointer.due_by_time())
            ):
                state.data_position = data.position.to_dict()
                checkpointer.save(engine, state, metrics={"step": state.step, "tokens": state.tokens, "start_step": start_step, **last})
                progress.restart_clock(state.step)
        checkpointer.wait_for_upload()
    finally:
        data.close()
