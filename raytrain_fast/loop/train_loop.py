"""The per-worker step loop that Ray's TorchTrainer runs on every worker.

Hot path: `train_step` only. Every side concern (metrics, checkpoint) asks whether this step is
its step. The loss stays on the device; the host reads it only on log steps.
"""

from __future__ import annotations

import json
import os
import tempfile
import random
import signal
from collections.abc import Iterator
from typing import Any

import torch

from raytrain_fast.checkpoint import Checkpointer, TrainState
from raytrain_fast.checkpoint.checkpointing import load_initial_weights
from raytrain_fast.config import Config
from raytrain_fast.engine import build_engine, select_accelerator, training_device
from raytrain_fast.coordinator import Coordinator
from raytrain_fast.metrics import TrainMetrics, build_sinks, mfu_inputs
from raytrain_fast.loop.drills import slow_data, slow_sinks, slow_step, slow_upload_s
from raytrain_fast.model import GPT
from raytrain_fast.storage import redact
from raytrain_fast.storage.filesystem import resolve_filesystem, use_shipped_s3_filesystem


# Bit flags agreed across ranks on log steps (see TrainMetrics.log).
_TIME_DUE = 1  # this rank's checkpoint.every_minutes timer is due
_STOP = 2  # the driver got a stop notice (SIGTERM / Ctrl-C): save now and stop


def train_step(engine: Any, data: Iterator[tuple[torch.Tensor, torch.Tensor]], metrics: TrainMetrics, *, grad_accum: int, on_batch=None) -> None:
    """One optimizer step: grad_accum micro-batches of forward + backward, then DeepSpeed's step.

    The detached loss and grad norm go into on-device accumulators: no host sync here.
    """
    metrics.begin_step()
    for _ in range(grad_accum):
        tokens, seq_ids = next(data)  # tokens: (B, T + 1)
        metrics.lap("data")
        if on_batch is not None:
            on_batch(seq_ids)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        metrics.lap("forward")
        engine.backward(loss)
        metrics.lap("backward")
        engine.step()  # applies the optimizer only at the accumulation boundary
        metrics.lap("optimizer")
        metrics.add_loss(loss)
    metrics.add_grad_norm(engine.get_global_grad_norm())


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


