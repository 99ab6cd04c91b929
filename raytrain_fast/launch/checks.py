"""Everything checked and resolved before any worker starts: validation, storage, the data against
the model, what the run resumes from (launch/resume.py), then, on the cluster, the resources and
the precision measured where the workers run, and the training data prepared once."""

from __future__ import annotations

import dataclasses
import logging
import os

from raytrain_fast.config import Config, validate
from raytrain_fast.console import say
from raytrain_fast.engine import resolve_precision
from raytrain_fast.errors import ConfigError
from raytrain_fast.launch.ray_address import ensure_ray
from raytrain_fast.launch.resume import (
    RunSnapshot,
    check_resume_policy,
    keep_checkpoint_batch,
    keep_checkpoint_precision,
    set_aside_later_checkpoints,
    storage_path,
)
from raytrain_fast.loop.evaluation import resolve_eval
from raytrain_fast.storage import check_storage
from raytrain_fast.storage.filesystem import checksum_env

logger = logging.getLogger("raytrain_fast")


def check_before_ray(config: Config, *, create_bucket: bool = False):
    """Everything decided without a cluster: validation, storage reachable and writable, the
    resume policy. Returns (config with absolute local paths, TrainState of the checkpoint to resume or None)."""
    try:  # the run's checkpoints, listed once (launch/resume.py)
        snapshot: RunSnapshot | None = RunSnapshot.read(config)
    except Exception:  # noqa: BLE001 - storage not readable yet: check_storage names the problem, after validation
        snapshot = None
    config = keep_checkpoint_batch(config, snapshot)  # before validation: a resize may need another micro_batch
    validate(config)
    config = with_absolute_paths(config)  # before anything leaves this process
    if config.checkpoint.init_from:
        from raytrain_fast.checkpoint.hf_import import init_from_problems

        problems = init_from_problems(config.checkpoint.init_from, config.model, config.storage)  # a Hugging Face dir
        if problems:
            raise ConfigError(problems)
    check_storage(config.storage, create_bucket=create_bucket)  # reachable and writable, in seconds
    check_data_matches_model(config)  # after the storage probe (an s3:// source is read), before anything is printed
    snapshot = snapshot or RunSnapshot.read(config)  # storage is reachable now: its errors are real
    state = check_resume_policy(config, snapshot)
    config = keep_checkpoint_precision(config, state)
    set_aside_later_checkpoints(config, snapshot)  # the last step: every check passed
    return config, state


def with_absolute_paths(config: Config) -> Config:
    """`config` with every local path it names made absolute against this process's working
    directory: storage.uri, data.source, data.sources[*].source, data.tokenizer, data.val_input,
    data.cache_dir, checkpoint.init_from and eval.tasks' JSONL files. The workers run in Ray Train's own working directory
    (on a cluster, on other machines), and the run config saved with each checkpoint must name the
    same files whatever directory a later resume, export or report runs in. URIs (s3://, file://)
    and the words `stdlib` and `byte` stay as they are."""
    from raytrain_fast.data.cache import STDLIB
    from raytrain_fast.data.tokenizer import BYTE_TOKENIZER

    def local(path: str | None, *, word: str = "") -> str | None:
        if not path or path == word or "://" in path:
            return path
        return os.path.abspath(os.path.expanduser(path))

    data = config.data
    data = dataclasses.replace(
        data, source=local(data.source, word=STDLIB), tokenizer=local(data.tokenizer, word=BYTE_TOKENIZER),
        val_input=local(data.val_input), cache_dir=local(data.cache_dir),
        sources=[dataclasses.replace(item, source=local(item.source, word=STDLIB)) for item in data.sources],
    )
    checkpoint = config.checkpoint
    if checkpoint.init_from:
        checkpoint = dataclasses.replace(checkpoint, init_from=storage_path(checkpoint.init_from))
    storage = dataclasses.replace(config.storage, uri=storage_path(config.storage.uri))
    tasks = [local(t) if t.endswith((".jsonl", ".jsonl.gz")) else t for t in config.eval.tasks]  # a task name stays a name
    evaluation = dataclasses.replace(config.eval, tasks=tasks)
    return dataclasses.replace(config, data=data, checkpoint=checkpoint, storage=storage, eval=evaluation)


