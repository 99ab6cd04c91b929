"""Turns a validated Config into a Ray TorchTrainer run: resources, storage, failure handling."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from raytrain_fast.config import Config, validate
from raytrain_fast.engine import resolve_precision
from raytrain_fast.errors import CheckpointError, ConfigError, DivergenceError
from raytrain_fast.launch.ray_address import cluster_address, job_env
from raytrain_fast.loop.evaluation import resolve_eval
from raytrain_fast.loop.health import DIVERGENCE_KEY
from raytrain_fast.loop.hooks import LoopHooks, WindowCallback
from raytrain_fast.storage import check_storage, resolve_filesystem
from raytrain_fast.storage.filesystem import checksum_env

logger = logging.getLogger("raytrain_fast")


@dataclass(kw_only=True)
class RunResult:
    name: str
    run_dir: str
    """Where the run's checkpoints are: `<storage.uri>/<name>`."""
    checkpoint: str | None
    """The latest checkpoint, or None if the run saved none."""
    metrics: dict
    """Metrics reported with the latest checkpoint."""
    checkpoints: list[tuple[str, dict]]
    """(path, metrics) of every checkpoint kept, oldest first."""
    measurements: dict
    """How many times the coordinator measured each value during this fit (FLOPs, peaks)."""
    stopped_by: str | None = None
    """The signal (SIGTERM, SIGINT) that stopped the run early after a checkpoint; None if it ran to the end."""


def storage_path(uri: str) -> str:
    """Local paths become absolute (Ray requires it); URIs (s3://...) pass through unchanged."""
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


def _ensure_ray(env_vars: dict[str, str] | None = None) -> None:
    import ray

    if not ray.is_initialized():
        # Ray starts its worker processes (our training workers among them) at niceness 15, so any
        # process at normal priority on the machine takes the CPU from training. A local instance
        # started here runs them at 0 (no effect when joining a running cluster).
        os.environ.setdefault("RAY_worker_niceness", "0")
        # Joins RAY_ADDRESS (a cluster, or the job's cluster under `ray job submit`), else starts a
        # local instance. env_vars reach every process of the job (Ray Train's controller too), and
        # so does the joined cluster's address (see launch/ray_address.py).
        address = cluster_address()
        env_vars = job_env(env_vars, address)
        ray.init(address=address, log_to_driver=True, configure_logging=False,
                 runtime_env={"env_vars": env_vars} if env_vars else None)


def _resume_candidates(config: Config) -> tuple[object, str, list[tuple[int, str]], list[tuple[int, str]]]:
    """(filesystem, run path, complete checkpoints newest first, later ones to set aside) for the
    checkpoint this run resumes from: the newest complete one, or with checkpoint.resume=<step>
    that step's (every checkpoint above it is set aside, see `set_aside_later_checkpoints`)."""
    from raytrain_fast.checkpoint.manifest import list_checkpoint_dirs, verify_checkpoint

    filesystem, root = resolve_filesystem(storage_path(config.storage.uri), config.storage)
    run_path = f"{root.rstrip('/')}/{config.name}"
    listed = list_checkpoint_dirs(filesystem, run_path)
    resume = config.checkpoint.resume
    later = [(step, path) for step, path in listed if isinstance(resume, int) and step > resume]
    complete = [(step, path) for step, path in listed if (step, path) not in later
                and verify_checkpoint(filesystem, path, checksums=False)[0]]
    return filesystem, run_path, complete, later