def _setup_threads(cpus: int) -> None:
    # Ray starts actors with OMP_NUM_THREADS=1; torch must be told how many cores it may use.
    if cpus > 0:
        torch.set_num_threads(cpus)
        os.environ["OMP_NUM_THREADS"] = str(cpus)


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    import ray.train

    from raytrain_fast.data import BatchIterator, DataPosition, load_manifest

    config = Config.from_dict(loop_config["config"])
    if loop_config.get("s3_filesystem") is not None:
        use_shipped_s3_filesystem(config.storage, loop_config["s3_filesystem"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    _setup_threads(config.resources.cpus_per_worker)
    select_accelerator()
    torch.manual_seed(config.train.seed)
    random.seed(config.train.seed)
    train, grad_accum = config.train, config.grad_accum()

    # Restore first (state only), so the data reader starts at the saved position while the
    # engine is being built.
    filesystem, storage_root = resolve_filesystem(config.storage.uri, config.storage)
    checkpointer = Checkpointer(
        config.checkpoint, rank=rank, world_size=world_size, run_config=redact(config.to_dict()),
        local_mode_run=(filesystem, f"{storage_root.rstrip('/')}/{config.name}"),
        upload_delay_s=slow_upload_s(rank),  # drill hook: 0 unless RAYTRAIN_FAST_DRILL_SLOW_UPLOAD is set
    )
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
        prefetch_batches=config.data.prefetch_batches, device=training_device(), storage=config.storage,
        position=DataPosition.from_dict(state.data_position) if state.data_position else None,
        max_sequences=loop_config.get("max_sequences"),
    )
    model = GPT(config.model).to(training_device())
    if restored is None and config.checkpoint.init_from:
        source = load_initial_weights(model, config.checkpoint.init_from, storage=config.storage)
        if rank == 0:
            print(f"New run initialised from {config.checkpoint.init_from} ({source}).", flush=True)

    # FLOPs per token and the achievable peak: measured once per run (rank 0), shared through the
    # coordinator actor, kept in checkpoints. Counted before DeepSpeed wraps the model.
    coordinator = Coordinator.connect(config.name or "run", timeout_s=config.metrics.coordinator_timeout_s)
    if rank == 0 and state.coordinator:
        coordinator.import_state(state.coordinator)
    mfu = mfu_inputs(
        coordinator, config.metrics, rank=rank, model=model, device=training_device(), precision=config.engine.precision,
        sample_tokens=torch.randint(0, config.model.vocab_size, (1, config.data.seq_len), device=training_device()),
    )
    state.coordinator = coordinator.export_state()
    if rank == 0:
        coordinator.watch_for_stop()  # the driver's SIGTERM / Ctrl-C reaches the loop through it

    engine = build_engine(
        model, engine=config.engine, optim=config.optim, micro_batch=train.micro_batch,
        grad_accum=grad_accum, world_size=world_size, total_steps=train.steps,
    )
    if restored is not None:
        checkpointer.load_into(engine)

    tokens_per_step = train.micro_batch * grad_accum * world_size * config.data.seq_len
    run_uri = f"{config.storage.uri.rstrip('/')}/{config.name}"
    sinks = []
    if rank == 0:
        local_dir = run_uri if "://" not in run_uri else tempfile.mkdtemp(prefix="raytrain-fast-sinks-")
        sinks = build_sinks(
            config.metrics, run_uri=run_uri, run_name=config.name or "run", start_step=state.step,
            local_dir=local_dir, storage=config.storage, run_config=redact(config.to_dict()),
        )
        sinks = slow_sinks(sinks)  # drill hook (loop/drills.py): unchanged unless RAYTRAIN_FAST_DRILL_SLOW_SINK is set
    metrics = TrainMetrics(  # built last: it freezes the heap for GC control
        config.metrics, log_every=train.log_every, total_steps=train.steps, start_step=state.step,
        tokens_per_step=tokens_per_step, device=engine.device, rank=rank, world_size=world_size,
        flops_per_token=mfu.flops_per_token, datasheet_peak_flops=mfu.datasheet_peak_flops,
        measured_peak_flops=mfu.measured_peak_flops, memory_budget_gb=config.resources.memory_budget_gb, sinks=sinks,
    )
    recorder = _SequenceRecorder(rank)
    # Drill hooks (loop/drills.py): `data` itself and a no-op unless RAYTRAIN_FAST_DRILL_SLOW_* is set.
    batches, after_step = slow_data(data, rank=rank, current_step=lambda: state.step), slow_step(rank)
    last: dict[str, float] = {}
    start_step = state.step
    # A sweep trial (raytrain_fast.sweep) is a short measurement run: each log window goes to Tune
    # (ASHA needs intermediate results), no checkpoints. Normal runs report on checkpoints only.
    trial_report = None
    if loop_config.get("sweep_trial"):
        from raytrain_fast.sweep.trial import report_window as trial_report

    try:
        while state.step < train.steps:
            train_step(engine, batches, metrics, grad_accum=grad_accum, on_batch=recorder.add if recorder.path else None)
            state.step += 1
            state.tokens += tokens_per_step
            metrics.end_step(state.step)
            if recorder.path:
                recorder.end_step(state.step)
            _maybe_inject_failure(state.step, rank)
            after_step(state.step)

            agreed = 0
            if metrics.is_log_step(state.step):
                # Every rank: one collective and the one host sync of the window. A rank that thinks
                # a timed checkpoint is due, or has heard of a stop request, says so here, so all
                # ranks act at the same step.
                flags = (_TIME_DUE if checkpointer.due_by_time() else 0) | (
                    _STOP if rank == 0 and coordinator.stop_requested() else 0
                )
                last = metrics.log(state.step, lr=engine.get_lr()[0], flags=flags)
                agreed = metrics.flags_any_rank

            if trial_report is not None:
                if metrics.is_log_step(state.step):
                    trial_report(step=state.step, metrics=last, memory_budget_gb=config.resources.memory_budget_gb)
                continue
            if checkpointer.due_by_steps(state.step, train.steps) or agreed:
                state.data_position = data.position.to_dict()
                blocked_s = checkpointer.save(
                    engine, state, metrics={"step": state.step, "tokens": state.tokens, "start_step": start_step, **last}
                )
                metrics.record_checkpoint(blocked_s=blocked_s, upload_s=checkpointer.take_upload_s())
                metrics.flush_sinks()
            if agreed & _STOP:
                checkpointer.finish()
                if rank == 0:
                    print(
                        f"Stop requested ({coordinator.stop_requested() or 'notice'}): saved a checkpoint at step "
                        f"{state.step} and stopped. The same command continues from there.", flush=True,
                    )
                break
        else:
            checkpointer.finish()
    finally:
        coordinator.close()
        metrics.close()
        data.close()
