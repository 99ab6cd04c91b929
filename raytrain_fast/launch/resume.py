"""What a run resumes from, decided on the driver before any worker starts, from ONE reading of the
run's checkpoints in storage (`RunSnapshot`): a LIST of the run's directory, one check per checkpoint
that it is complete, and the saved state of those the decisions read. Every decision reads it:
the batch kept from the checkpoint (`keep_checkpoint_batch`), the resume policy
(`check_resume_policy`), the precision kept (`keep_checkpoint_precision`) and the checkpoints set
aside by checkpoint.resume=<step> (`set_aside_later_checkpoints`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raytrain_fast.config import Config
from raytrain_fast.console import say
from raytrain_fast.errors import CheckpointError
from raytrain_fast.storage import resolve_filesystem, uri_of


def storage_path(uri: str) -> str:
    """Local paths become absolute (Ray requires it); URIs (s3://...) pass through unchanged."""
    if "://" in uri:
        return uri
    return str(Path(uri).expanduser().resolve())


@dataclass
class RunSnapshot:
    """The run's checkpoints as storage holds them, newest first."""

    filesystem: Any
    """The run storage's filesystem, built once from storage.* (every later reach of the run goes through it)."""
    run_path: str
    """The run's directory in it: `<storage.uri>/<name>`, the one place that path is built."""
    run_uri: str
    """The same as the user names it (s3://... on S3)."""
    complete: list[tuple[int, str]]
    """(step, path) of every complete checkpoint (its rank manifests all present), newest first."""
    listed: list[tuple[int, str]]
    _states: dict[str, Any] = field(default_factory=dict)
    _health: dict[str, str] = field(default_factory=dict)

    @classmethod
    def read(cls, config: Config) -> RunSnapshot:
        filesystem, root = resolve_filesystem(storage_path(config.storage.uri), config.storage)
        run_path = f"{root.rstrip('/')}/{config.name}"
        return cls.of(filesystem, run_path, run_uri=uri_of(run_path, like=config.storage.uri))

    @classmethod
    def of(cls, filesystem: Any, run_path: str, *, run_uri: str) -> RunSnapshot:
        """The checkpoints under `run_path` as storage holds them now."""
        from raytrain_fast.checkpoint.verify import list_checkpoint_dirs, verify_checkpoint

        listed = list_checkpoint_dirs(filesystem, run_path)
        complete = [(step, path) for step, path in listed if verify_checkpoint(filesystem, path, checksums=False)[0]]
        return cls(filesystem=filesystem, run_path=run_path, run_uri=run_uri, complete=complete, listed=listed)

    def candidates(self, resume: Any) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """(the complete checkpoints this run may resume from, the later ones checkpoint.resume=<step>
        sets aside): with a step, those above it are set aside."""
        later = [(step, path) for step, path in self.listed if isinstance(resume, int) and step > resume]
        return [c for c in self.complete if c not in later], later

    def state(self, path: str):
        """The TrainState saved in checkpoint `path` (read once)."""
        if path not in self._states:
            from raytrain_fast.checkpoint.layout import STATE_FILE
            from raytrain_fast.checkpoint.state import TrainState

            with self.filesystem.open_input_stream(f"{path}/{STATE_FILE}") as stream:
                self._states[path] = TrainState.from_json(stream.read().decode())
        return self._states[path]

    def healthy(self, resume: Any) -> list[str]:
        """Paths of the complete checkpoints with finite weights and metrics (what the workers resume from)."""
        from raytrain_fast.checkpoint.verify import checkpoint_health

        paths = [path for _, path in self.candidates(resume)[0]]
        for path in paths:
            if path not in self._health:
                self._health[path] = checkpoint_health(self.filesystem, path)
        return [path for path in paths if not self._health[path]]


def keep_checkpoint_batch(config: Config, snapshot: RunSnapshot | None) -> Config:
    """Resuming on another worker count keeps the checkpoint's global batch: micro_batch x grad_accum
    are recomputed for the new count (checkpoint/resize.py `fit_batch`), or a CheckpointError names
    the counts that work. Runs before validation: no snapshot (storage unreadable) or a malformed
    worker count is left to the checks that follow."""
    from raytrain_fast.checkpoint.resize import saved_global_batch
    from raytrain_fast.plan import batch_table

    workers = config.resources.num_workers
    if snapshot is None or config.checkpoint.resume == "never" or not isinstance(workers, int) or workers < 1:
        return config
    complete, _ = snapshot.candidates(config.checkpoint.resume)
    try:
        state = snapshot.state(complete[0][1]) if complete else None
    except Exception:  # noqa: BLE001 - reported with a clear message by check_resume_policy
        return config
    if state is None or state.world_size == workers:
        return config
    train = config.train
    global_batch = saved_global_batch(state, seq_len=config.data.seq_len, default=train.global_batch)
    config = dataclasses.replace(config, train=dataclasses.replace(train, global_batch=global_batch, grad_accum=None))
    if isinstance(train.micro_batch, str) or train.micro_batch < 1:  # auto: measured for the kept global batch
        return config
    checkpoint = uri_of(complete[0][1], like=config.storage.uri)
    batch = batch_table(config, saved_workers=state.world_size, checkpoint=checkpoint)[workers]
    train = dataclasses.replace(config.train, micro_batch=batch.micro_batch, grad_accum=batch.grad_accum)
    return dataclasses.replace(config, train=train)


def check_resume_policy(config: Config, snapshot: RunSnapshot) -> tuple[Any, list[str]]:
    """checkpoint.resume=must|never|<step>. A checkpoint of another worker count is resumed (see
    `keep_checkpoint_batch` and checkpoint/resize.py); one whose data, tokenizer or model settings
    differ is refused unless checkpoint.allow_changes names them (launch/run_changes.py). Returns the
    TrainState of the checkpoint to resume (the newest complete and healthy one, or the chosen step's;
    None when the run has none) and the lines that say what the resume changes."""
    from raytrain_fast.checkpoint.layout import CONFIG_FILE

    policy = config.checkpoint.resume
    complete, _ = snapshot.candidates(policy)
    if isinstance(policy, int) and (not complete or complete[0][0] != policy):
        steps = [step for step, _ in snapshot.complete]
        raise CheckpointError(
            f"checkpoint.resume={policy}: run '{config.name}' has no complete checkpoint at step {policy} under "
            f"{config.storage.uri} (complete ones: {', '.join(map(str, reversed(steps))) or 'none'}). Pick one of "
            "those steps, or checkpoint.resume=auto for the newest."
        )
    state, lines = None, []
    healthy = snapshot.healthy(policy)
    if healthy:
        state = snapshot.state(healthy[0])
        lines = _check_run_unchanged(config, snapshot.filesystem, f"{healthy[0]}/{CONFIG_FILE}", step=state.step)
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
    return state, lines


def _check_run_unchanged(config: Config, filesystem, config_file: str, *, step: int) -> list[str]:
    """The checkpoint's saved run config against this command's (launch/run_changes.py): the lines
    that say what changes, or a CheckpointError for a change not allowed."""
    import yaml

    from raytrain_fast.launch.run_changes import check_run_unchanged
    from raytrain_fast.storage import redact

    try:
        with filesystem.open_input_stream(config_file) as stream:
            saved = yaml.safe_load(stream.read().decode()) or {}
    except FileNotFoundError:
        return []  # a checkpoint written without its config: nothing to compare
    return check_run_unchanged(
        saved, redact(config.to_dict()), allow_changes=config.checkpoint.allow_changes, name=config.name or "",
        step=step, checkpoint=uri_of(config_file.rsplit("/", 1)[0], like=config.storage.uri),
    )


def keep_checkpoint_precision(config: Config, state) -> tuple[Config, list[str]]:
    """Precision is a property of the run: a resumed run trains in the precision its checkpoint was
    written in (its optimizer files are in that layout), whatever `auto` would measure today; the
    line that says so. An explicit other precision is an error, before any worker starts."""
    if state is None:
        return config, []
    saved, asked = state.precision, config.engine.precision
    if asked in ("auto", saved):
        line = f"Precision: {saved} (kept from the checkpoint at step {state.step})"
        return dataclasses.replace(config, engine=dataclasses.replace(config.engine, precision=saved)), [line]
    if {saved, asked} == {"bf16", "fp8"}:  # fp8 keeps bf16's weights and optimizer state: the same files
        return config, [f"Precision: {asked} (engine.precision={asked}; the checkpoint at step {state.step} was written "
                        f"in {saved}, with the same weights and optimizer state)"]
    raise CheckpointError(
        f"engine.precision={asked}, but run '{config.name}' was checkpointed in {saved} (step {state.step}): "
        f"its optimizer state is in {saved}'s layout. Resume with engine.precision={saved} (or auto), or start "
        f"a new run (another --name) from its weights with --set checkpoint.init_from=<its checkpoint>"
    )


def set_aside_later_checkpoints(config: Config, snapshot: RunSnapshot) -> None:
    """checkpoint.resume=<step>: move the run's checkpoints above that step into
    `<run>/set-aside-<time>/`, where retention and resume never look, so that this run's own saves
    are its newest (a restart resumes from them, retention prunes among them). Nothing is deleted."""
    import pyarrow.fs as pafs

    _, later = snapshot.candidates(config.checkpoint.resume)
    if not later:
        return
    filesystem = snapshot.filesystem
    aside = f"{snapshot.run_path}/set-aside-{time.strftime('%Y%m%d-%H%M%S')}"
    for _, path in later:
        target = f"{aside}/{path.rstrip('/').rsplit('/', 1)[1]}"
        filesystem.create_dir(aside, recursive=True)
        try:
            filesystem.move(path, target)
        except (OSError, NotImplementedError):  # S3 moves no directories: copy, then delete
            pafs.copy_files(path, target, source_filesystem=filesystem, destination_filesystem=filesystem)
            filesystem.delete_dir(path)
    steps = ", ".join(str(step) for step, _ in reversed(later))
    say(
        f"checkpoint.resume={config.checkpoint.resume}: moved the {len(later)} later checkpoint(s) (steps {steps}) "
        f"to {uri_of(aside, like=config.storage.uri)}; they are kept, and not resumed from or pruned (see docs/checkpoints.md)"
    )
