"""The parts one worker's steps use (loop/steps.py), built in the order they need each other and
closed in reverse.

`LoopParts.restore` reads the newest checkpoint's state first (state only: the data reader starts
at its position while the model is built), then `build` makes, in order: the health policy, the
data reader, the run's coordinator, the eager model with its initial weights and what is measured on it, rank 0's sinks and
stop watcher (W&B starts while the rest is built), the program (engine/program.py: compiled blocks,
the engine with the restored state), the evaluator, the metrics (last: building them freezes the
heap for GC control), and the heartbeat (from then on the hang watchdog watches this rank). Leaving the `with` block closes what was built, in
reverse, whatever happened.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from raytrain_fast.checkpoint import Checkpointer, TrainState
from raytrain_fast.console import nothing_to_do, say
from raytrain_fast.coordinator import Coordinator
from raytrain_fast.engine import apply_optim_settings
from raytrain_fast.engine.program import build_program, eager_model
from raytrain_fast.loop.evaluation import Evaluator
from raytrain_fast.loop.health import HealthMonitor
from raytrain_fast.metrics import SinkWriter, StepPlan, TrainMetrics, build_sinks, mfu_inputs
from raytrain_fast.metrics.setup import MfuInputs
from raytrain_fast.model import GPT, document_masking
from raytrain_fast.storage import redact
from raytrain_fast.watchdog.heartbeat import Heartbeat, NoHeartbeat

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from raytrain_fast.data import BatchIterator
    from raytrain_fast.loop.hooks import WindowCallback
    from raytrain_fast.loop.worker import LoopInputs, Worker


class LoopParts:
    """What the steps use; `restore` and `build` make it, leaving the `with` block closes it."""

    checkpointer: Checkpointer
    state: TrainState
    """The training state; the same object throughout (the heartbeat thread reads its step)."""
    health: HealthMonitor
    data: BatchIterator
    """The reader at the state's position; a rollback replaces it (loop/rollback.py)."""
    coordinator: Coordinator
    mfu: MfuInputs
    """FLOPs per token and the peaks, measured once per run on the eager model."""
    sinks: SinkWriter | None
    """Rank 0's sink writer (None on other ranks)."""
    engine: DeepSpeedEngine
    compiled: bool
    """The blocks are compiled and the next step is their first: it compiles them (timed apart)."""
    evaluator: Evaluator
    metrics: TrainMetrics
    heartbeat: Heartbeat | NoHeartbeat
    on_window: WindowCallback | None
    save_checkpoints: bool

    def __init__(self, worker: Worker, inputs: LoopInputs) -> None:
        self.worker, self.inputs = worker, inputs
        self.on_window, self.save_checkpoints = inputs.on_window, inputs.save_checkpoints
        self._closing = contextlib.ExitStack()
        self._closing.callback(worker.hooks.close)  # built first, by setup_worker

    def __enter__(self) -> LoopParts:
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.close()

    def restore(self) -> TrainState | None:
        """The checkpointer and the state: the newest complete checkpoint's (returned; None for a new run).
        State only, not yet the engine's (loaded once the engine exists), so the data reader can start at
        the saved position while the engine is built."""
        worker, config, plan = self.worker, self.worker.config, self.worker.plan
        self.checkpointer = checkpointer = Checkpointer(
            config.checkpoint, rank=worker.rank, world_size=worker.world_size, run_config=redact(config.to_dict()),
            local_mode_run=(plan.filesystem, plan.run_path), before_upload=worker.hooks.before_upload,
        )
        restored = checkpointer.restore_state()
        self.state = state = restored or TrainState(
            world_size=worker.world_size, zero_stage=config.engine.zero_stage, precision=config.engine.precision
        )
        if restored:
            say(f"Resumed from checkpoint at step {state.step} ({state.tokens:,} tokens seen).", rank=worker.rank)
            if checkpointer.resized:
                from raytrain_fast.checkpoint.resize import resize_line

                r = checkpointer.resized
                say(resize_line(step=state.step, old=r["old"], new=r["new"], seconds=r["seconds"], cache=r["cache"],
                                micro_batch=worker.batch.micro_batch, grad_accum=worker.grad_accum),
                    rank=worker.rank)
        state.world_size = worker.world_size  # what the next checkpoint is written by (a resize changes it)
        state.global_batch = worker.batch.global_batch
        return restored

    def nothing_to_do(self) -> None:
        """The run already reached train.steps: nothing to train, nothing to save."""
        self.checkpointer.discard()
        config = self.worker.config
        say(nothing_to_do(config.name, steps=config.train.steps, saved_step=self.state.step), rank=self.worker.rank)

    def build(self, *, restored: TrainState | None) -> None:
        """Every other part, in order (the module docstring says why this order)."""
        worker, state, close = self.worker, self.state, self._closing.callback
        self.health = build_health(worker, self.checkpointer, state)
        self.data = self.open_data(state)
        close(lambda: self.data.close())  # the reader of the moment (a rollback replaces it)
        self.coordinator = Coordinator.connect(worker.config.name or "run", timeout_s=worker.config.metrics.coordinator_timeout_s)
        close(self.coordinator.close)
        documents = document_masking(worker.config.data, eod_id=worker.plan.sources[0].manifest.tokenizer.eod_id)  # None: off
        model = eager_model(worker.config, device=worker.device, documents=documents)
        masters = load_init_from(worker, model, restored=restored)
        self.mfu = measure_eager_model(worker, model, state, self.coordinator)
        self.sinks = start_sinks(worker, state)  # after the measurement: W&B starts while the engine is built
        if self.sinks is not None:
            close(self.sinks.close)  # closed by metrics.close() too, unless setup fails before it
        if worker.rank == 0:
            self.coordinator.watch_for_stop()  # the driver's SIGTERM / Ctrl-C reaches the loop through it
        self.engine, self.compiled = self._build_program(model, restored, masters=masters)
        if self.save_checkpoints:  # before the first step: no save allocates its host memory while training runs
            self.checkpointer.reserve_snapshot_memory(self.engine)
        self.evaluator = build_evaluator(worker, self.engine, tasks=worker.plan.tasks, start_step=state.step)
        self.metrics = build_metrics(worker, state, self.engine, self.mfu, self.sinks)  # last: it freezes the heap for GC control
        close(self.metrics.close)
        note_resize(worker, restored, self.checkpointer, self.metrics, self.coordinator)
        note_hangs(worker, self.coordinator, self.metrics, step=state.step)
        self.heartbeat = start_heartbeat(worker, self.coordinator, state)  # from here on, the hang watchdog watches this rank
        close(self.heartbeat.close)

    def _build_program(
        self, model: GPT, restored: TrainState | None, *, masters: list | None,
    ) -> tuple[DeepSpeedEngine, bool]:
        """The worker's program (engine/program.py) around the eager model, with the restored state in
        its engine and `masters` (init_from's fp32 values) as its master weights: (the engine, whether
        its blocks compile in the next step)."""
        worker, config = self.worker, self.worker.config
        program = build_program(
            config, device=worker.device, model=model, batch=worker.batch, masters=masters, load_universal=self.checkpointer.resized is not None,
            say=functools.partial(say, rank=worker.rank),
        )
        if restored is not None:
            self.checkpointer.load_into(program.engine)
            apply_optim_settings(program.engine, optim=config.optim, total_steps=config.train.steps)  # a changed optim.* applies
        return program.engine, program.compiled

    def open_data(self, state: TrainState) -> BatchIterator:
        """The reader of the plan's sources at `state`'s data position."""
        from raytrain_fast.data import BatchIterator

        worker, data = self.worker, self.worker.config.data
        return BatchIterator(
            worker.plan.sources, rank=worker.rank, world_size=worker.world_size, micro_batch=worker.batch.micro_batch,
            seed=data.shuffle_seed, prefetch_batches=data.prefetch_batches, device=worker.device,
            storage=worker.config.storage, position=state.data_position,
        )


