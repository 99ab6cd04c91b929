"""What the loop does when the health check (loop/health.py) calls a window diverged: roll back to
the newest healthy checkpoint and train on (`Rollback`), or stop the run (`DivergenceStop`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from raytrain_fast.console import say
from raytrain_fast.engine import apply_optim_settings
from raytrain_fast.loop.health import DivergenceStop, Rollback, write_records
from raytrain_fast.loop.steps import run_steps

if TYPE_CHECKING:
    from raytrain_fast.loop.parts import LoopParts
    from raytrain_fast.loop.worker import Worker


def train_with_rollbacks(worker: Worker, parts: LoopParts) -> None:
    """The steps; after each rollback, the steps again from the checkpoint it went back to. A
    `DivergenceStop` (from the policy, or a rollback with no checkpoint to go back to) ends the run."""
    try:
        while True:
            try:
                return run_steps(worker, parts)
            except Rollback as rollback:
                parts.heartbeat.pause("restore")  # loading the checkpoint: not watched until the next step
                roll_back(worker, rollback, parts)
    except DivergenceStop as stop:
        stop_on_divergence(worker, stop, parts)


def roll_back(worker: Worker, rollback: Rollback, parts: LoopParts) -> None:
    """Every rank at once: load the newest healthy checkpoint into the live engine (weights,
    optimizer, LR schedule, RNG), restart the data reader where the diverged window ended (the
    data read since that checkpoint is skipped, and recorded), and the metrics window at its step.
    In-process: no worker restart (that would count against resources.max_failures and redo setup)."""
    checkpointer, health, metrics, config = parts.checkpointer, parts.health, parts.metrics, worker.config
    checkpointer.finish()  # every rank's uploads are in storage: the newest healthy one is complete
    detected_at = parts.data.position.to_dict()
    restored = checkpointer.restore_state()
    if restored is None:
        message = health.stop_message(step=rollback.step, what=rollback.what, loss=rollback.loss, grad=rollback.grad_norm,
                                      setting=rollback.setting, no_checkpoint=True)
        raise DivergenceStop(f"{message} No checkpoint was saved before it, so there is nothing to roll back to: "
                             "set checkpoint.every_steps below the step it diverged at.",
                             step=rollback.step, what=rollback.what, loss=rollback.loss, grad_norm=rollback.grad_norm,
                             setting=rollback.setting, policy="rollback")
    checkpointer.load_into(parts.engine)
    # The checkpoint may predate a resume that changed optim.*: this run's settings stay in force.
    apply_optim_settings(parts.engine, optim=config.optim, total_steps=config.train.steps)
    skipped = parts.data.sequences_since(restored.data_position)
    health.rollbacks.append({
        "detected_step": rollback.step, "what": rollback.what, "loss": rollback.loss, "grad_norm": rollback.grad_norm,
        "to_step": restored.step, "position": restored.data_position, "skip_sequences": skipped, "resume_position": detected_at,
    })
    if worker.rank == 0:
        write_records(checkpointer.filesystem, checkpointer.run_path, health.rollbacks)
        say(
            f"Step {rollback.step}: {rollback.what} (loss {rollback.loss}, grad norm {rollback.grad_norm}). Rolled back to "
            f"the checkpoint at step {restored.step} and skipped the {skipped:,} sequences read since it (rollback "
            f"{len(health.rollbacks)} of at most {config.health.max_rollbacks}).", rank=worker.rank,
        )
    restored.data_position, restored.world_size = detected_at, worker.world_size
    restored.global_batch = worker.batch.global_batch
    parts.data.close()
    metrics.restart_at(restored.step)
    health.restart_at(restored.step)
    metrics.emit(rollback.step, {"health/rollback": 1.0, "health/rollback_to_step": float(restored.step),
                                 "health/skipped_sequences": float(skipped)})
    metrics.mark_health("rollback", rollback.step)
    parts.data = parts.open_data(restored)
    vars(parts.state).update(vars(restored))  # the same object: the heartbeat thread reads state.step


def stop_on_divergence(worker: Worker, stop: DivergenceStop, parts: LoopParts) -> None:
    """The run stops: uploads finish, rank 0 records the stop in `<run>/health.json` (the report
    names it) and hands the message to the driver through the run's coordinator, and the workers end
    normally, so Ray Train does not restart them (the driver raises it)."""
    parts.checkpointer.finish()
    if worker.rank == 0:
        write_records(parts.checkpointer.filesystem, parts.checkpointer.run_path, parts.health.rollbacks, stopped=stop.record())
        say(str(stop), rank=worker.rank)
        parts.coordinator.report_divergence(str(stop))