def check_resume_policy(config: Config):
    """checkpoint.resume=must|never|<step>, decided from storage before any worker starts. A
    checkpoint of another worker count is resumed (see `keep_checkpoint_batch` and checkpoint/resize.py);
    one whose data, tokenizer or model settings differ is refused (launch/run_changes.py).
    Returns the TrainState of the checkpoint to resume: the newest complete and healthy one, or the
    chosen step's (None when the run has none)."""
    from raytrain_fast.checkpoint.checkpointing import TrainState
    from raytrain_fast.checkpoint.layout import CONFIG_FILE, STATE_FILE
    from raytrain_fast.checkpoint.manifest import checkpoint_health

    policy = config.checkpoint.resume
    filesystem, _, complete, _ = _resume_candidates(config)
    if isinstance(policy, int) and (not complete or complete[0][0] != policy):
        steps = [step for step, _ in _resume_candidates(dataclasses.replace(
            config, checkpoint=dataclasses.replace(config.checkpoint, resume="auto")))[2]]
        raise CheckpointError(
            f"checkpoint.resume={policy}: run '{config.name}' has no complete checkpoint at step {policy} under "
            f"{config.storage.uri} (complete ones: {', '.join(map(str, reversed(steps))) or 'none'}). Pick one of "
            "those steps, or checkpoint.resume=auto for the newest."
        )
    state = None
    healthy = [path for _, path in complete if not checkpoint_health(filesystem, path)]  # what the workers resume from
    if healthy:
        with filesystem.open_input_stream(f"{healthy[0]}/{STATE_FILE}") as stream:
            state = TrainState.from_json(stream.read().decode())
        _check_run_unchanged(config, filesystem, f"{healthy[0]}/{CONFIG_FILE}", step=state.step)
    if policy == "must" and not complete:
        raise CheckpointError(
            f"--resume must: run '{config.name}' has no complete checkpoint under {config.storage.uri}. "
            "Check --name and storage.uri (`raytrain-fast runs --storage URI` lists runs), or use --resume auto."
        )
    if policy == "never" and complete:
        raise CheckpointError(
            f"--resume never: run '{config.name}' already has {len(complete)} checkpoint(s) under {config.storage.uri}. "
            "Pick another --name to start fresh, or use --resume auto to continue it."
        )
    return state


def _check_run_unchanged(config: Config, filesystem, config_file: str, *, step: int) -> None:
    """The checkpoint's saved run config against this command's (launch/run_changes.py)."""
    import yaml

    from raytrain_fast.launch.run_changes import check_run_unchanged
    from raytrain_fast.storage import redact

    try:
        with filesystem.open_input_stream(config_file) as stream:
            saved = yaml.safe_load(stream.read().decode()) or {}
    except FileNotFoundError:
        return  # a checkpoint written without its config: nothing to compare
    scheme = "s3://" if config.storage.uri.startswith("s3://") else ""
    for line in check_run_unchanged(
        saved, redact(config.to_dict()), allow_changes=config.checkpoint.allow_changes, name=config.name or "",
        step=step, checkpoint=f"{scheme}{config_file.rsplit('/', 1)[0]}",
    ):
        print(line, flush=True)


def set_aside_later_checkpoints(config: Config) -> None:
    """checkpoint.resume=<step>: move the run's checkpoints above that step into
    `<run>/set-aside-<time>/`, where retention and resume never look, so that this run's own saves
    are its newest (a restart resumes from them, retention prunes among them). Nothing is deleted."""
    import time

    import pyarrow.fs as pafs

    filesystem, run_path, _, later = _resume_candidates(config)
    if not later:
        return
    aside = f"{run_path}/set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
    for _, path in later:
        target = f"{aside}/{path.rstrip('/').rsplit('/', 1)[1]}"
        filesystem.create_dir(aside, recursive=True)
        try:
            filesystem.move(path, target)
        except (OSError, NotImplementedError):  # S3 moves no directories: copy, then delete
            pafs.copy_files(path, target, source_filesystem=filesystem, destination_filesystem=filesystem)
            filesystem.delete_dir(path)
    scheme = "s3://" if config.storage.uri.startswith("s3://") else ""
    steps = ", ".join(str(step) for step, _ in reversed(later))
    print(
        f"checkpoint.resume={config.checkpoint.resume}: moved the {len(later)} later checkpoint(s) (steps {steps}) "
        f"to {scheme}{aside}; they are kept, and not resumed from or pruned (see docs/checkpoints.md)", flush=True,
    )