def build_health(worker: Worker, checkpointer: Checkpointer, state: TrainState) -> HealthMonitor:
    """The divergence policy (loop/health.py) with the run's rollbacks so far; a resume from a
    checkpoint that a rollback went back to skips the same data again (its position moves past it)."""
    from raytrain_fast.loop.health import read_health, skip_position

    recorded = read_health(checkpointer.filesystem, checkpointer.run_path).get("rollbacks")
    records = recorded or state.health.get("rollbacks", [])
    position = skip_position(records, step=state.step, position=state.data_position)
    if position != state.data_position:
        say(f"Step {state.step}: skipping the data a rollback skipped here (health.json): now at {position}.", rank=worker.rank)
        state.data_position = position
    config = worker.config
    return HealthMonitor(config.health, rank=worker.rank, warmup_steps=config.optim.warmup_steps, rollbacks=records,
                         vocab_size=config.model.vocab_size, start_step=state.step)


def load_init_from(worker: Worker, model: GPT, *, restored: TrainState | None) -> list | None:
    """On the eager model of a new run: the initial weights from checkpoint.init_from, and in bf16
    their fp32 values for the master weights (checkpoint/init_from.py)."""
    from raytrain_fast.checkpoint.init_from import fp32_values, load_initial_weights

    config, rank = worker.config, worker.rank
    if restored is not None or not config.checkpoint.init_from:
        return None
    source = load_initial_weights(
        model, config.checkpoint.init_from, storage=config.storage, rank=rank, world_size=worker.world_size
    )
    say(f"New run initialised from {config.checkpoint.init_from} ({source}).", rank=rank)
    return fp32_values(model) if config.engine.precision == "bf16" else None


