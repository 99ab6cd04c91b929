"""Saving and restoring the whole training state through Ray Train checkpoints.

One checkpoint = one directory `checkpoint_<step>` in the run's storage, merged by Ray from every
rank's local directory:
- `deepspeed/`: DeepSpeed's own files: model states (rank 0) and one optimizer shard per rank
  (`<bf16_>zero_pp_rank_<r>_mp_rank_00_optim_states.pt`: distinct names, so the merge never
  collides), LR scheduler state included;
- `rng_state_rank<r>.pt`: each rank's torch RNG states (CPU, and the GPU's on CUDA);
- `train_state.json` (rank 0): step, tokens, data position, coordinator values, world size, ZeRO
  stage, precision and the metrics at save time; `config.yaml` (rank 0): the run config, redacted;
- `manifest.rank<r>.json`, written last by each rank: every file it wrote, with size and checksum.
  Resume uses only checkpoints whose manifests all check out (see checkpoint/manifest.py).

Uploads go through our own `checkpoint_upload_fn` so that they are retried, timed
(`checkpoint/upload_s`), and so the next save can wait for the previous async upload.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from raytrain_fast.config.checkpoint import CheckpointConfig
from raytrain_fast.checkpoint.layout import CONFIG_FILE, DEEPSPEED_TAG, STATE_FILE
from raytrain_fast.checkpoint.manifest import (
    IncompleteCheckpointError,
    checkpoint_health,
    download_checkpoint,
    download_for_rank,
    list_checkpoint_dirs,
    verify_checkpoint,
    write_rank_manifest,
)
from raytrain_fast.errors import CheckpointError



@dataclass(kw_only=True)
class TrainState:
    """What the loop needs besides the engine to continue exactly where it stopped."""

    step: int = 0
    """Optimizer steps completed."""
    tokens: int = 0
    """Tokens consumed across all workers."""
    world_size: int = 1
    """Workers of the run that wrote it."""
    global_batch: int = 0
    """Sequences per optimizer step (kept when resuming on another worker count; 0: from before it was saved)."""
    zero_stage: int = 2
    precision: str = "bf16"
    data_position: dict[str, Any] | None = None
    """The global data position (sequences of the epoch consumed by all ranks), see data/ingest.py."""
    coordinator: dict[str, Any] | None = None
    """Values measured once per run (FLOPs per token, peaks), so a resumed job does not measure again."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics at save time (keep_best reads these)."""
    health: dict[str, Any] = field(default_factory=dict)
    """The saved state's health (loop/health.py): `finite`, the last window's `loss` and `grad_norm`,
    and the run's `rollbacks` so far, each with the data it skipped. Resume, retention and export
    use only checkpoints whose state was healthy (checkpoint/manifest.py `state_health`)."""

    @classmethod
    def from_json(cls, text: str) -> TrainState:
        data = json.loads(text)
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


def rng_states(device: Any) -> dict[str, torch.Tensor]:
    """This rank's random number generator states: the CPU's, and its GPU's on CUDA (dropout and
    any sampling on the device draw from the latter)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor] | torch.Tensor, device: Any) -> None:
    """Restore `rng_states`; a bare tensor is the CPU state of a checkpoint written before the GPU's was kept."""
    if isinstance(states, torch.Tensor):
        states = {"cpu": states}
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


