"""`raytrain-fast sweep`: Ray Tune over micro-batch x gradient accumulation at the config's global batch.

For each micro-batch m asked for (by default the candidates `train.micro_batch: auto` probes),
accumulation = global_batch / (m x num_workers); combinations that don't divide are skipped with
the reason (one rule for both: raytrain_fast.microbatch). The others are Tune trials (grid
search; with `activation_checkpointing`, over micro-batch x model.activation_checkpointing), each a
short run through the package's run workflow (sweep/trial.py) reporting every log window; a trial
clearly behind stops early (sweep/stopping.py). At most `max_concurrent_trials` run at once.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from raytrain_fast.config import Config
from raytrain_fast.console import say
from raytrain_fast.errors import ConfigError
from raytrain_fast.loop.hooks import LoopHooks
from raytrain_fast.microbatch import classify_error, plan_candidates
from raytrain_fast.plan import RunPlan
from raytrain_fast.sweep.results import (
    ACTIVATION_CHECKPOINTING,
    SweepRow,
    best_config_yaml,
    format_table,
    load_note,
    pick_best,
    resolution,
    row_from_reports,
    to_csv,
    to_json,
)
from raytrain_fast.sweep.trial import FAILED_MARK, trial_run_name

OBJECTIVES = {
    "tokens_per_sec": ("throughput/tokens_per_sec", "max"), "loss": ("train/loss", "min"), "val_loss": ("val/loss", "min"),
}


@dataclass(kw_only=True)
class SweepSpec:
    micro_batches: list[int] | None = None
    """Micro-batches to try (per worker); None: the candidates `train.micro_batch: auto` probes
    (`microbatch.candidate_micro_batches`)."""
    activation_checkpointing: list[str] | None = None
    """model.activation_checkpointing values (none, full, every_n) each micro-batch is tried with;
    None: only the config's own."""
    steps: int = 30
    """Optimizer steps per trial."""
    objective: Literal["tokens_per_sec", "loss", "val_loss"] = "tokens_per_sec"
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
    unresolved: str = ""
    """Why the best trial's lead is within its windows' noise ("" when it is not: results.resolution)."""


def plan(config: Config, micro_batches: list[int] | None) -> tuple[list[tuple[int, int]], list[SweepRow]]:
    """(runnable (micro_batch, grad_accum) pairs, skipped rows with their reason): the shared
    `microbatch.plan_candidates` rule; None tries the candidates `train.micro_batch: auto` would."""
    runnable, skipped = plan_candidates(config.train.global_batch, config.resources.num_workers, micro_batches)
    checkpointing = config.model.activation_checkpointing
    return runnable, [
        SweepRow(micro_batch=m, grad_accum=None, activation_checkpointing=checkpointing, status="skipped", reason=why)
        for m, why in skipped
    ]


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
    # val_loss: an evaluation in every reported window (trials are compared on it window by window), and
    # an error before any trial when the data has no validation split; other objectives need none.
    evaluation = dataclasses.replace(config.eval, enabled=spec.objective == "val_loss", every_steps=log_every, tasks=[])
    return dataclasses.replace(
        config, eval=evaluation,
        train=dataclasses.replace(config.train, steps=spec.steps, log_every=log_every),
        optim=dataclasses.replace(config.optim, warmup_steps=min(config.optim.warmup_steps, spec.steps)),
        resources=dataclasses.replace(config.resources, max_failures=0),  # a trial that fails is a result
        checkpoint=dataclasses.replace(config.checkpoint, resume="auto", init_from=None),
    )


def _write(filesystem, path: str, text: str) -> None:
    with filesystem.open_output_stream(path) as stream:
        stream.write(text.encode())


@dataclass(kw_only=True)
class _Sweep:
    """What run_sweep settles once, before the trials: the name, the plan the trials share, where it writes."""

    name: str
    config: Config
    """As the user gave it (best.yaml is this with the winning split)."""
    plan: RunPlan
    """The trials' base (launch/plan.py): resources resolved, a short run named after the sweep, the prepared data;
    its run directory is the sweep's."""
    concurrency: int


