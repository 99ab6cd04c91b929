"""The one set of checks before Ray starts (`check_run`), taken by `pretrain`, the sweep and each sweep
trial: the config validated (every problem in one message), its local paths made absolute, the
storage reachable and writable, the data against the model, eval.tasks read, and what the run resumes
from (launch/resume.py, from one reading of its checkpoints)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from raytrain_fast.config import Config, validate
from raytrain_fast.errors import ConfigError
from raytrain_fast.launch.resume import (
    RunSnapshot,
    check_resume_policy,
    keep_checkpoint_batch,
    keep_checkpoint_precision,
    set_aside_later_checkpoints,
    storage_path,
)
from raytrain_fast.storage import check_storage


@dataclass(frozen=True, kw_only=True)
class Checked:
    """What the checks settled, for the plan (launch/plan.py)."""

    config: Config
    """Local paths absolute; a resumed run's global batch and precision kept from its checkpoint."""
    snapshot: RunSnapshot
    """The run's checkpoints as storage holds them, and the storage's filesystem and run path."""
    state: Any
    """The TrainState of the checkpoint the run resumes from, or None for a new run."""
    tasks: list
    """eval.tasks, read (not encoded yet: the data's tokenizer encodes them)."""
    sources: list
    """The data sources prepared already, their manifests read (data/mixture.py `Source`)."""
    lines: tuple[str, ...]
    """Start-up lines decided here: what a resume changes, the precision it keeps."""


def check_run(config: Config, *, create_bucket: bool = False) -> Checked:
    """Every check before Ray starts, for every run (`pretrain`, the sweep, each sweep trial). Raises
    ConfigError (every problem of the config at once), StorageError, CheckpointError or TaskError."""
    from raytrain_fast.data.mixture import check_sources
    from raytrain_fast.downstream.run import load_run_tasks

    try:  # the run's checkpoints, listed once (launch/resume.py)
        snapshot: RunSnapshot | None = RunSnapshot.read(config)
    except Exception:  # noqa: BLE001 - storage not readable yet: check_storage names the problem, after validation
        snapshot = None
    config = keep_checkpoint_batch(config, snapshot)  # before validation: a resize may need another micro_batch
    raise_config_problems(config)
    config = with_absolute_paths(config)  # before anything leaves this process
    check_storage(config.storage, create_bucket=create_bucket)  # reachable and writable, in seconds
    sources = check_sources(config)  # after the storage probe (an s3:// source is read), before anything is printed
    tasks = load_run_tasks(config)  # an unknown task or a malformed line fails here, in a second
    snapshot = snapshot or RunSnapshot.read(config)  # storage is reachable now: its errors are real
    state, lines = check_resume_policy(config, snapshot)
    config, precision = keep_checkpoint_precision(config, state)
    set_aside_later_checkpoints(config, snapshot)  # the last step: every check passed
    return Checked(config=config, snapshot=snapshot, state=state, tasks=tasks, sources=sources, lines=(*lines, *precision))


def raise_config_problems(config: Config) -> None:
    """validate() and a Hugging Face checkpoint.init_from against the model section: one ConfigError
    naming every problem of both, so that fixing one never uncovers another on the next try."""
    problems: list[str] = []
    try:
        validate(config)
    except ConfigError as error:
        problems += error.problems
    if config.checkpoint.init_from and not any(p.startswith("checkpoint.init_from") for p in problems):
        from raytrain_fast.checkpoint.hf_import import init_from_problems

        problems += init_from_problems(config)  # a Hugging Face dir: its config.json and tokenizer
    if problems:
        raise ConfigError(problems)


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