def check_before_ray(config: Config, *, create_bucket: bool = False):
    """Everything decided without a cluster: validation, storage reachable and writable, the
    resume policy. Returns (config with absolute local paths, TrainState of the checkpoint to resume or None)."""
    config = keep_checkpoint_batch(config)  # before validation: a resize may need another micro_batch
    validate(config)
    config = dataclasses.replace(config, storage=dataclasses.replace(config.storage, uri=storage_path(config.storage.uri)))
    if config.data.source != "stdlib" and "://" not in config.data.source:  # so is a saved run config's source
        config = dataclasses.replace(
            config, data=dataclasses.replace(config.data, source=os.path.abspath(os.path.expanduser(config.data.source)))
        )
    if config.checkpoint.init_from:  # resolved here: the workers' working directory differs
        config = dataclasses.replace(
            config, checkpoint=dataclasses.replace(config.checkpoint, init_from=storage_path(config.checkpoint.init_from))
        )
        from raytrain_fast.checkpoint.hf_import import init_from_problems

        problems = init_from_problems(config.checkpoint.init_from, config.model, config.storage)  # a Hugging Face dir
        if problems:
            raise ConfigError(problems)
    check_storage(config.storage, create_bucket=create_bucket)  # reachable and writable, in seconds
    check_data_matches_model(config)  # after the storage probe (an s3:// source is read), before anything is printed
    state = check_resume_policy(config)
    config = keep_checkpoint_precision(config, state)
    set_aside_later_checkpoints(config)  # the last step: every check passed
    return config, state


def check_data_matches_model(config: Config) -> None:
    """Data-versus-model problems in a second, before Ray starts: a prepared data.source's manifest
    (seq_len, vocabulary, sequences per worker) against the config, or, for a source prepared on the
    fly, the tokenizer's vocabulary against model.vocab_size. `prepare_training_data` checks the
    prepared corpus again once it exists (a source prepared on the fly has no manifest before)."""
    from raytrain_fast.data import check_manifest_matches, load_manifest
    from raytrain_fast.data.cache import STDLIB, _is_prepared
    from raytrain_fast.data.tokenizer import load_tokenizer

    data, model = config.data, config.model
    if data.source != STDLIB and _is_prepared(data.source, config.storage):
        micro_batch = config.train.micro_batch if isinstance(config.train.micro_batch, int) else None
        problems = check_manifest_matches(
            load_manifest(data.source, config.storage), seq_len=data.seq_len, vocab_size=model.vocab_size,
            micro_batch=micro_batch, world_size=config.resources.num_workers if micro_batch else None,
            max_sequences=max_sequences(config),
        )
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
    if problems:
        raise ConfigError(problems)


def keep_ray_data_actors_on_this_node() -> None:
    """Ray Data keeps cluster-wide detached actors (its stats actor, its autoscaling coordinator),
    pinned to the node of the process that first needs them: without this, a training worker's node.
    When that node goes (preemption, an elastic shrink), every later dataset fails with
    ActorDiedError. Created here first, they live on the driver's node. Ray 2.60's private helpers;
    where they are missing, a one-row dataset run here creates the same actors."""
    from raytrain_fast._ray_compat import create_ray_data_cluster_actors

    create_ray_data_cluster_actors()


def keep_checkpoint_batch(config: Config) -> Config:
    """Resuming on another worker count keeps the checkpoint's global batch: micro_batch x grad_accum
    are recomputed for the new count (checkpoint/resize.py `fit_batch`), or a CheckpointError names
    the counts that work. Reads the newest complete checkpoint's state; storage problems are left
    to the checks that follow (this runs before them)."""
    from raytrain_fast.checkpoint.checkpointing import TrainState
    from raytrain_fast.checkpoint.layout import STATE_FILE
    from raytrain_fast.checkpoint.resize import fit_batch, saved_global_batch

    workers = config.resources.num_workers
    if config.checkpoint.resume == "never" or not isinstance(workers, int) or workers < 1:
        return config  # a malformed worker count is named by validate(), which runs next
    try:
        filesystem, _, complete, _ = _resume_candidates(config)
        if not complete:
            return config
        newest = complete[0][1]
        with filesystem.open_input_stream(f"{newest}/{STATE_FILE}") as stream:
            state = TrainState.from_json(stream.read().decode())
    except Exception:  # noqa: BLE001 - reported with a clear message by check_storage / check_resume_policy
        return config
    workers, train = config.resources.num_workers, config.train
    if state.world_size == workers:
        return config
    global_batch = saved_global_batch(state, seq_len=config.data.seq_len, default=train.global_batch)
    if train.micro_batch == "auto":
        fitted = dataclasses.replace(train, global_batch=global_batch, grad_accum=None)
    else:
        scheme = "s3://" if config.storage.uri.startswith("s3://") else ""
        micro_batch, grad_accum = fit_batch(
            global_batch=global_batch, micro_batch=int(train.micro_batch), num_workers=workers,
            saved_workers=state.world_size, uri=f"{scheme}{newest}",
        )
        fitted = dataclasses.replace(train, global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum)
    return dataclasses.replace(config, train=fitted)