def run_sweep(config: Config, spec: SweepSpec, *, create_bucket: bool = False, hooks: LoopHooks | None = None) -> SweepResult:
    """Plan, validate, prepare the data once, run the Tune trials, write and return the results.
    `hooks`: drills for every trial's loop (tests); a drill's marker file makes it act once per sweep."""
    spec, runnable, skipped = _check(config, spec)
    sweep = _prepare(config, spec, first_micro_batch=runnable[0][0], create_bucket=create_bucket)
    _announce(sweep, spec, runnable, skipped)
    grid = _run_trials(sweep, spec, [m for m, _ in runnable], hooks=hooks)
    rows = skipped + _trial_rows(sweep, grid, dict(runnable))
    best = pick_best(rows, objective=spec.objective)
    unresolved = resolution(rows, objective=spec.objective)
    files, best_path = _write_results(sweep, spec, rows, best, unresolved=unresolved)
    return SweepResult(
        name=sweep.name, uri=sweep.plan.run_uri, rows=rows, best=best, best_config_path=best_path, unresolved=unresolved,
        max_concurrent_trials=sweep.concurrency, table=format_table(rows, notes=[load_note(rows)]), files=files,
    )


def _check(config: Config, spec: SweepSpec) -> tuple[SweepSpec, list[tuple[int, int]], list[SweepRow]]:
    """The spec's options and the plan, before Ray starts: (the spec, its activation checkpointing
    values checked, runnable pairs, skipped rows)."""
    if spec.objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {spec.objective!r}")
    if spec.steps < 2:
        raise ConfigError(f"--steps must be >= 2 (the first log window is warm-up), got {spec.steps}")
    checkpointing = spec.activation_checkpointing
    if checkpointing is not None:
        checkpointing = _checkpointing_values(checkpointing)
        spec = dataclasses.replace(spec, activation_checkpointing=checkpointing)
    runnable, skipped = plan(config, spec.micro_batches)
    if checkpointing is not None:
        for row in skipped:  # one row per skipped micro-batch: skipped whatever the setting
            row.activation_checkpointing = checkpointing[0] if len(checkpointing) == 1 else ""
    if not runnable:
        reasons = "; ".join(f"{r.micro_batch}: {r.reason}" for r in skipped) or (
            f"it is not a multiple of resources.num_workers ({config.resources.num_workers})"
        )
        raise ConfigError(f"no --micro-batch value fits train.global_batch={config.train.global_batch}: {reasons}")
    return spec, runnable, skipped


def _checkpointing_values(values: list[str]) -> list[str]:
    """--activation-checkpointing, checked: known values, each once, in the order given."""
    valid = ", ".join(ACTIVATION_CHECKPOINTING)
    unknown = [v for v in values if v not in ACTIVATION_CHECKPOINTING]
    if unknown or not values:
        got = f"got {', '.join(repr(v) for v in unknown)}" if unknown else "got none"
        raise ConfigError(
            f"--activation-checkpointing takes a comma-separated list of {valid} (model.activation_checkpointing), "
            f"{got}; e.g. --activation-checkpointing none,full"
        )
    return list(dict.fromkeys(values))


def _prepare(config: Config, spec: SweepSpec, *, first_micro_batch: int, create_bucket: bool) -> _Sweep:
    """Check and plan once (with the first runnable micro-batch; the data prepared once), derive the
    concurrency, and create the sweep's directory."""
    import ray

    from raytrain_fast._ray_compat import create_ray_data_cluster_actors
    from raytrain_fast.config.data import SourceConfig
    from raytrain_fast.launch.checks import check_run
    from raytrain_fast.launch.plan import plan_run

    name = spec.name or f"{config.name}-sweep"
    # Named after the sweep, whose directory holds no checkpoints: the resume checks look there, not
    # at the run the sweep is for (which may have checkpoints from another worker count).
    base = dataclasses.replace(
        config, name=name, train=dataclasses.replace(config.train, micro_batch=first_micro_batch, grad_accum=None)
    )
    plan = plan_run(check_run(_trial_config(base, spec), create_bucket=create_bucket))
    for line in plan.lines:  # its summary's batch is the first trial's: the sweep's own line says what it tries
        say(line)
    create_ray_data_cluster_actors()  # on this node, before the trials, whose actors may be on any node
    # The trials read the prepared data: naming it keeps their checks off the user's relative paths, which
    # a trial (in Tune's working directory, maybe on another node) would not find; what prepared it on the
    # fly (a validation split's source) is done. The user's key stays: data.max_tokens applies to data.source.
    data = plan.config.data
    items = [SourceConfig(source=s.manifest.root, weight=s.weight, name=s.name) for s in plan.sources]
    data = dataclasses.replace(data, source=items[0].source, sources=items if data.sources else [], val_fraction=None, val_input=None)
    plan = dataclasses.replace(plan, config=dataclasses.replace(plan.config, data=data))
    cluster = ray.cluster_resources()
    concurrency = max_concurrent_trials(plan.config, cluster_cpus=cluster.get("CPU", 0.0), cluster_gpus=cluster.get("GPU", 0.0))
    if replace_previous_results(plan.filesystem, plan.run_path):
        say(f"Sweep '{name}' ran before: its earlier trials and results in {plan.run_uri} are replaced by this run's.")
    plan.filesystem.create_dir(plan.run_path, recursive=True)
    return _Sweep(name=name, config=config, plan=plan, concurrency=concurrency)