def measure_eager_model(worker: Worker, model: GPT, state: TrainState, coordinator: Coordinator) -> MfuInputs:
    """On the eager model: the values measured once per run (FLOPs per token, the achievable peak:
    counted before anything else runs beside it, shared through the coordinator actor, kept in checkpoints)."""
    config, rank = worker.config, worker.rank
    if rank == 0 and state.coordinator:
        coordinator.import_state(state.coordinator)
    mfu = mfu_inputs(
        coordinator, config.metrics, rank=rank, model=model, device=worker.device, precision=config.engine.precision,
        sample_tokens=torch.randint(0, config.model.vocab_size, (1, config.data.seq_len), device=worker.device),
    )
    state.coordinator = coordinator.export_state()
    if line := mfu.peak_line():
        say(line, rank=rank)
    return mfu


def start_sinks(worker: Worker, state: TrainState) -> SinkWriter | None:
    """Rank 0's sinks (JSONL, W&B, TensorBoard as configured) behind their writer thread, which
    opens them at once: W&B's import and init take seconds of CPU that would otherwise come out of
    the first training steps."""
    if worker.rank != 0:
        return None
    config = worker.config
    # W&B and TensorBoard write files on this node; with remote storage they go to a temp dir that
    # metrics.sinks.LocalDirSync copies into the run's storage and removes at the end.
    keeps_files = config.metrics.wandb or config.metrics.tensorboard
    run_uri = worker.plan.run_uri
    local_dir = tempfile.mkdtemp(prefix="raytrain-fast-sinks-") if keeps_files and "://" in run_uri else run_uri
    sinks = build_sinks(
        config.metrics, run_uri=run_uri, run_name=config.name or "run", start_step=state.step,
        local_dir=local_dir, storage=config.storage, run_config=redact(config.to_dict()),
    )
    return SinkWriter(worker.hooks.sinks(sinks), max_queue=config.metrics.queue_size)