def keep_checkpoint_precision(config: Config, state) -> Config:
    """Precision is a property of the run: a resumed run trains in the precision its checkpoint was
    written in (its optimizer files are in that layout), whatever `auto` would measure today. An
    explicit other precision is an error, before any worker starts."""
    if state is None:
        return config
    saved, asked = state.precision, config.engine.precision
    if asked in ("auto", saved):
        print(f"Precision: {saved} (kept from the checkpoint at step {state.step})", flush=True)
        return dataclasses.replace(config, engine=dataclasses.replace(config.engine, precision=saved))
    raise CheckpointError(
        f"engine.precision={asked}, but run '{config.name}' was checkpointed in {saved} (step {state.step}): "
        f"its optimizer state is in {saved}'s layout. Resume with engine.precision={saved} (or auto), or start "
        f"a new run (another --name) from its weights with --set checkpoint.init_from=<its checkpoint>"
    )


def resolve_resources(
    config: Config, *, create_bucket: bool = False, checked: bool = False, announce_precision: bool = True
) -> Config:
    """Fill in `auto` values from the cluster, then validate everything before a worker starts.
    checked: `check_before_ray` already ran on this config. announce_precision: print the
    `Precision:` line (a resumed run's came from `keep_checkpoint_precision`)."""
    import ray

    if not checked:
        config, _ = check_before_ray(config, create_bucket=create_bucket)
    _ensure_ray(checksum_env(config.storage))
    check_storage_on_cluster(config)
    cluster = ray.cluster_resources()
    cpus, gpus = cluster.get("CPU", 0.0), cluster.get("GPU", 0.0)
    validate(config, cluster_cpus=cpus, cluster_gpus=gpus)

    resources = config.resources
    needed = resources.fewest_workers  # an elastic run starts with what the cluster holds, from min_workers on
    use_gpu = gpus >= needed if resources.use_gpu == "auto" else bool(resources.use_gpu)
    if resources.use_gpu == "auto" and 0 < gpus < needed:
        print(
            f"Warning: the cluster has {gpus:g} GPUs for {needed} workers, so resources.use_gpu=auto "
            "trains on CPUs. Lower resources.num_workers to use the GPUs.", flush=True,
        )
    cpus_per_worker = resources.cpus_per_worker
    if cpus_per_worker == 0:
        cpus_per_worker = 4 if use_gpu else max(1, int(cpus // resources.num_workers))
        cpus_per_worker = min(cpus_per_worker, max(1, int(cpus // resources.num_workers)))
    precision = config.engine.precision
    if precision == "auto":  # measured where the workers run: the driver may have no GPU, or another CPU
        precision, reason = resolve_precision_on_a_worker(use_gpu=use_gpu, cpus_per_worker=cpus_per_worker)
        logger.info("precision: %s (%s)", precision, reason)
        print(f"Precision: {precision} ({reason})", flush=True)
    elif announce_precision:
        print(f"Precision: {precision} (engine.precision={precision}, set explicitly)", flush=True)
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


def resolve_precision_on_a_worker(*, use_gpu: bool, cpus_per_worker: int) -> tuple[str, str]:
    """engine.precision=auto, decided in a Ray task with a training worker's resources (its GPU, or
    its CPUs and thread count), so on a cluster it is the workers' hardware that is measured."""
    import ray

    def resolve() -> tuple[str, str]:
        import torch

        if not use_gpu:
            torch.set_num_threads(cpus_per_worker)  # a Ray process starts with one thread
        return resolve_precision("auto", use_gpu=use_gpu)

    task = ray.remote(resolve).options(num_cpus=0 if use_gpu else cpus_per_worker, num_gpus=1 if use_gpu else 0)
    return ray.get(task.remote())


def max_sequences(config: Config) -> int | None:
    """data.max_tokens as whole sequences; None = all of the prepared data."""
    if config.data.max_tokens <= 0:
        return None
    return max(1, config.data.max_tokens // (config.data.seq_len + 1))


def prepare_training_data(config: Config) -> str:
    """Prepare data.source once (cached) and check it against the model; returns the manifest URI."""
    from raytrain_fast.data import check_manifest_matches, ensure_prepared_corpus, load_manifest
    from raytrain_fast.errors import ConfigError

    cache_dir = config.data.cache_dir or f"{config.storage.uri.rstrip('/')}/_prepared"
    uri = ensure_prepared_corpus(
        config.data.source, seq_len=config.data.seq_len, cache_dir=cache_dir,
        tokenizer=config.data.tokenizer, storage=config.storage,
        val_fraction=config.data.val_fraction, val_input=config.data.val_input,
    )
    manifest = load_manifest(uri, config.storage)
    problems = check_manifest_matches(
        manifest, seq_len=config.data.seq_len, vocab_size=config.model.vocab_size,
        micro_batch=config.train.micro_batch, world_size=config.resources.num_workers,
        max_sequences=max_sequences(config),
    )
    if problems:
        raise ConfigError(problems)
    _, notes = resolve_eval(config, manifest)  # the workers resolve it the same way; errors surface here, before them
    used = min(manifest.num_sequences, max_sequences(config) or manifest.num_sequences)
    print(f"Data: {used:,} sequences of {config.data.seq_len + 1} tokens from {uri}", flush=True)
    from raytrain_fast.data.corpus import repetition_warning

    if warning := repetition_warning(sequences_per_epoch=used, steps=config.train.steps, global_batch=config.train.global_batch):
        print(warning, flush=True)
    for note in notes:
        print(note, flush=True)
    return uri


def build_trainer(
    config: Config, *, data_uri: str, hooks: LoopHooks | None = None, on_window: WindowCallback | None = None,
    save_checkpoints: bool = True, callbacks: list | None = None,
):
    """A TorchTrainer for an already resolved config (see `resolve_resources`).

    `hooks`: fault injection, drills and the sequence recorder for the loop (tests and `--drill`);
    the default injects nothing. `on_window`: called on every log step with the window's metrics
    (a sweep trial's Tune report). `save_checkpoints=False`: a short measurement run.
    `callbacks`: Ray Train run callbacks (a sweep trial's TuneReportCallback)."""
    import ray.train
    from ray.train.torch import TorchConfig

    resources = config.resources
    # Built from config and passed explicitly: pyarrow ignores AWS_ENDPOINT_URL, so a bare
    # s3:// path would silently go to AWS instead of MinIO / Ceph / R2.
    filesystem, storage_root = resolve_filesystem(config.storage.uri, config.storage)
    if "://" not in config.storage.uri:
        filesystem = None  # local: let Ray use a plain path
    env_vars = {
        "DS_ACCELERATOR": "cuda" if resources.use_gpu else "cpu",
        "OMP_NUM_THREADS": str(resources.cpus_per_worker),
        # Ray Train routes print() through a logger AND the redirected stdout: every line twice.
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
        **checksum_env(config.storage),  # S3 clients built in the workers upload as the driver's do
    }
    return _trainer_class()(
        _train_loop_without_result_dumps,
        train_loop_config={
            "config": config.to_dict(), "data_uri": data_uri, "max_sequences": max_sequences(config),
            "hooks": hooks or LoopHooks(), "on_window": on_window, "save_checkpoints": save_checkpoints,
            # The driver's S3 filesystem (credentials inside, as in storage_filesystem): workers
            # use it for data and metrics too, whatever their own environment holds.
            "s3_filesystem": filesystem if config.storage.uri.startswith("s3://") else None,
        },
        # gloo/NCCL give up just after the hang watchdog would have acted (Ray's default waits 30 minutes).
        torch_config=TorchConfig(backend="nccl" if resources.use_gpu else "gloo", timeout_s=config.watchdog.process_group_timeout_s()),
        scaling_config=ray.train.ScalingConfig(
            num_workers=resources.scaling_workers(),  # (min, max): elastic, each resize a restart
            elastic_resize_monitor_interval_s=resources.elastic_resize_interval_s,
            use_gpu=bool(resources.use_gpu),
            resources_per_worker={"CPU": resources.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=config.name,
            storage_path=storage_root,
            storage_filesystem=filesystem,
            # A drained node (spot reclaim) restarts the run against its own budget: the loop saved
            # a checkpoint on the notice (loop/preemption.py).
            failure_config=ray.train.FailureConfig(
                max_failures=resources.max_failures, max_preemption_failures=resources.max_preemption_failures,
                preemption_grace_s=resources.preemption_grace_s,
            ),
            # Retention (keep_last + keep_best) is ours: Ray's can do one or the other.
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
            worker_runtime_env={"env_vars": env_vars},
            callbacks=callbacks,
            # Ray Train's own INFO lines (start-up, each report) stay in its log files, off the console.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )


def _trainer_class() -> type:
    """TorchTrainer without Ray Train's own SIGINT handler.

    fit() installs a handler (Ray 2.60 `DataParallelTrainer._register_sigint_handler`) that replaces
    `_StopOnSignal`'s and aborts the controller on Ctrl-C: no checkpoint, exit 1. With it off, Ctrl-C
    takes the SIGTERM path: save at the next log step, stop, exit 130. A second Ctrl-C still stops
    at once (`_StopOnSignal` restores the previous handler and raises KeyboardInterrupt).
    tests/test_stop_signal.py notices a Ray version that installs its handler another way."""
    from ray.train.torch import TorchTrainer

    class Trainer(TorchTrainer):
        def _register_sigint_handler(self, controller) -> None:  # noqa: ARG002 - Ray's signature
            return None

    return Trainer


def _train_loop_without_result_dumps(loop_config: dict) -> None:
    """The step loop, with Ray Train's per-report INFO line (a ~1 KB `TrainingReport(...)` dump) off.

    That logger is named after its file, outside `ray.train`, so RunConfig's LoggingConfig does not
    reach it; it is quieted in the worker, where it logs.
    """
    from raytrain_fast.loop.train_loop import train_loop_per_worker

    from raytrain_fast._ray_compat import quiet_train_report_logger

    quiet_train_report_logger()
    train_loop_per_worker(loop_config)


def _ray_snapshot_name() -> str:
    from raytrain_fast._ray_compat import checkpoint_snapshot_name

    return checkpoint_snapshot_name()


def drop_ray_run_snapshot(config: Config) -> None:
    """Remove Ray Train's snapshot of reported checkpoints from the run directory before fit().

    Ray keeps every checkpoint ever reported in that snapshot and refuses to start a new driver on
    the run ("a reference to a checkpoint that does not exist anymore") once one of them is gone;
    our retention (keep_last + keep_best) deletes checkpoints Ray still lists. A run resumes from
    our own manifests (Checkpointer.restore_state), never from Ray's snapshot, so nothing is lost.
    """
    import pyarrow.fs as pafs

    filesystem, root = resolve_filesystem(config.storage.uri, config.storage)
    path = f"{root.rstrip('/')}/{config.name}/{_ray_snapshot_name()}"
    if filesystem.get_file_info(path).type == pafs.FileType.File:
        filesystem.delete_file(path)


def kept_checkpoints(config: Config) -> list[tuple[str, dict]]:
    """(path, metrics at save time) of every complete checkpoint of the run in storage, oldest first."""
    from raytrain_fast.checkpoint.checkpointing import TrainState
    from raytrain_fast.checkpoint.layout import STATE_FILE
    from raytrain_fast.checkpoint.manifest import list_checkpoint_dirs, verify_checkpoint

    filesystem, root = resolve_filesystem(config.storage.uri, config.storage)
    kept = []
    for _, path in reversed(list_checkpoint_dirs(filesystem, f"{root.rstrip('/')}/{config.name}")):
        if verify_checkpoint(filesystem, path, checksums=False)[0]:
            with filesystem.open_input_stream(f"{path}/{STATE_FILE}") as stream:
                kept.append((path, TrainState.from_json(stream.read().decode()).metrics))
    return kept


def run(config: Config, *, create_bucket: bool = False, hooks: LoopHooks | None = None) -> RunResult:
    """Validate, build and fit. Same name + same storage = the run continues from its latest checkpoint.
    `hooks`: drills and fault injection for the loop (tests, `pretrain --drill`); none by default."""
    config, resume_state = check_before_ray(config, create_bucket=create_bucket)
    if resume_state is not None and resume_state.step >= config.train.steps:
        return _nothing_to_do(config, resume_state)  # decided from storage: no Ray, no workers
    config = resolve_resources(config, create_bucket=create_bucket, checked=True, announce_precision=resume_state is None)
    if config.train.micro_batch == "auto":
        from raytrain_fast.microbatch.auto import resolve_micro_batch

        config = resolve_micro_batch(config)  # measured in fresh processes (or cached), before any worker starts
    run_dir = f"{config.storage.uri.rstrip('/')}/{config.name}"
    r = config.resources
    workers = f"{r.min_workers}-{r.num_workers} workers (elastic)" if r.elastic else f"{r.num_workers} worker(s)"
    print(f"Run '{config.name}': {workers}, storage {run_dir}", flush=True)
    import ray

    from raytrain_fast.coordinator import start_coordinator

    data_uri = prepare_training_data(config)
    # One named actor per run, owned by this driver: it outlives worker-group restarts, so FLOPs
    # and the matmul peak are measured once per run. Kept referenced until fit() returns.
    coordinator = start_coordinator(config.name or "run")
    start_watchdog(config, coordinator)
    keep_ray_data_actors_on_this_node()
    drop_ray_run_snapshot(config)
    with _StopOnSignal(coordinator) as stop:
        result = build_trainer(config, data_uri=data_uri, hooks=hooks).fit()
    measurements = ray.get(coordinator.measurements.remote())
    diverged, message = ray.get(coordinator.wait.remote(DIVERGENCE_KEY, 0))
    ray.kill(coordinator)  # the next run of this name starts a fresh one (values come from checkpoints)
    if diverged:  # the workers ended normally (so Ray did not restart them): the run failed
        raise DivergenceError(message)
    kept = kept_checkpoints(config)  # what storage holds after retention: what a rerun resumes from
    return RunResult(
        name=config.name or "", run_dir=run_dir, checkpoint=kept[-1][0] if kept else None,
        metrics=dict(kept[-1][1]) if kept else dict(result.metrics or {}),
        checkpoints=kept, measurements=measurements, stopped_by=stop.signal_name,
    )


def start_watchdog(config: Config, coordinator) -> None:
    """The hang watchdog runs in the run's coordinator actor (it outlives worker-group restarts);
    the stacks of a hang go to `<run>/hangs/` in the run's storage (watchdog/stacks.py)."""
    import ray

    watchdog = config.watchdog
    if not watchdog.enabled:
        return
    filesystem, root = resolve_filesystem(config.storage.uri, config.storage)
    ray.get(coordinator.start_watchdog.remote(
        timeout_s=watchdog.hang_timeout_s, min_timeout_s=watchdog.min_timeout_s,
        beat_interval_s=watchdog.beat_interval_s(), filesystem=filesystem, run_path=f"{root.rstrip('/')}/{config.name}",
    ))


def _nothing_to_do(config: Config, state) -> RunResult:
    """The run already reached train.steps: say so and return what storage holds."""
    steps = config.train.steps
    print(
        f"Run '{config.name}' already reached train.steps={steps} (checkpoint at step {state.step}); "
        f"nothing to do. To train further: --set train.steps={max(steps * 2, state.step + steps)}",
        flush=True,
    )
    kept = kept_checkpoints(config)
    return RunResult(
        name=config.name or "", run_dir=f"{config.storage.uri.rstrip('/')}/{config.name}",
        checkpoint=kept[-1][0] if kept else None, metrics=dict(kept[-1][1]) if kept else dict(state.metrics),
        checkpoints=kept, measurements={},
    )


class _StopOnSignal:
    """While fit() runs: the first SIGTERM or SIGINT (Ctrl-C) asks the workers, through the
    coordinator, to save a checkpoint at their next log step and stop; a second one stops at once.

    The handler only records the signal (it may run inside a blocking Ray call); a small thread
    sends the request. Outside the main thread (where Python allows no handlers) it does nothing.
    """

    SIGNALS = ("SIGTERM", "SIGINT")

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._event = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is not threading.main_thread():
            return self
        for name in self.SIGNALS:
            number = getattr(signal, name)
            self._previous[number] = signal.signal(number, self._handle)
        self._thread = threading.Thread(target=self._send, name="raytrain-fast-stop", daemon=True)
        self._thread.start()
        return self

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.signal_name is not None:  # the second notice: stop now
            self._restore()
            print(f"{name} again: stopping now without a checkpoint.", flush=True)
            raise KeyboardInterrupt
        self.signal_name = name
        print(
            f"{name}: saving a checkpoint at the next log step, then stopping (send it again to stop at once).",
            flush=True,
        )
        self._event.set()

    def _send(self) -> None:
        self._event.wait()
        if self.signal_name is not None:
            self.coordinator.request_stop.remote(self.signal_name)

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self._restore()
        self._event.set()  # lets the thread end
        if self._thread is not None:
            self._thread.join(timeout=5)
