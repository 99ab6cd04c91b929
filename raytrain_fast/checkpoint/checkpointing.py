"""Saving and restoring the whole training state through Ray Train checkpoints: `Checkpointer`, one per
worker, decides when to save and writes the files; its collaborators upload them (upload.py), keep
the run's checkpoints to the retention policy (retention.py) and restore the newest (restore.py).
The files of one checkpoint: docs/architecture.md, "Checkpoint layout"."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import yaml

from raytrain_fast.checkpoint.layout import CONFIG_FILE, DEEPSPEED_TAG, STATE_FILE
from raytrain_fast.checkpoint.rank_manifest import write_rank_manifest
from raytrain_fast.checkpoint.restore import Restorer
from raytrain_fast.checkpoint.retention import Retention
from raytrain_fast.checkpoint.snapshot import SnapshotWriter, optimizer_state_as_after_a_step, training_optimizer
from raytrain_fast.checkpoint.state import TrainState, barrier, checkpoint_dir_name, rng_states, set_rng_states
from raytrain_fast.checkpoint.upload import Uploader
from raytrain_fast.config.checkpoint import CheckpointConfig
from raytrain_fast.console import say

STAGING_DIR = ".staging"
"""With local storage, each rank writes its checkpoint files under `<run>/.staging/rank<r>/` first."""

class Checkpointer:
    """One per worker: saves (every rank, same steps), restores, uploads and prunes old checkpoints."""

    def __init__(
        self, config: CheckpointConfig, *, rank: int, world_size: int, run_config: dict[str, Any],
        local_mode_run: tuple[Any, str] | None = None, before_upload: Callable[[], None] | None = None,
    ) -> None:
        """`local_mode_run`: (filesystem, run path) to use under Ray Train's local mode
        (`ScalingConfig(num_workers=0)`: the loop runs in the calling process, Ray has no storage
        context and its report uploads nothing, so saves upload synchronously here).
        `before_upload`: called on the upload thread before each upload of this rank (a caller's
        hook, e.g. a drill that makes the uploads start late; loop/hooks.py)."""
        import ray.train

        self.config = config
        self.rank, self.world_size = rank, world_size
        self._run_config = run_config  # already redacted by the caller
        try:
            storage = ray.train.get_context().get_storage()
            self.filesystem, self.run_path = storage.storage_filesystem, storage.experiment_fs_path
            self.local_mode = False
        except NotImplementedError:
            if local_mode_run is None:
                raise
            self.filesystem, self.run_path = local_mode_run
            self.local_mode = True
        try:
            self.local_rank = ray.train.get_context().get_local_rank()
        except Exception:  # local mode
            self.local_rank = 0
        self._staging = f"{self.run_path}/{STAGING_DIR}/rank{rank}" if self.filesystem.type_name == "local" else None
        if self._staging is not None:  # what an earlier attempt of this rank left mid-save is stale
            shutil.rmtree(self._staging, ignore_errors=True)
        self.last_save_breakdown: dict[str, float] = {}
        """Of the last save's blocked time: waiting for the previous upload, writing the files
        locally, and Ray's report (with a sync upload inside it)."""
        self._last_save = time.monotonic()
        self._saved = False
        self.retention = Retention(config, filesystem=self.filesystem, run_path=self.run_path)
        self.writer = SnapshotWriter() if config.write == "background" else None
        """Writes DeepSpeed's files from a snapshot on a background thread (checkpoint.write=background)."""
        self._routed_engine: Any = None
        self._unfinished: dict[str, int] = {}  # local directory -> step, until its upload completes it
        self.uploader = Uploader(
            filesystem=self.filesystem, run_path=self.run_path, attempts=config.upload_attempts,
            before_upload=before_upload, after_upload=self._after_upload if rank == 0 else None,
            finish_files=self._finish_files,
        )
        self.restorer = Restorer(
            filesystem=self.filesystem, run_path=self.run_path, rank=rank, world_size=world_size,
            local_rank=self.local_rank, scheme="s3://" if self.filesystem.type_name == "s3" else "",
        )

    @property
    def resized(self) -> dict[str, Any] | None:
        """Set by `restore_state` when the checkpoint was written by another worker count (`Restorer.resized`)."""
        return self.restorer.resized

    # ------------------------------------------------------------------ cadence
    def due_by_steps(self, step: int, total_steps: int) -> bool:
        every = self.config.every_steps
        return step == total_steps or (every > 0 and step % every == 0)

    def due_by_time(self) -> bool:
        """This rank's view only: the loop agrees across ranks before acting on it."""
        minutes = self.config.every_minutes
        return minutes > 0 and time.monotonic() - self._last_save >= minutes * 60

    # ------------------------------------------------------------------ save
    def save(self, engine: Any, state: TrainState, *, metrics: dict[str, Any]) -> float:
        """Write this rank's files, then report them to Ray (a barrier across ranks).

        Returns the seconds the training thread was blocked, including the wait for the previous
        async upload.
        """
        start = time.perf_counter()
        metrics = self._with_restore_metrics(metrics)
        self.uploader.wait()  # bounded local disk: at most one checkpoint in flight per worker
        # Every rank's previous checkpoint is in storage past this point, so the prune that rank 0
        # runs after this upload sees it complete (see `_after_upload`).
        barrier(self.world_size)
        waited = time.perf_counter()
        local_dir = self._local_dir()
        try:
            self._write(local_dir, engine, state, metrics=metrics)
        except BaseException:
            shutil.rmtree(local_dir, ignore_errors=True)
            raise
        written = time.perf_counter()
        self._report(local_dir, state.step, metrics=metrics)
        self._saved = True
        self._last_save = time.monotonic()
        end = time.perf_counter()
        self.last_save_breakdown = {
            "wait_previous_s": waited - start, "write_s": written - waited, "report_s": end - written,
        }
        return end - start

    def reserve_snapshot_memory(self, engine: Any) -> None:
        """Before the first step, with checkpoint.write=background: the host memory every save copies
        DeepSpeed's state into, allocated now, sized by a save of the engine's state as it is after a
        step that writes nothing, so that no save allocates (and pins) while training runs."""
        self._route_writes(engine)
        if self.writer is None:
            return
        local_dir = self._local_dir()
        try:
            with optimizer_state_as_after_a_step(engine):
                added, seconds = self.writer.reserve(lambda: engine.save_checkpoint(local_dir, tag=DEEPSPEED_TAG))
        finally:
            shutil.rmtree(local_dir, ignore_errors=True)
        if added:
            kind = "pinned host memory" if engine.device.type == "cuda" else "memory"
            say(f"Checkpoint saves reuse {added / 1e9:.2f} GB of {kind}, reserved in {seconds:.1f} s before the first step.",
                rank=self.rank)

    def _local_dir(self) -> str:
        """Where this rank writes a checkpoint before its upload: with local storage, beside the run
        (`<run>/.staging/rank<r>/`), so the upload is a hard link on the same filesystem and a
        multi-GB checkpoint never lands in /tmp (often small); else a temporary directory."""
        if self._staging is None:
            return tempfile.mkdtemp(prefix="raytrain-fast-ckpt-")
        os.makedirs(self._staging, exist_ok=True)
        return tempfile.mkdtemp(prefix="ckpt-", dir=self._staging)

    def _with_restore_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Rank 0 adds what each rank downloaded when this attempt resumed (nothing on a fresh start)."""
        downloaded = self.restorer.download_bytes
        if self.rank != 0 or not downloaded:
            return metrics
        return {**metrics, "checkpoint/restore_download_bytes_max": max(downloaded),
                **{f"checkpoint/restore_download_bytes/rank{r}": b for r, b in enumerate(downloaded)}}

    def _write(self, local_dir: str, engine: Any, state: TrainState, *, metrics: dict[str, Any]) -> None:
        """This rank's files: DeepSpeed's (from a snapshot, written in the background where
        checkpoint.write=background), its RNG states, rank 0's state and config. The manifest comes
        last, from the upload thread (`_finish_files`)."""
        self._route_writes(engine)
        engine.save_checkpoint(local_dir, tag=DEEPSPEED_TAG)
        torch.save(rng_states(engine.device), Path(local_dir, f"rng_state_rank{self.rank}.pt"))
        if self.rank == 0:
            state.metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
            Path(local_dir, STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
            Path(local_dir, CONFIG_FILE).write_text(yaml.safe_dump(self._run_config, sort_keys=False))
        self._unfinished[local_dir] = state.step

    def _route_writes(self, engine: Any) -> None:
        """Once per engine: its checkpoint files go through the background writer."""
        if self.writer is None or self._routed_engine is engine:
            return
        from raytrain_fast.engine.deepspeed_compat import write_checkpoints_in_background

        if not write_checkpoints_in_background(engine, self.writer, warn=functools.partial(say, rank=self.rank)):
            self.writer = None
        else:  # its next step waits for a save's copies, so the save itself need not
            self.writer.guard(training_optimizer(engine))
        self._routed_engine = engine

    def _finish_files(self, local_dir: str) -> None:
        """In the upload thread: wait for this rank's background writes, then write its manifest
        (checksums of every file: seconds for a multi-GB checkpoint, off the training thread)."""
        if self.writer is not None:
            self.writer.wait()
        write_rank_manifest(local_dir, rank=self.rank, world_size=self.world_size, step=self._unfinished.pop(local_dir))

    def _report(self, local_dir: str, step: int, *, metrics: dict[str, Any]) -> None:
        """Hand the directory to Ray Train (a barrier across ranks); the upload runs in Ray's thread (async) or inline."""
        import ray.train

        mode = ray.train.CheckpointUploadMode.ASYNC if self.config.upload == "async" else ray.train.CheckpointUploadMode.SYNC
        self.uploader.begin()
        try:
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(local_dir),
                checkpoint_dir_name=checkpoint_dir_name(step),
                checkpoint_upload_mode=mode,
                checkpoint_upload_fn=self.uploader.upload,
                delete_local_checkpoint_after_upload=True,
            )
        except BaseException:
            self.uploader.abandon()
            raise
        if self.local_mode:  # Ray's local-mode report stores nothing
            try:
                self.uploader.upload(ray.train.Checkpoint.from_directory(local_dir), checkpoint_dir_name(step))
            finally:
                shutil.rmtree(local_dir, ignore_errors=True)

    def _after_upload(self, local_dir: str, dir_name: str, upload_s: float) -> None:
        """Rank 0, in the upload thread (off the step loop): a line for each checkpoint, with its own
        files' size (the others' optimizer shards are about as large) and the upload's seconds; then
        retention."""
        size = sum(p.stat().st_size for p in Path(local_dir).rglob("*") if p.is_file())
        ranks = "" if self.world_size == 1 else " from rank 0"
        step = int(dir_name.rsplit("_", 1)[-1]) if dir_name.rsplit("_", 1)[-1].isdigit() else dir_name
        say(f"Saved checkpoint at step {step} ({size / 1e6:.1f} MB{ranks}, uploaded in {upload_s:.1f} s)", rank=self.rank)
        self.retention.prune()

    def take_upload_s(self) -> float | None:
        """Duration of the last finished upload, once (None if none finished since the last call)."""
        return self.uploader.take_upload_s()

    def wait_for_upload(self) -> None:
        self.uploader.wait()

    def finish(self) -> None:
        """End of the run (or a stop notice): wait for this rank's last upload, then, once every
        rank's upload is in, rank 0 applies retention one last time. Without this final prune a
        run could end keeping one checkpoint more than keep_last + keep_best: the prune after rank
        0's own last upload may still see another rank's files missing and keep the previous one."""
        self.wait_for_upload()
        barrier(self.world_size)
        if self.rank == 0 and self._saved:
            self.retention.prune()

    # ------------------------------------------------------------------ restore
    def restore_state(self) -> TrainState | None:
        """Find and download the newest complete checkpoint; returns its TrainState (None if none).

        Rank 0 picks it from the manifests and sizes (skipping incomplete ones, with the reason
        printed). Each rank then downloads only what it loads (`download_for_rank`: model states,
        its own optimizer shard, the small files), ranks of one node sharing one download, every
        byte checksummed; if any rank's files fail their checksums, every rank moves on to the
        previous checkpoint. Call `load_into(engine)` next. Split in two so that the data iterator
        can start at the restored position while the engine is being built.
        """
        return self.restorer.restore_state()

    def load_into(self, engine: Any) -> None:
        """Load the checkpoint found by `restore_state` into the engine (model, optimizer, LR schedule, RNG)."""
        self.restorer.load_into(engine)
        self._last_save = time.monotonic()

    def discard(self) -> None:
        """Drop a restored checkpoint without loading it (the run has nothing left to do)."""
        self.restorer.discard()
