"""One sweep trial: a Tune driver function that runs the package's normal TorchTrainer path for a
short run at one micro-batch (and activation checkpointing setting, when the sweep tries several;
the Train V2 + Tune pattern), and the worker-side report it needs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Any

from raytrain_fast.errors import RaytrainFastError
from raytrain_fast.microbatch import MemoryBudgetExceeded, classify_error

FAILED_MARK = "[sweep trial failed] "
"""Prefix of a failed trial's reason in Tune's error text (the reason follows it on the same line)."""


class TrialFailed(RaytrainFastError):
    """A trial ended without a result. `str()` carries FAILED_MARK + one line of reason."""


def report_window(*, step: int, metrics: dict[str, float], memory_budget_gb: float | None) -> None:
    """Worker side, on log steps of a sweep trial only: hand the window's metrics to Tune (through
    Ray Train's report and TuneReportCallback), after checking the memory budget.

    Every rank calls it at the same step (report is a barrier). With the controller polling every
    RAY_TRAIN_HEALTH_CHECK_INTERVAL_S and the result queue holding one report, a report costs
    little as long as log windows are longer than that interval.
    """
    import ray.train
    import ray.util

    from raytrain_fast._ray_compat import quiet_train_report_logger

    # Ray Train logs every report's whole metrics dict at INFO: one line per window is printed already.
    quiet_train_report_logger()
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
    """One line saying why a trial's training run failed: out of memory, over budget, or the error
    (the classification autobatch uses too, see raytrain_fast/microbatch/plan.py)."""
    return classify_error(error).reason


def run_trial(params: dict[str, Any], *, base_config: dict[str, Any], data_uri: str, trials_uri: str, prefix: str) -> None:
    """The Tune driver function (in the trial's actor, which holds no CPU: the training workers
    get theirs through Ray Train's own placement group). Any failure becomes TrialFailed with its
    reason, so Tune records a failed trial and the sweep goes on."""
    import ray
    import ray.tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from raytrain_fast.config import Config, validate
    from raytrain_fast.coordinator import start_coordinator
    from raytrain_fast.launch.checks import max_sequences
    from raytrain_fast.launch.trainer import build_trainer

    micro_batch = int(params["micro_batch"])
    checkpointing = params.get("activation_checkpointing")  # only in a sweep over it
    trial_id = ray.tune.get_context().get_trial_id()
    config = Config.from_dict(base_config)
    config = dataclasses.replace(
        config,
        name=trial_run_name(prefix, micro_batch=micro_batch, activation_checkpointing=checkpointing, trial_id=trial_id),
        model=dataclasses.replace(config.model, activation_checkpointing=checkpointing or config.model.activation_checkpointing),
        train=dataclasses.replace(config.train, micro_batch=micro_batch, grad_accum=None),
        storage=dataclasses.replace(config.storage, uri=trials_uri),
    )
    try:
        validate(config)
        _check_data(config, data_uri=data_uri, max_sequences=max_sequences(config))
    except RaytrainFastError as error:
        raise TrialFailed(f"{FAILED_MARK}invalid: {' '.join(str(error).split())[:300]}") from None
    coordinator = start_coordinator(config.name or "trial")
    try:
        # A short measurement run: every log window goes to Tune (early stopping needs intermediate
        # results), no checkpoints.
        # The controller picks up reports when it polls the workers (every 2 s by default) and each
        # worker's result queue holds one: a log window shorter than that would wait in report() and
        # its wait would count in the next window's tokens/s. Ray Train hands the variable to the
        # controller it starts in fit(); set for this trial's fit only.
        with _environment(RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.2"):
            build_trainer(
                config, data_uri=data_uri, save_checkpoints=False, callbacks=[TuneReportCallback()],
                on_window=functools.partial(report_window, memory_budget_gb=config.resources.memory_budget_gb),
            ).fit()
    except Exception as error:  # noqa: BLE001 - every failure is a failed trial with its reason
        raise TrialFailed(f"{FAILED_MARK}{failure_reason(error)}") from None
    finally:
        ray.kill(coordinator)


@contextlib.contextmanager
def _environment(**values: str):
    """Environment variables set (where not set already) for the block only."""
    added = {key: value for key, value in values.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _check_data(config, *, data_uri: str, max_sequences: int | None) -> None:
    from raytrain_fast.data import check_manifest_matches, load_manifest
    from raytrain_fast.errors import ConfigError

    problems = check_manifest_matches(
        load_manifest(data_uri, config.storage), seq_len=config.data.seq_len, vocab_size=config.model.vocab_size,
        micro_batch=config.train.micro_batch, world_size=config.resources.num_workers, max_sequences=max_sequences,
    )
    if problems:
        raise ConfigError(problems)