SWEEP_OUTPUTS = ("trials", "tune", "results.csv", "results.json", "best.yaml")
"""What a sweep writes in its directory; a rerun of the same sweep replaces all of it."""


def replace_previous_results(filesystem: Any, path: str) -> bool:
    """Delete an earlier run's outputs of this sweep (SWEEP_OUTPUTS under `path`), so a rerun's
    trial folders do not pile up beside the old ones and every file read afterwards is from one run.
    True when there was something to delete."""
    import pyarrow.fs as pafs

    found = [filesystem.get_file_info(f"{path}/{name}") for name in SWEEP_OUTPUTS]
    for info in found:
        if info.type == pafs.FileType.Directory:
            filesystem.delete_dir(info.path)
        elif info.type == pafs.FileType.File:
            filesystem.delete_file(info.path)
    return any(info.type != pafs.FileType.NotFound for info in found)


def _announce(sweep: _Sweep, spec: SweepSpec, runnable: list[tuple[int, int]], skipped: list[SweepRow]) -> None:
    config = sweep.config
    metric, mode = OBJECTIVES[spec.objective]
    say(
        f"Sweep '{sweep.name}': global batch {config.train.global_batch} sequences "
        f"({config.train.global_batch * config.data.seq_len:,} tokens) on {sweep.plan.config.resources.num_workers} worker(s); "
        f"micro-batches {', '.join(str(m) for m, _ in runnable)}"
        + (f" (skipped: {', '.join(str(r.micro_batch) for r in skipped)})" if skipped else "")
        + (f"; activation checkpointing {', '.join(spec.activation_checkpointing)} with each"
           if spec.activation_checkpointing is not None else "")
        + f"; {spec.steps} steps per trial, {sweep.concurrency} trial(s) at a time, objective {metric} ({mode})"
    )


def _run_trials(sweep: _Sweep, spec: SweepSpec, micro_batches: list[int], *, hooks: LoopHooks | None):
    """One Tune trial per micro-batch (and activation checkpointing setting, when the spec names
    them: grid search over both), sweep.stopping stopping the ones clearly behind."""
    from ray import tune

    from raytrain_fast.sweep.stopping import NoiseAwareStopper, grace_windows
    from raytrain_fast.sweep.trial import run_trial

    plan = sweep.plan
    metric, mode = OBJECTIVES[spec.objective]
    num_windows = math.ceil(plan.config.train.steps / plan.config.train.log_every)
    trainable = tune.with_resources(
        tune.with_parameters(run_trial, base=plan, trials_uri=f"{plan.run_uri}/trials", prefix=sweep.name, hooks=hooks),
        # The driver only waits on fit(): no CPU, or a CPU machine's trial could never get its workers'
        # CPUs (they come from Ray Train's own placement group). Tune needs a non-empty bundle: 1 byte.
        {"CPU": 0, "memory": 1},
    )
    param_space = {"micro_batch": tune.grid_search(micro_batches)}
    if spec.activation_checkpointing is not None:
        param_space["activation_checkpointing"] = tune.grid_search(spec.activation_checkpointing)
    tuner = tune.Tuner(
        trainable,
        param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=metric, mode=mode, max_concurrent_trials=sweep.concurrency,
            scheduler=NoiseAwareStopper(metric=metric, mode=mode, grace=grace_windows(num_windows)),
        ),
        run_config=tune.RunConfig(
            name="tune", storage_path=plan.run_path,
            storage_filesystem=plan.filesystem if plan.remote else None, verbose=0, callbacks=[_release_stopped_trial()],
        ),
    )
    from raytrain_fast._ray_compat import quiet_tune_output
    from raytrain_fast.console import SWEEP_NOISE_WITH_TRACEBACK, quiet_lines

    with quiet_tune_output(), quiet_lines(SWEEP_NOISE_WITH_TRACEBACK):
        return tuner.fit()


