"""Which checkpoints a run keeps: the newest `keep_last` complete ones, the best `keep_best` by a
metric (one by default: a run that diverged keeps its best checkpoint from before, however old), the
newest healthy one, and anything newer than the oldest kept (still uploading)."""

from __future__ import annotations

import contextlib
import math
from typing import Any

from raytrain_fast.checkpoint.verify import checkpoint_health, list_checkpoint_dirs, saved_state, verify_checkpoint
from raytrain_fast.config.checkpoint import CheckpointConfig


class Retention:
    """Rank 0's pruning of the run's checkpoints in storage."""

    def __init__(self, config: CheckpointConfig, *, filesystem: Any, run_path: str) -> None:
        self.config, self.filesystem, self.run_path = config, filesystem, run_path
        # "auto" is resolved by the loop (loop/evaluation.py: val/loss when evaluating); left as is, the training loss.
        self.best_metric = "train/loss" if config.best_metric == "auto" else config.best_metric
        self._best_cache: dict[str, dict[str, Any]] = {}
        """Each checkpoint's metrics at save time (train_state.json), read once."""

    def prune(self) -> None:
        """Keep the newest keep_last COMPLETE checkpoints, the best keep_best, and anything newer
        than the oldest kept (still uploading from another rank); delete the rest.

        The caller runs it when every rank's previous checkpoint is known to be in storage (rank 0,
        after each of its uploads and once more when the run ends: see `Checkpointer`)."""
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
            keep.update(self.best(complete))
        for path in newest_first:
            if path not in keep:
                self._delete(path)

    def best(self, complete: list[str]) -> list[str]:
        """The best keep_best of `complete` by best_metric; by train/loss when that is val/loss and no
        checkpoint has one (evaluation off when they were saved)."""
        metrics = [self.best_metric] + (["train/loss"] if self.best_metric == "val/loss" else [])
        for metric in metrics:
            scored = [(value, path) for path in complete if (value := self._metric_of(path, metric)) is not None]
            if scored:
                scored.sort(reverse=self.config.best_mode == "max" and metric == self.best_metric)
                return [path for _, path in scored[: self.config.keep_best]]
        return []

    def _delete(self, path: str) -> None:
        self.filesystem.delete_dir(path)
        self._best_cache.pop(path, None)
        with contextlib.suppress(OSError):  # its universal form, if a resize made one
            from raytrain_fast.checkpoint.resize import universal_cache_path

            self.filesystem.delete_dir(universal_cache_path(path))

    def _metric_of(self, path: str, metric: str) -> float | None:
        if path not in self._best_cache:
            self._best_cache[path] = saved_state(self.filesystem, path).get("metrics") or {}
        value = self._best_cache[path].get(metric)
        return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