class Checkpointer:
    """One per worker: saves (every rank, same steps), restores, uploads and prunes old checkpoints."""

    def __init__(
        self, config: CheckpointConfig, *, rank: int, world_size: int, run_config: dict[str, Any],
        local_mode_run: tuple[Any, str] | None = None, upload_delay_s: float = 0.0,
    ) -> None:
        """`local_mode_run`: (filesystem, run path) to use under Ray Train's local mode
        (`ScalingConfig(num_workers=0)`: the loop runs in the calling process, Ray has no storage
        context and its report uploads nothing, so saves upload synchronously here).
        `upload_delay_s`: a drill (loop/drills.py) that makes this rank's uploads start late."""
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
        self._scheme = "s3://" if self.filesystem.type_name == "s3" else ""
        self._upload_idle = threading.Event()
        self._upload_idle.set()
        self.last_upload_s: float | None = None
        self.last_save_breakdown: dict[str, float] = {}
        """Of the last save's blocked time: waiting for the previous upload, writing the files
        locally, and Ray's report (with a sync upload inside it)."""
        self._last_save = time.monotonic()
        self._best_cache: dict[str, float | None] = {}
        # "auto" is resolved by the loop (loop/evaluation.py: val/loss when evaluating); left as is, the training loss.
        self._best_metric = "train/loss" if config.best_metric == "auto" else config.best_metric
        self._upload_delay_s = upload_delay_s
        self._saved = False
        self.resized: dict[str, Any] | None = None
        """Set by `restore_state` when the checkpoint was written by another worker count:
        old and new worker count, conversion seconds (None: the cached conversion), the cache's URI."""
        try:
            self.local_rank = ray.train.get_context().get_local_rank()
        except Exception:  # local mode
            self.local_rank = 0
        self.restore_download_bytes: list[int] = []
        """Bytes each rank read from storage when this attempt resumed (empty on a fresh start)."""

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
        import ray.train

        start = time.perf_counter()
        self._upload_idle.wait()  # bounded local disk: at most one checkpoint in flight per worker
        # Every rank's previous checkpoint is in storage past this point, so the prune that rank 0
        # runs after this upload sees it complete (see `_prune`).
        _barrier(self.world_size)
        waited = time.perf_counter()
        local_dir = tempfile.mkdtemp(prefix="raytrain-fast-ckpt-")
        try:
            engine.save_checkpoint(local_dir, tag=DEEPSPEED_TAG)
            torch.save(rng_states(engine.device), Path(local_dir, f"rng_state_rank{self.rank}.pt"))
            if self.rank == 0 and self.restore_download_bytes:
                metrics = {**metrics, "checkpoint/restore_download_bytes_max": max(self.restore_download_bytes),
                           **{f"checkpoint/restore_download_bytes/rank{r}": b for r, b in enumerate(self.restore_download_bytes)}}
            if self.rank == 0:
                state.metrics = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
                Path(local_dir, STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
                Path(local_dir, CONFIG_FILE).write_text(yaml.safe_dump(self._run_config, sort_keys=False))
            write_rank_manifest(local_dir, rank=self.rank, world_size=self.world_size, step=state.step)
        except BaseException:
            shutil.rmtree(local_dir, ignore_errors=True)
            raise
        written = time.perf_counter()
        mode = ray.train.CheckpointUploadMode.ASYNC if self.config.upload == "async" else ray.train.CheckpointUploadMode.SYNC
        self._upload_idle.clear()
        try:
            ray.train.report(
                metrics,
                checkpoint=ray.train.Checkpoint.from_directory(local_dir),
                checkpoint_dir_name=checkpoint_dir_name(state.step),
                checkpoint_upload_mode=mode,
                checkpoint_upload_fn=self._upload,
                delete_local_checkpoint_after_upload=True,
            )
        except BaseException:
            self._upload_idle.set()
            raise
        if self.local_mode:  # Ray's local-mode report stores nothing
            try:
                self._upload(ray.train.Checkpoint.from_directory(local_dir), checkpoint_dir_name(state.step))
            finally:
                shutil.rmtree(local_dir, ignore_errors=True)
        self._saved = True
        self._last_save = time.monotonic()
        end = time.perf_counter()
        self.last_save_breakdown = {
            "wait_previous_s": waited - start, "write_s": written - waited, "report_s": end - written,
        }
        return end - start

    def _upload(self, checkpoint: Any, dir_name: str) -> Any:
        """Runs in Ray's upload thread (async) or inline (sync). Retries, times, prunes."""
        import pyarrow.fs as pafs
        import ray.train

        destination = f"{self.run_path}/{dir_name}"
        start = time.perf_counter()
        try:
            time.sleep(self._upload_delay_s)
            for attempt in range(1, self.config.upload_attempts + 1):
                try:
                    pafs.copy_files(
                        checkpoint.path, destination,
                        source_filesystem=checkpoint.filesystem, destination_filesystem=self.filesystem,
                    )
                    break
                except OSError as error:
                    if attempt == self.config.upload_attempts:
                        raise CheckpointError(
                            f"uploading {dir_name} to {destination} failed {attempt} times, last error: {error}. "
                            "Training stops here; the previous complete checkpoint is what a rerun resumes from."
                        ) from None
                    time.sleep(min(2.0**attempt, 10.0))
            self.last_upload_s = time.perf_counter() - start
            if self.rank == 0:
                self._say_saved(checkpoint.path, dir_name)
                self._prune()
        finally:
            self._upload_idle.set()
        return ray.train.Checkpoint(destination, self.filesystem)

    def _say_saved(self, local_dir: str, dir_name: str) -> None:
        """Rank 0's line for each checkpoint, from the upload thread (off the step loop): its own files'
        size (the others' optimizer shards are about as large) and the upload's seconds."""
        size = sum(p.stat().st_size for p in Path(local_dir).rglob("*") if p.is_file())
        ranks = "" if self.world_size == 1 else " from rank 0"
        step = int(dir_name.rsplit("_", 1)[-1]) if dir_name.rsplit("_", 1)[-1].isdigit() else dir_name
        print(f"Saved checkpoint at step {step} ({size / 1e6:.1f} MB{ranks}, uploaded in {self.last_upload_s:.1f} s)", flush=True)

    def take_upload_s(self) -> float | None:
        """Duration of the last finished upload, once (None if none finished since the last call)."""
        value, self.last_upload_s = self.last_upload_s, None
        return value

    def wait_for_upload(self) -> None:
        self._upload_idle.wait()

    def finish(self) -> None:
        """End of the run (or a stop notice): wait for this rank's last upload, then, once every
        rank's upload is in, rank 0 applies retention one last time. Without this final prune a
        run could end keeping one checkpoint more than keep_last + keep_best: the prune after rank
        0's own last upload may still see another rank's files missing and keep the previous one."""
        self.wait_for_upload()
        _barrier(self.world_size)
        if self.rank == 0 and self._saved:
            self._prune()

    def uri(self, path: str) -> str:
        """A storage path as the user writes it (s3://bucket/... for S3)."""
        return f"{self._scheme}{path}"

    def _prune(self) -> None:
        """Keep the newest keep_last COMPLETE checkpoints, the best keep_best, and anything newer
        than the oldest kept (still uploading from another rank); delete the rest.

        Runs on rank 0 after each of its uploads, when every rank's previous checkpoint is known to
        be in (the barrier in `save`), and once more in `finish`, when every rank's last one is."""
        newest_first = [path for _, path in list_checkpoint_dirs(self.filesystem, self.run_path)]
        complete = [p for p in newest_first if verify_checkpoint(self.filesystem, p, checksums=False)[0]]
        kept_recent = complete[: max(1, self.config.keep_last)]
        if not kept_recent:
            return  # nothing proven complete yet: delete nothing
        oldest_kept = newest_first.index(kept_recent[-1])
        keep = set(newest_first[: oldest_kept + 1])
        # Never the newest healthy one, however many unhealthy ones came after it (an older run's
        # checkpoints of non-finite weights: this version saves none).
        keep.update(next(([p] for p in complete if not checkpoint_health(self.filesystem, p)), []))
        if self.config.keep_best > 0:
            scored = [(value, path) for path in complete if (value := self._metric_of(path)) is not None]
            scored.sort(reverse=self.config.best_mode == "max")
            keep.update(path for _, path in scored[: self.config.keep_best])
        for path in newest_first:
            if path not in keep:
                self.filesystem.delete_dir(path)
                self._best_cache.pop(path, None)
                with contextlib.suppress(OSError):  # its universal form, if a resize made one
                    from raytrain_fast.checkpoint.resize import universal_cache_path

                    self.filesystem.delete_dir(universal_cache_path(path))

    def _metric_of(self, path: str) -> float | None:
        if path not in self._best_cache:
            try:
                with self.filesystem.open_input_stream(f"{path}/{STATE_FILE}") as stream:
                    value = TrainState.from_json(stream.read().decode()).metrics.get(self._best_metric)
                self._best_cache[path] = float(value) if value is not None and math.isfinite(value) else None
            except (OSError, ValueError):
                self._best_cache[path] = None
        return self._best_cache[path]

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
        from ray.train.collective import broadcast_from_rank_zero

        rejected: set[str] = set()
        while True:
            chosen = self._pick_checkpoint(rejected) if self.rank == 0 else None
            chosen = broadcast_from_rank_zero(chosen)
            if chosen is None:
                return None
            download, problem = None, ""
            try:
                download = download_for_rank(self.filesystem, chosen, rank=self.rank)
            except IncompleteCheckpointError as error:
                problem = error.reason
                print(f"Skipping checkpoint {self.uri(chosen)}: {problem} (found by rank {self.rank})", flush=True)
            # One collective: who failed, and how many bytes each rank read (the resume line and metrics).
            gathered = _all_gather_ints([int(bool(problem)), download.downloaded_bytes if download else 0], self.world_size)
            if any(failed for failed, _ in gathered):
                rejected.add(chosen)
                if download is not None and self.local_rank == 0:  # every rank of the node is past it
                    shutil.rmtree(download.local_dir, ignore_errors=True)
                continue
            break
        self._restore_dir = download.local_dir
        self.restore_download_bytes = [downloaded for _, downloaded in gathered]
        if self.rank == 0:
            per_rank = ", ".join(f"{b / 1e6:.2f}" for b in self.restore_download_bytes)
            print(
                f"Checkpoint download: {max(self.restore_download_bytes) / 1e6:.2f} MB at most per rank "
                f"(rank 0 needs {download.needed_bytes / 1e6:.2f} MB of the checkpoint's {download.checkpoint_bytes / 1e6:.2f} MB; "
                f"MB read per rank: {per_rank})", flush=True,
            )
        state = TrainState.from_json(Path(self._restore_dir, STATE_FILE).read_text())
        self.resized, self._load_dir = None, self._restore_dir
        if state.world_size != self.world_size:  # written by another worker count (checkpoint/resize.py)
            self._restore_universal(chosen, state.world_size, step=state.step)
        self._restored_from = chosen
        return state

    def _restore_universal(self, chosen: str, saved_world_size: int, *, step: int) -> None:
        """Rank 0 converts the checkpoint to DeepSpeed's universal layout (downloading all of it
        for that: the conversion needs every shard), or reuses the cached conversion beside it; every
        rank then downloads the universal form (verified like a checkpoint) into a directory of its
        own. The engine must be built with `load_universal` (see `resized`)."""
        from ray.train.collective import broadcast_from_rank_zero

        from raytrain_fast.checkpoint.resize import ensure_universal

        outcome: tuple[str | None, float | None, BaseException | None] = (None, None, None)
        if self.rank == 0:
            full = tempfile.mkdtemp(prefix="raytrain-fast-resize-source-")
            try:
                cache, seconds = ensure_universal(
                    self.filesystem, chosen, local_checkpoint=lambda: download_checkpoint(self.filesystem, chosen, full), step=step
                )
                outcome = (cache, seconds, None)
            except CheckpointError as error:  # every rank raises it, none waits forever
                outcome = (None, None, error)
            except Exception as error:  # noqa: BLE001 - e.g. an upload error: sent as a picklable error
                outcome = (None, None, CheckpointError(f"preparing the universal form of {self.uri(chosen)} failed: {error!r}"))
            finally:
                shutil.rmtree(full, ignore_errors=True)
        cache, seconds, error = broadcast_from_rank_zero(outcome)
        if error is not None:
            self._discard_restore_dir()
            raise error
        self._load_dir = tempfile.mkdtemp(prefix="raytrain-fast-universal-")
        download_checkpoint(self.filesystem, cache, self._load_dir)
        self.resized = {"old": saved_world_size, "new": self.world_size, "seconds": seconds, "cache": self.uri(cache)}

    def _pick_checkpoint(self, rejected: set[str]) -> str | None:
        """Rank 0: the newest checkpoint whose manifests and sizes check out (no file read but the manifests)."""
        for _, path in list_checkpoint_dirs(self.filesystem, self.run_path):
            if path in rejected:
                continue
            unhealthy = checkpoint_health(self.filesystem, path)
            if unhealthy:
                print(f"Skipping checkpoint {self.uri(path)}: {unhealthy}; resuming from the newest healthy one", flush=True)
                continue
            ok, reason = verify_checkpoint(self.filesystem, path, checksums=False)
            if ok:
                return path
            print(f"Skipping checkpoint {self.uri(path)}: {reason}", flush=True)
        return None

    def load_into(self, engine: Any) -> None:
        """Load the checkpoint found by `restore_state` into the engine (model, optimizer, LR schedule, RNG)."""
        try:
            load_path, _ = engine.load_checkpoint(
                self._load_dir, tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
            )
            if load_path is None:
                raise CheckpointError(f"DeepSpeed found no loadable state in {self._restored_from}")
            rng_file = Path(self._load_dir, f"rng_state_rank{self.rank}.pt")
            if rng_file.exists():
                set_rng_states(torch.load(rng_file), engine.device)
            elif self.resized is not None:  # a rank the checkpoint's run did not have: a stream of its own
                from raytrain_fast.checkpoint.resize import rng_seed_for_new_rank

                torch.manual_seed(rng_seed_for_new_rank(step=engine.global_steps, rank=self.rank))
            self._last_save = time.monotonic()
            _barrier(self.world_size)  # the node's ranks share the directory: all have loaded before it goes
        finally:
            self._discard_restore_dir()

    def discard(self) -> None:
        """Drop a restored checkpoint without loading it (the run has nothing left to do)."""
        self._discard_restore_dir()

    def _discard_restore_dir(self) -> None:
        """The restore directory is shared by the node's ranks: its local rank 0 removes it. A
        universal download is this rank's own."""
        if self.local_rank == 0:
            shutil.rmtree(getattr(self, "_restore_dir", ""), ignore_errors=True)
        if getattr(self, "_load_dir", None) not in (None, getattr(self, "_restore_dir", None)):
            shutil.rmtree(self._load_dir, ignore_errors=True)


def _barrier(world_size: int) -> None:
    """Every rank waits here for the others (the gloo/NCCL group Ray Train set up); a no-op alone."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()


def _all_gather_ints(values: list[int], world_size: int) -> list[list[int]]:
    """Every rank's `values` (same length on every rank), in rank order; one collective."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [list(values)]
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        from raytrain_fast.engine.deepspeed_engine import training_device

        device = training_device()
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]
