"""`raytrain-fast sweep`: Ray Tune over micro-batch x gradient accumulation at the config's global batch.

For each micro-batch m asked for, accumulation = global_batch / (m x num_workers); combinations that
don't divide are skipped with the reason. The others are Tune trials (grid search), each a short
TorchTrainer run through the package's normal path (see sweep/trial.py) reporting every log window;
ASHA stops trials that are slower (or, objective=loss, worse) than the others at a rung. At most
`max_concurrent_trials` run at once, derived from what one trial's workers need, so trials never
wait on each other's placement groups (on a CPU machine that is one trial at a time, which also
keeps one trial's timing free of another's load).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from raytrain_fast.config import Config
from raytrain_fast.errors import ConfigError
from raytrain_fast.sweep.results import (
    SweepRow,
    best_config_yaml,
    format_table,
    pick_best,
    row_from_reports,
    to_csv,
    to_json,
)
from raytrain_fast.sweep.trial import FAILED_MARK

OBJECTIVES = {"tokens_per_sec": ("throughput/tokens_per_sec", "max"), "loss": ("train/loss", "min")}


@dataclass(kw_only=True)
class SweepSpec:
    micro_batches: list[int]
    """Micro-batches to try (per worker)."""
    steps: int = 30
    """Optimizer steps per trial."""
    objective: Literal["tokens_per_sec", "loss"] = "tokens_per_sec"
    name: str | None = None
    """Directory of the sweep under storage.uri; default `<run name>-sweep`."""
    num_reports: int = 6
    """Log windows (Tune results) per trial: train.log_every = steps // num_reports."""
    best_config_out: str | None = None
    """Also write the best config to this local file (default: next to the results when storage is
    local, else `./<sweep name>-best.yaml`)."""


@dataclass(kw_only=True)
class SweepResult:
    name: str
    uri: str
    """`<storage.uri>/<sweep name>`: results.csv, results.json, best.yaml, trials/, tune/."""
    rows: list[SweepRow]
    best: SweepRow | None
    best_config_path: str | None
    """A local file for `raytrain-fast pretrain --config`; None when no trial finished."""
    max_concurrent_trials: int
    table: str = ""
    files: dict[str, str] = field(default_factory=dict)


