"""The per-worker step loop that Ray's TorchTrainer runs on every worker.

`train_loop_per_worker` reads as a table of contents: restore, build the data, the model and the
engine, the metrics and the evaluator, then the steps (loop/steps.py: `run_steps`, whose docstring
names the order of events on a step). Hot path: `train_step` only. Every side concern (metrics,
evaluation, checkpoint, preemption, run health) says whether this step is its step. The loss stays on
the device; the host reads it only on log steps.

What the loop takes from outside comes in the loop config as objects (loop/hooks.py): a
`LoopHooks` (fault injection, drills, the sequence recorder; the default does nothing) and an
optional window callback (a sweep trial's Tune report). The loop imports nothing above it.
"""

from __future__ import annotations

import os
import random
import tempfile
from dataclasses import replace
from typing import Any

import torch

from raytrain_fast.checkpoint import Checkpointer, TrainState
from raytrain_fast.checkpoint.init_from import load_initial_weights
from raytrain_fast.config import Config
from raytrain_fast.console import nothing_to_do
from raytrain_fast.coordinator import Coordinator
from raytrain_fast.engine import apply_deepspeed_patches, apply_optim_settings, build_engine, enable_tf32, select_accelerator, training_device
from raytrain_fast.engine.compile import compile_blocks
from raytrain_fast.loop.evaluation import Evaluator, resolve_eval
from raytrain_fast.loop.health import DivergenceStop, HealthMonitor, Rollback
from raytrain_fast.loop.hooks import LoopHooks
from raytrain_fast.loop.steps import run_steps
from raytrain_fast.loop.worker import Worker
from raytrain_fast.metrics import SinkWriter, TrainMetrics, build_sinks, mfu_inputs
from raytrain_fast.metrics.host import run_at_normal_priority
from raytrain_fast.model import build_model, document_masking
from raytrain_fast.storage import redact
from raytrain_fast.storage.filesystem import resolve_filesystem, use_shipped_s3_filesystem
from raytrain_fast.watchdog.heartbeat import Heartbeat, NoHeartbeat, set_new_group_timeout

def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    worker = setup_worker(loop_config)
    checkpointer, state, restored = restore(worker)
    if state.step >= worker.config.train.steps:
        checkpointer.discard()
        _say_nothing_to_do(worker, state)
        return
    health = build_health(worker, checkpointer, state)
    data = build_data(worker, loop_config, state)
    coordinator = Coordinator.connect(worker.config.name or "run", timeout_s=worker.config.metrics.coordinator_timeout_s)
    sinks = None
    try:
        model, mfu = build_model_and_measure(worker, state, coordinator, restored=restored)
        sinks = start_sinks(worker, state)  # W&B / TensorBoard open while the engine is built, not in the first steps
        engine, compiled = build_engine_for(worker, model, checkpointer, coordinator, restored=restored)
        evaluator = build_evaluator(worker, engine, data, tasks=loop_config.get("tasks"))
        metrics = build_metrics(worker, state, engine, mfu, sinks)  # built last: it freezes the heap for GC control
        note_resize(worker, restored, checkpointer, metrics, coordinator)
        note_hangs(worker, coordinator, metrics, step=state.step)
        heartbeat = start_heartbeat(worker, coordinator, state)  # from here on, the hang watchdog watches this rank
        try:
            try:
                while True:  # once, unless a divergence rolls back (loop/health.py)
                    try:
                        run_steps(
                            worker, engine=engine, data=data, metrics=metrics, evaluator=evaluator, checkpointer=checkpointer,
                            coordinator=coordinator, state=state, on_window=loop_config.get("on_window"), compiled=compiled,
                            save_checkpoints=loop_config.get("save_checkpoints", True), health=health, heartbeat=heartbeat,
                        )
                        break
                    except Rollback as rollback:
                        heartbeat.pause("restore")  # loading the checkpoint: not watched until the next step
                        data, restored = roll_back(worker, rollback, loop_config, engine=engine, data=data, metrics=metrics,
                                                   checkpointer=checkpointer, health=health)
                        vars(state).update(vars(restored))  # the same object: the heartbeat thread reads state.step
                        compiled = False
            except DivergenceStop as stop:  # from the policy, or a rollback with no checkpoint to go back to
                stop_on_divergence(worker, stop, checkpointer=checkpointer, coordinator=coordinator, health=health)
        finally:
            heartbeat.close()
            metrics.close()
    finally:
        if sinks is not None:
            sinks.close()  # already closed by metrics.close() unless setup failed before it
        coordinator.close()
        data.close()
        worker.hooks.close()


