"""Resuming from the newest checkpoint that checks out: rank 0 picks it, each rank downloads only what
it loads (ranks of a node sharing one download), and a checkpoint of another worker count goes
through DeepSpeed's universal layout (checkpoint/resize.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from raytrain_fast.checkpoint.download import IncompleteCheckpointError, download_checkpoint, download_for_rank
from raytrain_fast.checkpoint.layout import DEEPSPEED_TAG, STATE_FILE
from raytrain_fast.checkpoint.state import TrainState, all_gather_ints, barrier, set_rng_states
from raytrain_fast.checkpoint.verify import checkpoint_health, list_checkpoint_dirs, verify_checkpoint
from raytrain_fast.console import say
from raytrain_fast.errors import CheckpointError


class Restorer:
    """One per worker: finds, downloads and loads the checkpoint a run resumes from."""

    def __init__(self, *, filesystem: Any, run_path: str, rank: int, world_size: int, local_rank: int, scheme: str) -> None:
        self.filesystem, self.run_path = filesystem, run_path
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self._scheme = scheme
        self.resized: dict[str, Any] | None = None
        """Set by `restore_state` when the checkpoint was written by another worker count:
        old and new worker count, conversion seconds (None: the cached conversion), the cache's URI."""
        self.download_bytes: list[int] = []
        """Bytes each rank read from storage when this attempt resumed (empty on a fresh start)."""
        self._restore_dir: str | None = None
        self._load_dir: str | None = None
        self._restored_from = ""

    def uri(self, path: str) -> str:
        return f"{self._scheme}{path}"

    def restore_state(self) -> TrainState | None:
        """Find and download the newest complete checkpoint; returns its TrainState (None if none).
        If any rank's files fail their checksums, every rank moves on to the previous checkpoint."""
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
                say(f"Skipping checkpoint {self.uri(chosen)}: {problem} (found by rank {self.rank})", rank=self.rank, per_rank=True)
            # One collective: who failed, and how many bytes each rank read (the resume line and metrics).
            gathered = all_gather_ints([int(bool(problem)), download.downloaded_bytes if download else 0], self.world_size)
            if not any(failed for failed, _ in gathered):
                break
            rejected.add(chosen)
            if download is not None and self.local_rank == 0:  # every rank of the node is past it
                shutil.rmtree(download.local_dir, ignore_errors=True)
        self._restore_dir = self._load_dir = download.local_dir
        self.download_bytes = [downloaded for _, downloaded in gathered]
        per_rank = ", ".join(f"{b / 1e6:.2f}" for b in self.download_bytes)
        say(
            f"Checkpoint download: {max(self.download_bytes) / 1e6:.2f} MB at most per rank "
            f"(rank 0 needs {download.needed_bytes / 1e6:.2f} MB of the checkpoint's {download.checkpoint_bytes / 1e6:.2f} MB; "
            f"MB read per rank: {per_rank})", rank=self.rank,
        )
        state = TrainState.from_json(Path(self._restore_dir, STATE_FILE).read_text())
        self.resized = None
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

        outcome: tuple[str | None, float | None, BaseException | None] = (None, None, None)
        if self.rank == 0:
            outcome = self._convert(chosen, step=step)
        cache, seconds, error = broadcast_from_rank_zero(outcome)
        if error is not None:
            self.discard()
            raise error
        self._load_dir = tempfile.mkdtemp(prefix="raytrain-fast-universal-")
        download_checkpoint(self.filesystem, cache, self._load_dir)
        self.resized = {"old": saved_world_size, "new": self.world_size, "seconds": seconds, "cache": self.uri(cache)}

    def _convert(self, chosen: str, *, step: int) -> tuple[str | None, float | None, BaseException | None]:
        """Rank 0: (the universal form's path, conversion seconds, None) or (None, None, the error to raise on every rank)."""
        from raytrain_fast.checkpoint.resize import ensure_universal

        full = tempfile.mkdtemp(prefix="raytrain-fast-resize-source-")
        try:
            cache, seconds = ensure_universal(
                self.filesystem, chosen, local_checkpoint=lambda: download_checkpoint(self.filesystem, chosen, full), step=step
            )
            return cache, seconds, None
        except CheckpointError as error:  # every rank raises it, none waits forever
            return None, None, error
        except Exception as error:  # noqa: BLE001 - e.g. an upload error: sent as a picklable error
            return None, None, CheckpointError(f"preparing the universal form of {self.uri(chosen)} failed: {error!r}")
        finally:
            shutil.rmtree(full, ignore_errors=True)

    def _pick_checkpoint(self, rejected: set[str]) -> str | None:
        """Rank 0: the newest checkpoint whose manifests and sizes check out (no file read but the manifests)."""
        for _, path in list_checkpoint_dirs(self.filesystem, self.run_path):
            if path in rejected:
                continue
            unhealthy = checkpoint_health(self.filesystem, path)
            if unhealthy:
                say(f"Skipping checkpoint {self.uri(path)}: {unhealthy}; resuming from the newest healthy one", rank=self.rank)
                continue
            ok, reason = verify_checkpoint(self.filesystem, path, checksums=False)
            if ok:
                return path
            say(f"Skipping checkpoint {self.uri(path)}: {reason}", rank=self.rank)
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
            barrier(self.world_size)  # the node's ranks share the directory: all have loaded before it goes
        finally:
            self.discard()

    def discard(self) -> None:
        """Remove the downloaded directories. The restore directory is shared by the node's ranks:
        its local rank 0 removes it. A universal download is this rank's own."""
        if self.local_rank == 0 and self._restore_dir:
            shutil.rmtree(self._restore_dir, ignore_errors=True)
        if self._load_dir not in (None, self._restore_dir):
            shutil.rmtree(self._load_dir, ignore_errors=True)
