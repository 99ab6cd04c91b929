"""The steps of one worker, from the first to train.steps or an agreed stop.

`run_steps` is the table of contents of a step; `StepRun` runs it over the parts (loop/parts.py
`LoopParts`), and each part says whether this step is its step: the metrics whether it is a log
step, the checkpointer whether a save is due by its cadence, the preemption notice whether its save
is due, the health check whether the state may be saved, the evaluator whether an evaluation is due.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from raytrain_fast.console import say
from raytrain_fast.engine.step import train_step
from raytrain_fast.loop.preemption import PreemptionNotice

if TYPE_CHECKING:
    from raytrain_fast.loop.parts import LoopParts
    from raytrain_fast.loop.worker import Worker


class Notice(enum.IntFlag):
    """What one rank knows on a log step and every rank must act on at the same step: sent as bit
    flags in the log step's one collective (metrics/agreement.py)."""

    CHECKPOINT_TIME = 1  # this rank's checkpoint.every_minutes timer is due
    STOP = 2  # the driver got a stop notice (SIGTERM / Ctrl-C): save now and stop
    PREEMPTED = 4  # Ray is draining a node of the run: save now and go on (loop/preemption.py)


def run_steps(worker: Worker, parts: LoopParts) -> None:
    """The steps, up to train.steps or an agreed stop. The order of events on a step:

    1. train: grad_accum micro-batches and the optimizer step, with no host sync;
    2. on log steps, the agreement: ONE collective drains the window's metrics and carries each
       rank's notices (checkpoint timer due, stop, preemption), so every rank acts alike; the
       health check then reads the window (it may raise Rollback or DivergenceStop, every rank alike);
    3. whether to save: the checkpointer's cadence, an agreed notice, and the health check's consent;
    4. an evaluation, on its cadence and before every save on a log step (the checkpoint's metrics
       then carry a fresh val/loss);
    5. the window callback (a sweep trial's report);
    6. the save;
    7. an agreed stop ends the steps."""
    run = StepRun(worker=worker, parts=parts)
    while parts.state.step < worker.config.train.steps:
        step = run.train()
        logged = run.agree(step)
        saving = run.is_save_step(step, logged=logged)
        run.evaluate(step, logged=logged, saving=saving)
        run.report(step, logged=logged)
        if saving:
            run.save(step)
        if run.agreed & Notice.STOP:
            return run.stop(step)
    parts.checkpointer.finish()


@dataclass(kw_only=True)
class StepRun:
    """One pass of the steps over the parts (loop/parts.py), one method per event of a step (see `run_steps`)."""

    worker: Worker
    parts: LoopParts
    preemption: PreemptionNotice = field(default_factory=PreemptionNotice)
    agreed: Notice = Notice(0)
    """The notices any rank raised at this step's agreement (none on steps that are not log steps)."""

    def __post_init__(self) -> None:
        state = self.parts.state
        self.batches = self.worker.hooks.batches(self.parts.data, current_step=lambda: state.step)
        self.start_step, self.last = state.step, {}
        self.on_notice = False

    def train(self) -> int:
        """One optimizer step; the step count, tokens, metrics and drills move on."""
        worker, parts, hooks = self.worker, self.parts, self.worker.hooks
        with parts.metrics.compile_timer(parts.state.step + 1, active=parts.compiled):
            train_step(parts.engine, self.batches, grad_accum=worker.grad_accum, metrics=parts.metrics,
                       on_batch=hooks.on_batch, on_loss=hooks.on_loss)
        parts.compiled = False
        parts.state.step += 1
        parts.state.tokens += worker.tokens_per_step
        parts.metrics.end_step(parts.state.step)
        hooks.after_step(parts.state.step)
        return parts.state.step

    def agree(self, step: int) -> bool:
        """On a log step: the one collective, with this rank's notices; then the health check. Returns
        whether this is a log step."""
        parts = self.parts
        self.agreed = Notice(0)
        if not parts.metrics.is_log_step(step):
            return False
        mine = Notice(0)
        if parts.checkpointer.due_by_time():
            mine |= Notice.CHECKPOINT_TIME
        if self.worker.rank == 0 and parts.coordinator.stop_requested():
            mine |= Notice.STOP
        if self.preemption.flag():
            mine |= Notice.PREEMPTED
        self.last = parts.metrics.log(step, lr=parts.engine.get_lr()[0], flags=int(mine), epoch=parts.data.epochs)
        self.agreed = Notice(parts.metrics.agreed_flags)
        parts.metrics.emit(step, parts.data.source_metrics(seq_len=self.worker.config.data.seq_len))  # tokens per source
        parts.health.check_window(step, self.last, parts.metrics)
        return True

    def is_save_step(self, step: int, *, logged: bool) -> bool:
        parts = self.parts
        if not parts.save_checkpoints:
            return False
        self.on_notice = self.preemption.save_due(bool(self.agreed & Notice.PREEMPTED))
        due = (
            parts.checkpointer.due_by_steps(step, self.worker.config.train.steps)
            or bool(self.agreed & (Notice.CHECKPOINT_TIME | Notice.STOP)) or self.on_notice
        )
        return due and parts.health.may_save(step, parts.metrics, logged=logged)

    def evaluate(self, step: int, *, logged: bool, saving: bool) -> None:
        parts = self.parts
        if parts.evaluator.due(step, logged=logged, saving=saving):
            self.last = {**self.last, **parts.evaluator.run(parts.engine, parts.metrics, step=step, tokens=parts.state.tokens)}

    def report(self, step: int, *, logged: bool) -> None:
        if logged and self.parts.on_window is not None:
            self.parts.on_window(step=step, metrics=self.last)

    def save(self, step: int) -> None:
        parts, state = self.parts, self.parts.state
        parts.heartbeat.pause("save")  # a save's time depends on the storage: the hang watchdog leaves it alone
        state.data_position, state.health = parts.data.position.to_dict(), parts.health.state_record()
        blocked_s = parts.checkpointer.save(
            parts.engine, state, metrics={"step": step, "tokens": state.tokens, "start_step": self.start_step, **self.last}
        )
        if self.on_notice:  # the node may go at its deadline: this checkpoint must be in storage first
            parts.checkpointer.wait_for_upload()
            values = self.preemption.saved()
            say(self.preemption.message(step=step, metrics=values), rank=self.worker.rank)
            parts.metrics.emit(step, values)
        parts.metrics.record_checkpoint(blocked_s=blocked_s, upload_s=parts.checkpointer.take_upload_s())
        parts.metrics.flush_sinks()

    def stop(self, step: int) -> None:
        parts = self.parts
        parts.checkpointer.finish()
        if self.worker.rank == 0:
            saved = f"saved a checkpoint at step {step}" if parts.save_checkpoints else "no checkpoint (a sweep trial)"
            say(
                f"Stop requested ({parts.coordinator.stop_requested() or 'notice'}): {saved} and stopped. "
                "The same command continues from there.", rank=self.worker.rank,
            )