def setup_worker(loop_config: dict[str, Any]) -> Worker:
    import ray.train

    from raytrain_fast.data import load_manifest

    config = Config.from_dict(loop_config["config"])
    if loop_config.get("s3_filesystem") is not None:
        use_shipped_s3_filesystem(config.storage, loop_config["s3_filesystem"])
    manifest = load_manifest(loop_config["data_uri"], config.storage)
    config, _ = resolve_eval(config, manifest)  # the driver printed the notes and raised the errors
    context = ray.train.get_context()
    rank = context.get_world_rank()
    cpus = config.resources.cpus_per_worker
    if cpus > 0:  # Ray starts workers with OMP_NUM_THREADS=1: torch must be told how many cores it has
        torch.set_num_threads(cpus)
        os.environ["OMP_NUM_THREADS"] = str(cpus)
    niceness = run_at_normal_priority()  # Ray starts workers at niceness 15: any other process would win the CPU
    if config.watchdog.enabled:  # DeepSpeed's own groups time out with the world group, just after the watchdog
        set_new_group_timeout(config.watchdog.process_group_timeout_s())
    select_accelerator()
    device = training_device()
    enable_tf32(device)  # fp32 matmuls on CUDA use TF32 tensor cores
    torch.manual_seed(config.train.seed)
    random.seed(config.train.seed)
    hooks: LoopHooks = loop_config.get("hooks") or LoopHooks()
    world_size = context.get_world_size()
    config = keep_global_batch(config, world_size)
    return Worker(
        config=config, rank=rank, world_size=world_size, grad_accum=config.grad_accum(),
        device=device, hooks=hooks.for_rank(rank), niceness=niceness, manifest=manifest,
    )


def keep_global_batch(config: Config, world_size: int) -> Config:
    """An elastic run's worker group may be smaller than resources.num_workers (its MAX): the global
    batch stays the configured one, with micro_batch x grad_accum refitted for the group's size (the
    driver checked that every size of the range fits)."""
    from raytrain_fast.checkpoint.resize import fit_batch

    resources, train = config.resources, config.train
    if world_size == resources.num_workers:
        return config
    global_batch = int(train.micro_batch) * config.grad_accum() * resources.num_workers
    micro_batch, grad_accum = fit_batch(
        global_batch=global_batch, micro_batch=int(train.micro_batch), num_workers=world_size,
        saved_workers=resources.num_workers, uri=config.name or "run",
    )
    return replace(
        config, train=replace(train, global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum),
        resources=replace(resources, num_workers=world_size, min_workers=None),
    )


def restore(worker: Worker) -> tuple[Checkpointer, TrainState, TrainState | None]:
    """The newest complete checkpoint's state (not yet the engine's: that is loaded once the engine
    exists), so the data reader can start at the saved position while the engine is built."""
    config = worker.config
    filesystem, storage_root = resolve_filesystem(config.storage.uri, config.storage)
    checkpointer = Checkpointer(
        config.checkpoint, rank=worker.rank, world_size=worker.world_size, run_config=redact(config.to_dict()),
        local_mode_run=(filesystem, f"{storage_root.rstrip('/')}/{config.name}"),
        before_upload=worker.hooks.before_upload,
    )
    restored = checkpointer.restore_state()
    state = restored or TrainState(
        world_size=worker.world_size, zero_stage=config.engine.zero_stage, precision=config.engine.precision
    )
    if worker.rank == 0 and restored:
        print(f"Resumed from checkpoint at step {state.step} ({state.tokens:,} tokens seen).", flush=True)
        if checkpointer.resized:
            from raytrain_fast.checkpoint.resize import resize_line

            r = checkpointer.resized
            print(resize_line(step=state.step, old=r["old"], new=r["new"], seconds=r["seconds"], cache=r["cache"],
                              micro_batch=int(config.train.micro_batch), grad_accum=worker.grad_accum), flush=True)
    state.world_size = worker.world_size  # what the next checkpoint is written by (a resize changes it)
    state.global_batch = int(config.train.micro_batch) * worker.grad_accum * worker.world_size
    return checkpointer, state, restored


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
        if worker.rank == 0:
            print(f"Resized at step {restored.step}: {old} -> {worker.world_size} workers (resumed from a checkpoint "
                  f"saved by {worker.world_size} workers: nothing to convert)", flush=True)
    else:
        return
    metrics.emit(restored.step, {"resize/from_workers": float(old), "resize/to_workers": float(worker.world_size)})


