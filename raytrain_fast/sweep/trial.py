"""One sweep trial: a Tune driver function that takes the checks and the run workflow every run takes
(`launch.checks.check_run`, `launch.trainer.fit_run`: coordinator, hang watchdog, TorchTrainer) for a short run at one
micro-batch (and activation checkpointing setting, when the sweep tries several; the Train V2 +
Tune pattern), and the worker-side report it needs."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from raytrain_fast.errors import RaytrainFastError
from raytrain_fast.loop.hooks import LoopHooks
from raytrain_fast.microbatch import MemoryBudgetExceeded, classify_error
from raytrain_fast.plan import RunPlan

FAILED_MARK = "[sweep trial failed] "
"""Prefix of a failed trial's reason in Tune's error text (the reason follows it on the same line)."""


class TrialFailed(RaytrainFastError):
    """A trial ended without a result. `str()` carries FAILED_MARK + one line of reason."""


def report_window(*, step: int, metrics: dict[str, float], memory_budget_gb: float | None) -> None:
    """Worker side, on log steps of a sweep trial only: hand the window's metrics to Tune (through
    Ray Train's report and TuneReportCallback), after checking the memory budget. Every rank calls it
    at the same step (report is a barrier; TRIAL_POLL_S keeps it short)."""
    import ray.train
    import ray.util

    from raytrain_fast._ray_compat import quiet_train_report_logger

    quiet_train_report_logger()  # one line per window is printed already
    peak = metrics.get("memory/peak_gb")
    if memory_budget_gb is not None and peak is not None and peak > memory_budget_gb:
        raise MemoryBudgetExceeded(
            f"peak memory {peak:.3f} GB > resources.memory_budget_gb {memory_budget_gb:.3f} GB at step {step}"
        )
    report: dict[str, Any] = {"step": step, **metrics}
    group = ray.util.get_current_placement_group()
    if group is not None:  # lets the sweep free it if Tune stops this trial (see runner._ReleaseStoppedTrial)
        report["placement_group_id"] = group.id.hex()
    ray.train.report(report)


def trial_run_name(prefix: str, *, micro_batch: int, activation_checkpointing: str | None, trial_id: str) -> str:
    """The run name of a trial (its metrics under the sweep's trials/): unique by Tune's trial id,
    readable by its micro-batch and, when the sweep tries several, its activation checkpointing."""
    checkpointing = f"-ac-{activation_checkpointing}" if activation_checkpointing else ""
    return f"{prefix}-mb{micro_batch}{checkpointing}-{trial_id}"


def failure_reason(error: BaseException) -> str:
    """One line saying why a trial's training run failed: a hang the watchdog ended (before the
    classification, which would read the killed worker as out of memory), out of memory, over
    budget, or the error (the classification autobatch uses too, see raytrain_fast/microbatch/plan.py)."""
    from raytrain_fast.launch.trainer import HungRun

    if isinstance(error, HungRun):
        return str(error)
    return classify_error(error).reason


TRIAL_POLL_S = 0.2
"""Ray Train's controller polls a trial's workers this often (its default, 2 s, is longer than a
trial's log window): it takes each report when it polls and each worker's result queue holds one,
so a shorter window would wait in report() and that wait would count in the next window's tokens/s."""


def run_trial(
    params: dict[str, Any], *, base: RunPlan, trials_uri: str, prefix: str, hooks: LoopHooks | None = None,
) -> None:
    """The Tune driver function (in the trial's actor, which holds no CPU: the training workers
    get theirs through Ray Train's own placement group): the trial's run checked as every run is
    (`launch.checks.check_run`) and planned from the sweep's plan, then the run workflow every run
    takes (`launch.trainer.fit_run`: coordinator, hang watchdog, trainer) for a short measurement run
    that reports every log window to Tune and saves no checkpoint. Any failure becomes TrialFailed with
    its reason, so Tune records a failed trial and the sweep goes on. `hooks`: drills for the trials' loops (tests)."""
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_fast.launch.checks import check_run
    from raytrain_fast.launch.plan import trial_plan
    from raytrain_fast.launch.trainer import fit_run

    micro_batch = int(params["micro_batch"])
    checkpointing = params.get("activation_checkpointing")  # only in a sweep over it
    trial_id = ray.tune.get_context().get_trial_id()
    config = base.config
    config = dataclasses.replace(
        config,
        name=trial_run_name(prefix, micro_batch=micro_batch, activation_checkpointing=checkpointing, trial_id=trial_id),
        model=dataclasses.replace(config.model, activation_checkpointing=checkpointing or config.model.activation_checkpointing),
        train=dataclasses.replace(config.train, micro_batch=micro_batch, grad_accum=None),
        storage=dataclasses.replace(config.storage, uri=trials_uri),
    )
    try:  # the sweep's plan on its prepared data, at this micro-batch
        plan = trial_plan(base, check_run(config))
    except RaytrainFastError as error:
        raise TrialFailed(f"{FAILED_MARK}invalid: {' '.join(str(error).split())[:300]}") from None
    try:
        fit_run(
            plan, hooks=hooks, save_checkpoints=False, callbacks=[TuneReportCallback()],
            on_window=functools.partial(report_window, memory_budget_gb=config.resources.memory_budget_gb),
            controller_poll_s=TRIAL_POLL_S,
        )
    except Exception as error:  # noqa: BLE001 - every failure is a failed trial with its reason
        raise TrialFailed(f"{FAILED_MARK}{failure_reason(error)}") from None