def check_data_matches_model(config: Config) -> None:
    """Data-versus-model problems in a second, before Ray starts: a prepared data.source's manifest
    (seq_len, vocabulary, sequences per worker) against the config, or, for a source prepared on the
    fly, the tokenizer's vocabulary against model.vocab_size. `prepare_training_data` checks the
    prepared corpus again once it exists (a source prepared on the fly has no manifest before)."""
    from raytrain_fast.data import load_manifest
    from raytrain_fast.data.cache import STDLIB, is_prepared, text_problem
    from raytrain_fast.data.tokenizer import load_tokenizer

    data, model = config.data, config.model
    if data.sources:  # a mixture: data/mixture.py checks every source (storage, tokenizer, seq_len, model)
        from raytrain_fast.data.mixture import check_mixture

        check_mixture(config)
        return
    if data.source != STDLIB and is_prepared(data.source, config.storage):
        problems = _manifest_problems(config, load_manifest(data.source, config.storage))
        problems += [
            f"data.{key} applies to a source prepared on the fly, but {data.source} is already prepared: run "
            f"`raytrain-fast prepare-data` again with --{key.replace('_', '-')}, or leave data.{key} unset"
            for key in ("val_fraction", "val_input") if getattr(data, key) is not None
        ]
    else:
        vocab = load_tokenizer(data.tokenizer, config.storage).info.vocab_size
        problems = [] if vocab <= model.vocab_size else [
            f"model.vocab_size ({model.vocab_size}) is smaller than data.tokenizer's vocabulary ({vocab} tokens); "
            f"set model.vocab_size >= {vocab} (a multiple of 64 is fastest: {-(-vocab // 64) * 64})"
        ]
    problems += [p for p in [text_problem(data.source, config.storage, setting="data.source")] if p]
    if problems:
        raise ConfigError(problems)