def start_heartbeat(worker: Worker, coordinator: Coordinator, state: TrainState) -> Heartbeat | NoHeartbeat:
    """This rank's heartbeat to the hang watchdog in the coordinator actor (watchdog/heartbeat.py):
    a thread that reads `state.step`; nothing on the training thread."""
    watchdog = worker.config.watchdog
    if not watchdog.enabled:
        return NoHeartbeat()
    return Heartbeat(
        coordinator.actor, rank=worker.rank, world_size=worker.world_size, read_step=lambda: state.step,
        last_step=worker.config.train.steps, interval_s=watchdog.beat_interval_s(),
    ).start()


def note_hangs(worker: Worker, coordinator: Coordinator, metrics: TrainMetrics, *, step: int) -> None:
    """After a restart the watchdog caused: one line on rank 0, and hang/* metrics the report and
    the progress line read (the stacks are in `<run>/hangs/`)."""
    if worker.rank != 0:
        return
    for hang in coordinator.take_hangs():
        ranks = ", ".join(map(str, hang["stuck_ranks"]))
        print(
            f"Resumed at step {step} after a hang at step {hang['step']}: rank {ranks} made no progress for "
            f"{hang['stuck_s']:.0f} s (stacks: {worker.run_uri}/{hang['stacks_file']}).", flush=True,
        )
        metrics.emit(step, {
            "hang/step": float(hang["step"]), "hang/stuck_s": float(hang["stuck_s"]),
            "hang/rank": float(hang["stuck_ranks"][0]), "hang/redone_steps": float(hang["step"] - step),
        })


def _say_nothing_to_do(worker: Worker, state: TrainState) -> None:
    if worker.rank == 0:
        print(nothing_to_do(worker.config.name, steps=worker.config.train.steps, saved_step=state.step), flush=True)


def build_health(worker: Worker, checkpointer: Checkpointer, state: TrainState) -> HealthMonitor:
    """The divergence policy (loop/health.py) with the run's rollbacks so far; a resume from a
    checkpoint that a rollback went back to skips the same data again (its position moves past it)."""
    from raytrain_fast.loop.health import read_records, skip_position

    records = read_records(checkpointer.filesystem, checkpointer.run_path) or list(state.health.get("rollbacks", []))
    position = skip_position(records, step=state.step, position=state.data_position)
    if position != state.data_position:
        if worker.rank == 0:
            print(f"Step {state.step}: skipping the data a rollback skipped here (health.json): now at {position}.", flush=True)
        state.data_position = position
    config = worker.config
    return HealthMonitor(config.health, rank=worker.rank, warmup_steps=config.optim.warmup_steps, rollbacks=records,
                         vocab_size=config.model.vocab_size, start_step=state.step)