def build_evaluator(worker: Worker, engine: DeepSpeedEngine, *, tasks: Any, start_step: int) -> Evaluator:
    """This rank's share of the fixed validation set of every source, on the device once (none when
    eval is off), each source's with a val/loss of its own (data/validation.py). `tasks`: the run's
    eval.tasks, encoded on the driver (downstream/in_loop.py RunTasks), or None."""
    from raytrain_fast.data.validation import load_validation

    config, share = worker.config, dict(rank=worker.rank, world_size=worker.world_size)
    tokens, splits = None, []
    if config.eval.enabled:
        rows, splits = load_validation(worker.plan.sources, count=config.eval.sequences, storage=config.storage, **share)
        tokens = torch.from_numpy(rows).to(engine.device)
    micro_batch = config.eval.micro_batch or worker.batch.micro_batch
    if tasks is not None:
        tasks = tasks.for_rank(device=engine.device, micro_batch=micro_batch, **share)
    return Evaluator(
        tokens=tokens, sources=splits, every_steps=config.eval.every_steps, total_steps=config.train.steps,
        start_step=start_step, micro_batch=micro_batch, tasks=tasks, **share,
    )


def build_metrics(worker: Worker, state: TrainState, engine: DeepSpeedEngine, mfu: MfuInputs, sinks: SinkWriter | None) -> TrainMetrics:
    """Every rank's metrics; rank 0's hand records to the sink writer started during setup."""
    config = worker.config
    steps = StepPlan(log_every=config.train.log_every, total_steps=config.train.steps, start_step=state.step,
                     tokens_per_step=worker.tokens_per_step)
    return TrainMetrics(
        config.metrics, steps=steps, device=engine.device, rank=worker.rank, world_size=worker.world_size, mfu=mfu,
        memory_budget_gb=config.resources.memory_budget_gb, niceness=worker.niceness, sinks=sinks,
    )


def note_resize(
    worker: Worker, restored: TrainState | None, checkpointer: Checkpointer, metrics: TrainMetrics, coordinator: Coordinator,
) -> None:
    """An elastic run (or a rerun on another worker count) resumed at a new size: one line, and a
    record that the report draws as a marker at the step. The size it changed from is the checkpoint's
    (converted, and the line printed, by restore()), else this job's previous worker group's: a group
    that grows back before the smaller one saved resumes a checkpoint of its own size."""
    previous = coordinator.swap_group_size(worker.world_size) if worker.rank == 0 else None
    if restored is None:
        return
    if checkpointer.resized:
        old = checkpointer.resized["old"]
    elif previous is not None and previous != worker.world_size:
        old = previous
        say(f"Resized at step {restored.step}: {old} -> {worker.world_size} workers (resumed from a checkpoint "
            f"saved by {worker.world_size} workers: nothing to convert)", rank=worker.rank)
    else:
        return
    metrics.emit(restored.step, {"resize/from_workers": float(old), "resize/to_workers": float(worker.world_size)})


def note_hangs(worker: Worker, coordinator: Coordinator, metrics: TrainMetrics, *, step: int) -> None:
    """After a restart the watchdog caused: one line on rank 0, and hang/* metrics the report and
    the progress line read (the stacks are in `<run>/hangs/`)."""
    if worker.rank != 0:
        return
    for hang in coordinator.take_hangs():
        ranks = ", ".join(map(str, hang["stuck_ranks"]))
        say(
            f"Resumed at step {step} after a hang at step {hang['step']}: rank {ranks} made no progress for "
            f"{hang['stuck_s']:.0f} s (stacks: {worker.plan.run_uri}/{hang['stacks_file']}).", rank=worker.rank,
        )
        metrics.emit(step, {
            "hang/step": float(hang["step"]), "hang/stuck_s": float(hang["stuck_s"]),
            "hang/rank": float(hang["stuck_ranks"][0]), "hang/redone_steps": float(hang["step"] - step),
        })


def start_heartbeat(worker: Worker, coordinator: Coordinator, state: TrainState) -> Heartbeat | NoHeartbeat:
    """This rank's heartbeat to the hang watchdog in the coordinator actor (watchdog/heartbeat.py):
    a thread that reads `state.step`; nothing on the training thread."""
    watchdog = worker.config.watchdog
    if not watchdog.enabled:
        return NoHeartbeat()
    return Heartbeat(
        coordinator, rank=worker.rank, world_size=worker.world_size, read_step=lambda: state.step,
        last_step=worker.config.train.steps, interval_s=watchdog.beat_interval_s(),
    ).start()