def plan(config: Config, micro_batches: list[int]) -> tuple[list[tuple[int, int]], list[SweepRow]]:
    """(runnable (micro_batch, grad_accum) pairs, skipped rows with their reason)."""
    global_batch, workers = config.train.global_batch, config.resources.num_workers
    runnable: list[tuple[int, int]] = []
    skipped: list[SweepRow] = []
    for m in sorted(set(micro_batches)):
        per_step = m * workers
        if m <= 0:
            skipped.append(SweepRow(micro_batch=m, grad_accum=None, status="skipped", reason="micro-batch must be > 0"))
        elif global_batch % per_step:
            skipped.append(SweepRow(
                micro_batch=m, grad_accum=None, status="skipped",
                reason=f"global batch {global_batch} is not a multiple of {m} x {workers} worker(s) = {per_step}",
            ))
        else:
            runnable.append((m, global_batch // per_step))
    return runnable, skipped


def max_concurrent_trials(config: Config, *, cluster_cpus: float, cluster_gpus: float) -> int:
    """How many trials fit on the cluster at once. A trial's driver and Train controller hold no CPU;
    its workers hold num_workers x (cpus_per_worker CPUs + a GPU when on GPUs)."""
    r = config.resources
    limits = [math.floor(cluster_cpus / (r.num_workers * r.cpus_per_worker))] if r.cpus_per_worker > 0 else []
    if r.use_gpu:
        limits.append(math.floor(cluster_gpus / r.num_workers))
    return max(1, min(limits)) if limits else 1


def _trial_config(config: Config, spec: SweepSpec) -> Config:
    """The short, checkpoint-free run each trial makes (micro_batch filled in per trial)."""
    log_every = max(1, spec.steps // max(1, spec.num_reports))
    return dataclasses.replace(
        config,
        train=dataclasses.replace(config.train, steps=spec.steps, log_every=log_every),
        optim=dataclasses.replace(config.optim, warmup_steps=min(config.optim.warmup_steps, spec.steps)),
        resources=dataclasses.replace(config.resources, max_failures=0),  # a trial that fails is a result
        checkpoint=dataclasses.replace(config.checkpoint, resume="auto", init_from=None),
    )


def _write(filesystem, path: str, text: str) -> None:
    with filesystem.open_output_stream(path) as stream:
        stream.write(text.encode())


def run_sweep(config: Config, spec: SweepSpec, *, create_bucket: bool = False) -> SweepResult:
    """Plan, validate, prepare the data once, run the Tune trials, write and return the results."""
    if spec.objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {spec.objective!r}")
    if spec.steps < 2:
        raise ConfigError(f"--steps must be >= 2 (the first log window is warm-up), got {spec.steps}")
    runnable, skipped = plan(config, spec.micro_batches)
    if not runnable:
        reasons = "; ".join(f"{r.micro_batch}: {r.reason}" for r in skipped)
        raise ConfigError(f"no --micro-batch value fits train.global_batch={config.train.global_batch}: {reasons}")
    sweep_name = spec.name or f"{config.name}-sweep"
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from raytrain_fast.launch.trainer import prepare_training_data, resolve_resources
    from raytrain_fast.storage import resolve_filesystem
    from raytrain_fast.sweep.trial import run_trial

    # Validated (and use_gpu / CPUs / precision resolved) once, with the first runnable micro-batch.
    first_m = runnable[0][0]
    # Named after the sweep, whose directory holds no checkpoints: the resume checks look there, not
    # at the run the sweep is for (which may have checkpoints from another worker count).
    base = dataclasses.replace(
        config, name=sweep_name, train=dataclasses.replace(config.train, micro_batch=first_m, grad_accum=None)
    )
    resolved = resolve_resources(_trial_config(base, spec), create_bucket=create_bucket)
    data_uri = prepare_training_data(resolved)
    cluster = ray.cluster_resources()
    concurrency = max_concurrent_trials(resolved, cluster_cpus=cluster.get("CPU", 0.0), cluster_gpus=cluster.get("GPU", 0.0))

    filesystem, root = resolve_filesystem(resolved.storage.uri, resolved.storage)
    sweep_path = f"{root.rstrip('/')}/{sweep_name}"
    scheme = "s3://" if resolved.storage.uri.startswith("s3://") else ""
    sweep_uri = f"{scheme}{sweep_path}"
    filesystem.create_dir(sweep_path, recursive=True)
    metric, mode = OBJECTIVES[spec.objective]
    # One more than the reports a trial makes: a trial that runs to the end returns from fit() by
    # itself (its Train run then frees its workers), instead of being stopped by ASHA at max_t.
    max_t = math.ceil(resolved.train.steps / resolved.train.log_every) + 1
    print(
        f"Sweep '{sweep_name}': global batch {config.train.global_batch} sequences "
        f"({config.train.global_batch * config.data.seq_len:,} tokens) on {resolved.resources.num_workers} worker(s); "
        f"micro-batches {', '.join(str(m) for m, _ in runnable)}"
        + (f" (skipped: {', '.join(str(r.micro_batch) for r in skipped)})" if skipped else "")
        + f"; {spec.steps} steps per trial, {concurrency} trial(s) at a time, objective {metric} ({mode})",
        flush=True,
    )

    trainable = tune.with_resources(
        tune.with_parameters(
            run_trial, base_config=resolved.to_dict(), data_uri=data_uri,
            trials_uri=f"{resolved.storage.uri.rstrip('/')}/{sweep_name}/trials", prefix=sweep_name,
        ),
        # The driver only waits on fit(): no CPU, or a CPU machine's trial could never get its workers'
        # CPUs (they come from Ray Train's own placement group). Tune needs a non-empty bundle: 1 byte.
        {"CPU": 0, "memory": 1},
    )
    tuner = tune.Tuner(
        trainable,
        param_space={"micro_batch": tune.grid_search([m for m, _ in runnable])},
        tune_config=tune.TuneConfig(
            metric=metric, mode=mode, max_concurrent_trials=concurrency,
            scheduler=ASHAScheduler(time_attr="training_iteration", max_t=max_t, grace_period=min(2, max_t - 1), reduction_factor=2),
        ),
        run_config=tune.RunConfig(
            name="tune", storage_path=sweep_path,
            storage_filesystem=filesystem if scheme else None, verbose=0, callbacks=[_release_stopped_trial()],
        ),
    )
    grid = tuner.fit()

    accum = dict(runnable)
    rows = list(skipped)
    for result in grid:
        m = int(result.config["micro_batch"])
        frame = result.metrics_dataframe
        reports = frame.to_dict("records") if frame is not None and len(frame) else []
        reports = [r for r in reports if "step" in r and r.get("step") == r.get("step")]
        trial_id = (result.metrics or {}).get("trial_id")
        rows.append(row_from_reports(
            micro_batch=m, grad_accum=accum[m], reports=reports, steps=resolved.train.steps,
            error=_error_reason(result.error) if result.error is not None else None,
            run_name=f"{sweep_name}-mb{m}-{trial_id}" if trial_id else "",
        ))
    best = pick_best(rows, objective=spec.objective)
    table = format_table(rows)

    summary = {
        "sweep": sweep_name, "objective": spec.objective, "global_batch": config.train.global_batch,
        "seq_len": config.data.seq_len, "num_workers": resolved.resources.num_workers,
        "steps_per_trial": spec.steps, "max_concurrent_trials": concurrency,
        "device": "gpu" if resolved.resources.use_gpu else "cpu", "precision": resolved.engine.precision,
        "best_micro_batch": best.micro_batch if best else None,
    }
    files = {"csv": f"{sweep_uri}/results.csv", "json": f"{sweep_uri}/results.json"}
    _write(filesystem, f"{sweep_path}/results.csv", to_csv(rows))
    _write(filesystem, f"{sweep_path}/results.json", to_json(rows, summary=summary))
    best_path = None
    if best is not None:
        text = best_config_yaml(config, best, sweep_name=sweep_name, objective=spec.objective)
        _write(filesystem, f"{sweep_path}/best.yaml", text)
        files["best"] = f"{sweep_uri}/best.yaml"
        if spec.best_config_out:
            best_path = spec.best_config_out
        elif not scheme:
            best_path = f"{sweep_path}/best.yaml"
        else:
            best_path = f"{sweep_name}-best.yaml"
        if best_path != f"{sweep_path}/best.yaml":
            Path(best_path).write_text(text)
    return SweepResult(
        name=sweep_name, uri=sweep_uri, rows=rows, best=best, best_config_path=best_path,
        max_concurrent_trials=concurrency, table=table, files=files,
    )


def _release_stopped_trial():
    """A Tune callback that frees the placement group of a trial's training workers when the trial
    ends. When ASHA stops a trial, Tune ends the trial's actor and with it the Train controller;
    Ray Train's own cleaner then frees the workers' placement group only where it can reach Ray's
    state API (the dashboard). Without this, the next trial could wait forever for those CPUs/GPUs.
    Trials that ran to the end have freed it already (removing it again does nothing)."""
    from ray import tune

    class _ReleaseStoppedTrial(tune.Callback):
        def _release(self, trial) -> None:
            from ray._raylet import PlacementGroupID
            from ray.util.placement_group import PlacementGroup, remove_placement_group

            group_id = (trial.last_result or {}).get("placement_group_id")
            if not group_id:
                return
            try:
                remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
            except Exception:  # noqa: BLE001 - already removed
                pass

        def on_trial_complete(self, iteration, trials, trial, **info):
            self._release(trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            self._release(trial)

    return _ReleaseStoppedTrial()


def _error_reason(error: BaseException) -> str:
    """The trial's own reason (TrialFailed) out of Tune's wrapped error text."""
    text = str(error)
    for line in text.splitlines():
        if FAILED_MARK in line:
            return line.split(FAILED_MARK, 1)[1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[-1][:200] if lines else ''}"