def roll_back(
    worker: Worker, rollback: Rollback, loop_config: dict[str, Any], *, engine: Any, data: Any, metrics: TrainMetrics,
    checkpointer: Checkpointer, health: HealthMonitor,
) -> tuple[Any, TrainState]:
    """Every rank at once: load the newest healthy checkpoint into the live engine (weights,
    optimizer, LR schedule, RNG), restart the data reader where the diverged window ended (the
    data read since that checkpoint is skipped, and recorded), and the metrics window at its step.
    In-process: no worker restart (that would count against resources.max_failures and redo setup)."""
    from raytrain_fast.loop.health import sequences_between, write_records

    checkpointer.finish()  # every rank's uploads are in storage: the newest healthy one is complete
    detected_at = data.position.to_dict()
    restored = checkpointer.restore_state()
    if restored is None:
        message = health.stop_message(step=rollback.step, what=rollback.what, loss=rollback.loss, grad=rollback.grad_norm,
                                      setting=rollback.setting, no_checkpoint=True)
        raise DivergenceStop(f"{message} No checkpoint was saved before it, so there is nothing to roll back to: "
                             "set checkpoint.every_steps below the step it diverged at.",
                             step=rollback.step, what=rollback.what, loss=rollback.loss, grad_norm=rollback.grad_norm,
                             setting=rollback.setting, policy="rollback")
    checkpointer.load_into(engine)
    # The checkpoint may predate a resume that changed optim.*: this run's settings stay in force.
    apply_optim_settings(engine, optim=worker.config.optim, total_steps=worker.config.train.steps)
    skipped = sequences_between(restored.data_position, detected_at, data.sequences_per_epoch)
    health.rollbacks.append({
        "detected_step": rollback.step, "what": rollback.what, "loss": rollback.loss, "grad_norm": rollback.grad_norm,
        "to_step": restored.step, "position": restored.data_position, "skip_sequences": skipped, "resume_position": detected_at,
    })
    if worker.rank == 0:
        write_records(checkpointer.filesystem, checkpointer.run_path, health.rollbacks)
        print(
            f"Step {rollback.step}: {rollback.what} (loss {rollback.loss}, grad norm {rollback.grad_norm}). Rolled back to "
            f"the checkpoint at step {restored.step} and skipped the {skipped:,} sequences read since it (rollback "
            f"{len(health.rollbacks)} of at most {worker.config.health.max_rollbacks}).", flush=True,
        )
    restored.data_position, restored.world_size = detected_at, worker.world_size
    restored.global_batch = int(worker.config.train.micro_batch) * worker.grad_accum * worker.world_size
    data.close()
    metrics.restart_at(restored.step)
    health.restart_at(restored.step)
    metrics.emit(rollback.step, {"health/rollback": 1.0, "health/rollback_to_step": float(restored.step),
                                 "health/skipped_sequences": float(skipped)})
    metrics.mark_health("rollback", rollback.step)
    return build_data(worker, loop_config, restored), restored


def stop_on_divergence(
    worker: Worker, stop: DivergenceStop, *, checkpointer: Checkpointer, coordinator: Coordinator, health: HealthMonitor,
) -> None:
    """The run stops: uploads finish, rank 0 records the stop in `<run>/health.json` (the report
    names it) and hands the message to the driver through the run's coordinator, and the workers end
    normally, so Ray Train does not restart them (the driver raises it)."""
    checkpointer.finish()
    if worker.rank == 0:
        import ray

        from raytrain_fast.loop.health import DIVERGENCE_KEY, write_records

        write_records(checkpointer.filesystem, checkpointer.run_path, health.rollbacks, stopped=stop.record())
        print(str(stop), flush=True)
        ray.get(coordinator.actor.post.remote(DIVERGENCE_KEY, str(stop), {}))


def build_data(worker: Worker, loop_config: dict[str, Any], state: TrainState):
    from raytrain_fast.data import BatchIterator, DataPosition

    config = worker.config
    if config.data.sources:  # a mixture (data/mixture.py): its position is the mixture's
        from raytrain_fast.data.mixture import open_mixture

        return open_mixture(config, loop_config["data_uris"], rank=worker.rank, world_size=worker.world_size,
                            device=worker.device, position=state.data_position)
    return BatchIterator(
        worker.manifest,
        rank=worker.rank, world_size=worker.world_size, micro_batch=config.train.micro_batch,
        seed=config.data.shuffle_seed, prefetch_batches=config.data.prefetch_batches, device=worker.device,
        storage=config.storage, max_sequences=loop_config.get("max_sequences"),
        position=DataPosition.from_dict(state.data_position) if state.data_position else None,
    )


def build_model_and_measure(worker: Worker, state: TrainState, coordinator: Coordinator, *, restored: TrainState | None):
    """The model (initial weights from checkpoint.init_from on a new run) and the values measured
    once per run (FLOPs per token, the achievable peak: counted on the eager model before anything
    else runs beside it, shared through the coordinator actor, kept in checkpoints)."""
    config, rank = worker.config, worker.rank
    documents = document_masking(config.data, eod_id=worker.manifest.tokenizer.eod_id)  # None unless data.document_masking
    model = build_model(config.model, worker.device, documents=documents)  # weights made on the device: no host copy first
    if restored is None and config.checkpoint.init_from:
        source = load_initial_weights(
            model, config.checkpoint.init_from, storage=config.storage, rank=rank, world_size=worker.world_size
        )
        if rank == 0:
            print(f"New run initialised from {config.checkpoint.init_from} ({source}).", flush=True)
    if rank == 0 and state.coordinator:
        coordinator.import_state(state.coordinator)
    mfu = mfu_inputs(
        coordinator, config.metrics, rank=rank, model=model, device=worker.device, precision=config.engine.precision,
        sample_tokens=torch.randint(0, config.model.vocab_size, (1, config.data.seq_len), device=worker.device),
    )
    state.coordinator = coordinator.export_state()
    if rank == 0 and (line := mfu.peak_line()):
        print(line, flush=True)
    return model, mfu


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
    local_dir = tempfile.mkdtemp(prefix="raytrain-fast-sinks-") if keeps_files and "://" in worker.run_uri else worker.run_uri
    sinks = build_sinks(
        config.metrics, run_uri=worker.run_uri, run_name=config.name or "run", start_step=state.step,
        local_dir=local_dir, storage=config.storage, run_config=redact(config.to_dict()),
    )
    return SinkWriter(worker.hooks.sinks(sinks), max_queue=config.metrics.queue_size)