def _trial_rows(sweep: _Sweep, grid, accum: dict[int, int]) -> list[SweepRow]:
    """One row per Tune trial, from its reported log windows and its error."""
    rows = []
    for result in grid:
        m = int(result.config["micro_batch"])
        swept = result.config.get("activation_checkpointing")  # only in a sweep over it
        frame = result.metrics_dataframe
        reports = frame.to_dict("records") if frame is not None and len(frame) else []
        reports = [r for r in reports if "step" in r and r.get("step") == r.get("step")]
        trial_id = (result.metrics or {}).get("trial_id")
        rows.append(row_from_reports(
            micro_batch=m, grad_accum=accum[m], reports=reports, steps=sweep.plan.config.train.steps,
            error=_error_reason(result.error) if result.error is not None else None,
            run_name=trial_run_name(sweep.name, micro_batch=m, activation_checkpointing=swept, trial_id=trial_id) if trial_id else "",
            activation_checkpointing=swept or sweep.config.model.activation_checkpointing,
        ))
    return rows


def _write_results(
    sweep: _Sweep, spec: SweepSpec, rows: list[SweepRow], best: SweepRow | None, *, unresolved: str,
) -> tuple[dict[str, str], str | None]:
    """results.csv, results.json and best.yaml in the sweep's directory, and best.yaml locally:
    (what was written where, the local best config or None)."""
    config, resolved, plan = sweep.config, sweep.plan.config, sweep.plan
    summary = {
        "sweep": sweep.name, "objective": spec.objective, "global_batch": config.train.global_batch,
        "seq_len": config.data.seq_len, "num_workers": resolved.resources.num_workers,
        "steps_per_trial": spec.steps, "max_concurrent_trials": sweep.concurrency,
        "device": "gpu" if resolved.resources.use_gpu else "cpu", "precision": resolved.engine.precision,
        "best_micro_batch": best.micro_batch if best else None, "resolved": not unresolved, "unresolved": unresolved,
        "load_per_cpu": [r.load_per_cpu for r in rows if r.load_per_cpu is not None],
    }
    if spec.activation_checkpointing is not None:
        summary.update(
            activation_checkpointing=spec.activation_checkpointing,
            best_activation_checkpointing=best.activation_checkpointing if best else None,
        )
    files = {"csv": f"{plan.run_uri}/results.csv", "json": f"{plan.run_uri}/results.json"}
    _write(plan.filesystem, f"{plan.run_path}/results.csv", to_csv(rows))
    _write(plan.filesystem, f"{plan.run_path}/results.json", to_json(rows, summary=summary))
    if best is None:
        return files, None
    text = best_config_yaml(config, best, sweep_name=sweep.name, objective=spec.objective)
    in_storage = f"{plan.run_path}/best.yaml"
    _write(plan.filesystem, in_storage, text)
    files["best"] = f"{plan.run_uri}/best.yaml"
    best_path = spec.best_config_out or (f"{sweep.name}-best.yaml" if plan.remote else in_storage)
    if best_path != in_storage:
        Path(best_path).write_text(text)
    return files, best_path


def _release_stopped_trial():
    """A Tune callback that frees the placement group of a trial's training workers when the trial
    ends. When the scheduler stops a trial, Tune ends the trial's actor and with it the Train controller;
    Ray Train's own cleaner then frees the workers' placement group only where it can reach Ray's
    state API (the dashboard). Without this, the next trial could wait forever for those CPUs/GPUs.
    Trials that ran to the end have freed it already (removing it again does nothing)."""
    from ray import tune

    class _ReleaseStoppedTrial(tune.Callback):
        def release_group(self, trial) -> None:
            from raytrain_fast._ray_compat import remove_placement_group_by_hex

            group_id = (trial.last_result or {}).get("placement_group_id")
            if group_id:
                remove_placement_group_by_hex(group_id)

        def on_trial_complete(self, iteration, trials, trial, **info):
            self.release_group(trial)

        def on_trial_error(self, iteration, trials, trial, **info):
            self.release_group(trial)

    return _ReleaseStoppedTrial()


def _error_reason(error: BaseException) -> str:
    """The trial's own reason (TrialFailed, classified in the trial) out of Tune's wrapped error
    text; else (the trial's actor itself died: killed for memory, ...) the shared classification."""
    for line in str(error).splitlines():
        if FAILED_MARK in line:
            return line.split(FAILED_MARK, 1)[1].strip()
    return classify_error(error).reason
