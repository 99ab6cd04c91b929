"""The run's plan (raytrain_fast/plan.py), resolved once on the driver after the checks
(launch/checks.py): on the cluster, the resources and the precision measured where the workers run,
the micro-batch, the batch of every worker count, the data prepared once with its manifests read
once, the evaluation and the tasks for it; its lines are the run's start-up lines."""

from __future__ import annotations

import dataclasses
import logging

from raytrain_fast.config import Config, validate
from raytrain_fast.config.train import Batch
from raytrain_fast.engine import resolve_precision
from raytrain_fast.errors import ConfigError
from raytrain_fast.launch.checks import Checked
from raytrain_fast.launch.ray_address import ensure_ray
from raytrain_fast.plan import RunPlan, batch_table
from raytrain_fast.storage.filesystem import checksum_env

logger = logging.getLogger("raytrain_fast")

DEFAULT_EVERY_STEPS = 100
"""eval.every_steps when it is null and checkpoints are saved by time only."""


def plan_run(checked: Checked) -> RunPlan:
    """The plan of a checked run (Ray joined, or a local instance started); its lines are the caller's to print."""
    from raytrain_fast.data.mixture import check_sources, prepare_sources
    from raytrain_fast.downstream.run import encode_run_tasks

    config, lines = on_the_cluster(checked.config, announce_precision=checked.state is None)
    if config.train.micro_batch == "auto":
        from raytrain_fast.microbatch.auto import resolve_micro_batch

        config = resolve_micro_batch(config)  # measured in fresh processes (or cached); its lines as it measures
    config, batches = with_batches(config)
    full = batches[config.resources.num_workers]
    cache_dir = config.data.cache_dir or f"{config.storage.uri.rstrip('/')}/_prepared"
    sources = check_sources(config, prepared=prepare_sources(config, cache_dir=cache_dir), loaded=checked.sources)
    config, eval_lines = resolve_eval(config, sources)
    tasks, task_lines = encode_run_tasks(checked.tasks, config, sources[0].manifest, every_steps=config.eval.every_steps)
    snapshot, r = checked.snapshot, config.resources
    workers = f"{r.min_workers}-{r.num_workers} workers (elastic)" if r.elastic else f"{r.num_workers} worker(s)"
    return RunPlan(
        config=config, run_uri=snapshot.run_uri, filesystem=snapshot.filesystem, run_path=snapshot.run_path, batches=batches,
        sources=sources, tasks=tasks, resume_step=checked.state.step if checked.state else None,
        summary=f"Run '{config.name}': {workers}, micro_batch {full.micro_batch} x grad_accum {full.grad_accum} "
                f"per worker (global batch {full.global_batch} sequences), storage {snapshot.run_uri}",
        lines=(*checked.lines, *lines, *data_lines(config, sources, full), *eval_lines, *task_lines),
    )


def trial_plan(base: RunPlan, checked: Checked) -> RunPlan:
    """A sweep trial's plan: the sweep's (resources, precision, data, evaluation) for the trial's own
    run, checked by `check_run`: its name, storage and batch."""
    config, batches = with_batches(checked.config)
    snapshot = checked.snapshot
    return dataclasses.replace(base, config=config, run_uri=snapshot.run_uri, filesystem=snapshot.filesystem,
                               run_path=snapshot.run_path, batches=batches, summary="", lines=())


def with_batches(config: Config) -> tuple[Config, dict[int, Batch]]:
    """(config with train.micro_batch and grad_accum those of resources.num_workers, the batch table)."""
    table = batch_table(config)
    full = table[config.resources.num_workers]
    train = dataclasses.replace(config.train, micro_batch=full.micro_batch, grad_accum=full.grad_accum)
    return dataclasses.replace(config, train=train), table


def data_lines(config: Config, sources: list, batch: Batch) -> list[str]:
    """The data's line (each source's share, sequences and place), and a warning when a source would
    be repeated many times."""
    from raytrain_fast.data.corpus import repetition_warning

    total = sum(s.weight for s in sources)
    parts = ", ".join(f"{s.name} {s.weight / total:.0%} ({s.num_sequences:,} from {s.manifest.root})" for s in sources)
    lines = [f"Data: {sum(s.num_sequences for s in sources):,} sequences of {config.data.seq_len + 1} tokens: {parts}"]
    most = max(sources, key=lambda s: s.weight / total / s.num_sequences)  # the most repeated
    if warning := repetition_warning(sequences_per_epoch=most.num_sequences, steps=config.train.steps,
                                     global_batch=batch.global_batch, share=most.weight / total):
        lines.append(warning)
    return lines