def build_engine_for(worker: Worker, model: Any, checkpointer: Checkpointer, coordinator: Coordinator, *, restored: TrainState | None):
    """Compiled blocks (after the FLOP count: counted eager), then the DeepSpeed engine with the restored state."""
    config, rank = worker.config, worker.rank
    compiled, compile_line = compile_blocks(model, setting=config.engine.compile, device=worker.device)
    if rank == 0:
        if compile_line:
            print(compile_line, flush=True)
        coordinator.watch_for_stop()  # the driver's SIGTERM / Ctrl-C reaches the loop through it
    patches = apply_deepspeed_patches(config.engine.deepspeed_patches, world_size=worker.world_size,
                                      warn=print if rank == 0 else lambda line: None)
    if rank == 0:
        print(patches, flush=True)
    engine = build_engine(
        model, engine=config.engine, optim=config.optim, micro_batch=config.train.micro_batch,
        grad_accum=worker.grad_accum, world_size=worker.world_size, total_steps=config.train.steps,
        load_universal=checkpointer.resized is not None,
    )
    if restored is not None:
        checkpointer.load_into(engine)
        apply_optim_settings(engine, optim=config.optim, total_steps=config.train.steps)  # a changed optim.* applies
    return engine, compiled


def build_evaluator(worker: Worker, engine: Any, data: Any, *, tasks: Any = None) -> Evaluator:
    """This rank's share of the fixed validation set, on the device once (none when eval is off); for
    a mixture, each source's split with a val/loss of its own (data/validation.py). `tasks`: the run's
    eval.tasks, encoded on the driver (downstream/in_loop.py RunTasks), or None."""
    from raytrain_fast.data.validation import load_mixture_validation, load_validation_tokens

    config = worker.config
    tokens, total, splits = None, config.eval.sequences, None
    share = dict(rank=worker.rank, world_size=worker.world_size, storage=config.storage)
    if config.eval.enabled and config.data.sources:
        rows, splits = load_mixture_validation(data.sources, count=config.eval.sequences, **share)
        tokens, total = torch.from_numpy(rows).to(engine.device), len(rows)
    elif config.eval.enabled:
        rows = load_validation_tokens(worker.manifest, count=config.eval.sequences, **share)
        tokens = torch.from_numpy(rows).to(engine.device)
    micro_batch = config.eval.micro_batch or int(config.train.micro_batch)
    if tasks is not None:
        tasks = tasks.for_rank(rank=worker.rank, world_size=worker.world_size, device=engine.device, micro_batch=micro_batch)
    return Evaluator(
        tokens=tokens, total=total, every_steps=config.eval.every_steps or 1, total_steps=config.train.steps,
        micro_batch=micro_batch, rank=worker.rank, world_size=worker.world_size, sources=splits, tasks=tasks,
    )


def build_metrics(worker: Worker, state: TrainState, engine: Any, mfu: Any, sinks: SinkWriter | None) -> TrainMetrics:
    """Every rank's metrics; rank 0's hand records to the sink writer started during setup."""
    config = worker.config
    return TrainMetrics(
        config.metrics, log_every=config.train.log_every, total_steps=config.train.steps, start_step=state.step,
        tokens_per_step=worker.tokens_per_step, device=engine.device, rank=worker.rank, world_size=worker.world_size,
        flops_per_token=mfu.flops_per_token, datasheet_peak_flops=mfu.datasheet_peak_flops,
        measured_peak_flops=mfu.measured_peak_flops, memory_budget_gb=config.resources.memory_budget_gb,
        sinks=sinks if sinks is not None else (), niceness=worker.niceness,
    )
