"""What is in a storage location: runs, their checkpoints, steps and completeness (`raytrain-fast runs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow.fs as pafs

from raytrain_fast._ray_compat import TRAIN_SNAPSHOT_FILE
from raytrain_fast.checkpoint.verify import CheckpointStatus, inspect_checkpoint, list_checkpoint_dirs, saved_state
from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.storage.filesystem import resolve_filesystem


@dataclass(kw_only=True)
class CheckpointInfo(CheckpointStatus):
    """A listed checkpoint: its status (path inside the run's filesystem), name and val/loss."""

    name: str
    val_loss: float | None = None
    """val/loss saved with the checkpoint (None: no evaluation at that step, or incomplete)."""


@dataclass(kw_only=True)
class RunInfo:
    name: str
    path: str
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    """Newest first."""

    @property
    def latest_complete(self) -> CheckpointInfo | None:
        return next((c for c in self.checkpoints if c.complete), None)


def _inspect_run(filesystem: pafs.FileSystem, name: str, path: str, *, checksums: bool) -> RunInfo:
    run = RunInfo(name=name, path=path)
    for _, checkpoint_path in list_checkpoint_dirs(filesystem, path):
        status = inspect_checkpoint(filesystem, checkpoint_path, checksums=checksums)
        run.checkpoints.append(CheckpointInfo(
            **vars(status), name=checkpoint_path.rsplit("/", 1)[-1],
            val_loss=_val_loss(filesystem, checkpoint_path) if status.complete else None,
        ))
    return run


def _val_loss(filesystem: pafs.FileSystem, path: str) -> float | None:
    """The val/loss in a checkpoint's train_state.json."""
    value = (saved_state(filesystem, path).get("metrics") or {}).get("val/loss")
    return float(value) if isinstance(value, (int, float)) else None


def list_runs(storage_uri: str, storage: StorageConfig, *, checksums: bool = False) -> list[RunInfo]:
    """Every run under `storage_uri` (or the run `storage_uri` itself), sorted by name.

    A run is a directory holding `checkpoint_<step>` directories or Ray's checkpoint manager
    snapshot. Completeness is judged from the manifests and file sizes (one listing and a few small
    reads per checkpoint); checksums=True also reads every byte of every checkpoint.
    """
    filesystem, root = resolve_filesystem(storage_uri, storage)
    root = root.rstrip("/")
    if list_checkpoint_dirs(filesystem, root):  # the URI is a run itself
        return [_inspect_run(filesystem, root.rsplit("/", 1)[-1], root, checksums=checksums)]
    runs = []
    entries = filesystem.get_file_info(pafs.FileSelector(root, recursive=False, allow_not_found=True))
    for entry in sorted((e for e in entries if e.type == pafs.FileType.Directory), key=lambda e: e.base_name):
        is_run = bool(list_checkpoint_dirs(filesystem, entry.path)) or (
            filesystem.get_file_info(f"{entry.path}/{TRAIN_SNAPSHOT_FILE}").type == pafs.FileType.File
        )
        if is_run:
            runs.append(_inspect_run(filesystem, entry.base_name, entry.path, checksums=checksums))
    return runs


def _size(num_bytes: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1000 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1000
    return f"{num_bytes:.1f} TB"


def format_runs_table(runs: list[RunInfo], *, storage_uri: str | None = None) -> str:
    """A plain-text table: one line per checkpoint, newest first within each run."""
    if not runs:
        return f"No runs found{f' under {storage_uri}' if storage_uri else ''}."
    header = ("RUN", "CHECKPOINT", "STEP", "RANKS", "SIZE", "VAL/LOSS", "STATUS")
    rows: list[tuple[str, ...]] = []
    for run in runs:
        if not run.checkpoints:
            rows.append((run.name, "-", "-", "-", "-", "-", "no checkpoints yet"))
        for index, checkpoint in enumerate(run.checkpoints):
            ranks = f"{len(checkpoint.ranks_found)}/{checkpoint.world_size or '?'}"
            status = "complete" if checkpoint.complete else f"INCOMPLETE: {checkpoint.reason}"
            if checkpoint.complete and checkpoint is run.latest_complete:
                status += " (newest complete)"
            rows.append((
                run.name if index == 0 else "", checkpoint.name,
                "?" if checkpoint.step is None else str(checkpoint.step), ranks, _size(checkpoint.num_bytes),
                "-" if checkpoint.val_loss is None else f"{checkpoint.val_loss:.4f}", status,
            ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [cell.rjust(w) if i == 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    lines.append("")
    lines.append("complete = every rank's manifest is present and every listed file has its recorded size; "
                 "checksums are verified when a checkpoint is downloaded to resume or export.")
    return "\n".join(lines)