def resolve_eval(config: Config, sources: list) -> tuple[Config, list[str]]:
    """(config with eval.enabled, every_steps and checkpoint.best_metric concrete, the lines
    to print). Each source with a validation split gives eval.sequences of it (all of it when it holds
    fewer). Raises ConfigError for what was asked explicitly and cannot be done."""
    e = config.eval
    split = {s.name: s.manifest.validation.num_sequences if s.manifest.validation else 0 for s in sources}
    bare = [s for s in sources if not split[s.name]]
    where = ", ".join(s.manifest.root or "the prepared data" for s in bare)
    redo = "Prepare it again with `raytrain-fast prepare-data ... --val-fraction 0.005` (or --val-input)"
    if e.enabled is True and len(bare) == len(sources):
        raise ConfigError(f"eval.enabled=true, but {where} has no validation split (prepared before splits existed, or "
                          f"its split came out empty). {redo}, or set eval.enabled=false")
    enabled, lines = len(bare) < len(sources) and e.enabled is not False, []
    if e.enabled == "auto" and not enabled:
        lines.append(f"Eval: off: {where} has no validation split (prepared before splits existed, or too few documents); "
                     "prepare it again to get val/loss (prepare-data --val-fraction, or for a source prepared on the fly "
                     "--set data.val_fraction=0.1 or data.val_input=<files>).")
    small = {name: count for name, count in split.items() if 0 < count < e.sequences}
    held = ", ".join(f"{name} ({count} sequences)" for name, count in small.items())
    if enabled and small and e.enabled is True:
        raise ConfigError(f"eval.sequences ({e.sequences}) is larger than the validation split of {held}; set "
                          f"eval.sequences <= {min(small.values())}, or prepare a larger split (--val-fraction, --val-input)")
    if enabled and small:
        lines.append(f"Eval: eval.sequences={e.sequences}, but the validation split of {held} holds fewer: evaluating all of it.")
    best = config.checkpoint.best_metric
    if best == "auto":
        best = "val/loss" if enabled else "train/loss"
    elif best.startswith("val/") and not enabled and config.checkpoint.keep_best > 0:
        raise ConfigError(f"checkpoint.best_metric={best} ranks checkpoints by evaluation, but evaluation is off; turn it "
                          "on (eval.enabled, a prepared validation split) or set checkpoint.best_metric=train/loss")
    every = e.every_steps or config.checkpoint.every_steps or DEFAULT_EVERY_STEPS
    if enabled:
        counts = {name: min(count, e.sequences) for name, count in split.items() if count}
        each = ", ".join(f"{name} {count}" for name, count in counts.items())
        lines.append(f"Eval: {sum(counts.values())} validation sequences ({each}) every {every} steps (and before each "
                     f"checkpoint saved on a log step); keep_best ranks by {best}.")
    if enabled and bare:
        lines.append(
            f"Eval: val/loss covers {', '.join(counts)} only (their weights renormalised): {', '.join(s.name for s in bare)} "
            f"{'has' if len(bare) == 1 else 'have'} no validation split, so none of its text is evaluated; prepare it with a "
            "split (prepare-data --val-fraction, or data.val_fraction for a source prepared on the fly) to include it."
        )
    evaluation = dataclasses.replace(e, enabled=enabled, every_steps=every)
    return dataclasses.replace(config, eval=evaluation, checkpoint=dataclasses.replace(config.checkpoint, best_metric=best)), lines


def on_the_cluster(config: Config, *, announce_precision: bool = True) -> tuple[Config, list[str]]:
    """Ray joined (or started), `auto` resources filled in from the cluster and everything validated
    against it, the precision measured where the workers run: (the config, the precision's line).
    announce_precision: say the precision set (a resumed run's said what it kept: launch/resume.py)."""
    import ray

    ensure_ray(checksum_env(config.storage))
    check_storage_on_cluster(config)
    cluster = ray.cluster_resources()
    cpus, gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    validate(config, cluster_cpus=cpus, cluster_gpus=gpus)
    resources, lines = config.resources, []
    needed = resources.fewest_workers  # an elastic run starts with what the cluster holds, from min_workers on
    use_gpu = gpus >= needed if resources.use_gpu == "auto" else bool(resources.use_gpu)
    if resources.use_gpu == "auto" and 0 < gpus < needed:
        lines.append(f"Warning: the cluster has {gpus:g} GPUs for {needed} workers, so resources.use_gpu=auto trains on CPUs. "
                     "Lower resources.num_workers to use the GPUs.")
    share = max(1, int(cpus // resources.num_workers))  # cpus_per_worker 0: an even share of the cluster, at most 4 on GPUs
    cpus_per_worker = resources.cpus_per_worker or (min(4, share) if use_gpu else share)
    precision = config.engine.precision
    if precision in ("auto", "fp8"):  # measured (fp8: checked) where the workers run: the driver may have no GPU, or another CPU
        precision, reason = resolve_precision_on_a_worker(precision, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker)
        logger.info("precision: %s (%s)", precision, reason)
        if announce_precision or config.engine.precision == "auto":
            lines.append(f"Precision: {precision} ({reason})")
    elif announce_precision:
        lines.append(f"Precision: {precision} (engine.precision={precision}, set explicitly)")
    return dataclasses.replace(
        config, resources=dataclasses.replace(resources, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker),
        engine=dataclasses.replace(config.engine, precision=precision),
    ), lines


def check_storage_on_cluster(config: Config) -> None:
    """A local storage.uri or data.cache_dir on a Ray cluster of several nodes is refused (unless
    storage.shared), before any worker starts: see storage.config.multi_node_storage_problems."""
    import ray

    from raytrain_fast.config.storage import multi_node_storage_problems

    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    problems = multi_node_storage_problems(config.storage, cache_dir=config.data.cache_dir, nodes=nodes)
    if problems:
        raise ConfigError(problems)


def resolve_precision_on_a_worker(precision: str, *, use_gpu: bool, cpus_per_worker: int) -> tuple[str, str]:
    """engine.precision auto (or fp8, whose GPU must have FP8 tensor cores), decided in a Ray task with
    a training worker's resources (its GPU, or its CPUs and thread count), so on a cluster it is the
    workers' hardware that is measured. A refusal is raised here, as the one-line error it is."""
    import ray

    def resolve() -> tuple[str, str] | ConfigError:
        import torch

        if not use_gpu:
            torch.set_num_threads(cpus_per_worker)  # a Ray process starts with one thread
        try:
            return resolve_precision(precision, use_gpu=use_gpu)
        except ConfigError as refused:  # returned, not raised: Ray would wrap it in its task error
            return refused

    task = ray.remote(resolve).options(num_cpus=0 if use_gpu else cpus_per_worker, num_gpus=1 if use_gpu else 0)
    resolved = ray.get(task.remote())
    if isinstance(resolved, ConfigError):
        raise resolved
    return resolved