def resolve_resources(
    config: Config, *, create_bucket: bool = False, checked: bool = False, announce_precision: bool = True
) -> Config:
    """Fill in `auto` values from the cluster, then validate everything before a worker starts.
    checked: `check_before_ray` already ran on this config. announce_precision: print the
    `Precision:` line (a resumed run's came from `keep_checkpoint_precision`)."""
    import ray

    if not checked:
        config, _ = check_before_ray(config, create_bucket=create_bucket)
    ensure_ray(checksum_env(config.storage))
    check_storage_on_cluster(config)
    cluster = ray.cluster_resources()
    cpus, gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    validate(config, cluster_cpus=cpus, cluster_gpus=gpus)

    resources = config.resources
    needed = resources.fewest_workers  # an elastic run starts with what the cluster holds, from min_workers on
    use_gpu = gpus >= needed if resources.use_gpu == "auto" else bool(resources.use_gpu)
    if resources.use_gpu == "auto" and 0 < gpus < needed:
        say(
            f"Warning: the cluster has {gpus:g} GPUs for {needed} workers, so resources.use_gpu=auto "
            "trains on CPUs. Lower resources.num_workers to use the GPUs."
        )
    cpus_per_worker = resources.cpus_per_worker
    if cpus_per_worker == 0:
        cpus_per_worker = 4 if use_gpu else max(1, int(cpus // resources.num_workers))
        cpus_per_worker = min(cpus_per_worker, max(1, int(cpus // resources.num_workers)))
    precision = config.engine.precision
    if precision in ("auto", "fp8"):  # measured (fp8: checked) where the workers run: the driver may have no GPU, or another CPU
        precision, reason = resolve_precision_on_a_worker(precision, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker)
        logger.info("precision: %s (%s)", precision, reason)
        if announce_precision or config.engine.precision == "auto":
            say(f"Precision: {precision} ({reason})")
    elif announce_precision:
        say(f"Precision: {precision} (engine.precision={precision}, set explicitly)")
    return dataclasses.replace(
        config,
        resources=dataclasses.replace(resources, use_gpu=use_gpu, cpus_per_worker=cpus_per_worker),
        engine=dataclasses.replace(config.engine, precision=precision),
    )


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


def _manifest_problems(config: Config, manifest) -> list[str]:
    """A prepared corpus's manifest against the model and, once train.micro_batch is a number, the batch."""
    from raytrain_fast.data import check_manifest_matches

    micro_batch = config.train.micro_batch if isinstance(config.train.micro_batch, int) else None
    return check_manifest_matches(
        manifest, seq_len=config.data.seq_len, vocab_size=config.model.vocab_size, micro_batch=micro_batch,
        world_size=config.resources.num_workers if micro_batch else None, max_sequences=max_sequences(config),
    )


def max_sequences(config: Config) -> int | None:
    """data.max_tokens as whole sequences; None = all of the prepared data."""
    if config.data.max_tokens <= 0:
        return None
    return max(1, config.data.max_tokens // (config.data.seq_len + 1))


def _cache_dir(config: Config) -> str:
    """Where sources are prepared on the fly: data.cache_dir, else `<storage.uri>/_prepared`."""
    return config.data.cache_dir or f"{config.storage.uri.rstrip('/')}/_prepared"


def prepare_training_data(config: Config) -> str:
    """Prepare data.source once (cached) and check it against the model; returns the manifest URI."""
    from raytrain_fast.data import ensure_prepared_corpus, load_manifest

    uri = ensure_prepared_corpus(
        config.data.source, seq_len=config.data.seq_len, cache_dir=_cache_dir(config),
        tokenizer=config.data.tokenizer, storage=config.storage,
        val_fraction=config.data.val_fraction, val_input=config.data.val_input, text_field=config.data.text_field,
    )
    manifest = load_manifest(uri, config.storage)
    if problems := _manifest_problems(config, manifest):
        raise ConfigError(problems)
    _, notes = resolve_eval(config, manifest)  # the workers resolve it the same way; errors surface here, before them
    used = min(manifest.num_sequences, max_sequences(config) or manifest.num_sequences)
    say(f"Data: {used:,} sequences of {config.data.seq_len + 1} tokens from {uri}")
    from raytrain_fast.data.corpus import repetition_warning

    if warning := repetition_warning(sequences_per_epoch=used, steps=config.train.steps, global_batch=config.train.global_batch):
        say(warning)
    for note in notes:
        say(note)
    return uri


def prepare_mixture_data(config: Config) -> list[str]:
    """data.sources: every source prepared once (cached) and the mixture checked against the model;
    returns the sources' manifest URIs, in order (the workers open the mixture from them)."""
    from raytrain_fast.data.mixture import check_mixture, prepare_sources

    uris = prepare_sources(config.data, config.storage, cache_dir=_cache_dir(config))
    sources = check_mixture(config, prepared=uris)  # their manifests, loaded once, in order
    resolved, notes = resolve_eval(config, sources[0].manifest)  # as the workers resolve it (from the first source)
    shares = ", ".join(f"{s.name} {s.weight:g}" for s in sources)
    say(f"Data: a mixture of {len(sources)} sources ({shares}) of {config.data.seq_len + 1}-token sequences")
    from raytrain_fast.data.validation import mixture_eval_note

    for note in notes + ([covered] if resolved.eval.enabled and (covered := mixture_eval_note(sources)) else []):
        say(note)
    return uris


def prepare_tasks(config: Config, tasks: list, data_uri: str):
    """eval.tasks encoded with the prepared data's tokenizer for the run's model (downstream/run.py),
    its lines printed; None without tasks. Raises TaskError before any worker starts."""
    if not tasks:
        return None
    from raytrain_fast.data import load_manifest
    from raytrain_fast.downstream.run import encode_run_tasks

    manifest = load_manifest(data_uri, config.storage)
    resolved, _ = resolve_eval(config, manifest)
    run_tasks, notes = encode_run_tasks(tasks, config, manifest, every_steps=resolved.eval.every_steps or 1)
    for note in notes:
        say(note)
    return run_tasks
