"""Reading a checkpoint back, every byte checked against its manifest while it streams: the whole
checkpoint (`download_checkpoint`, and `find_resumable_checkpoint`, the newest that checks out), or
only the files one rank loads, shared by the ranks of a node (`download_for_rank`)."""

from __future__ import annotations

import os
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from raytrain_fast.checkpoint.rank_manifest import FileEntry, REMOTE_CHUNK_BYTES, RankManifest, hash_stream, manifest_name
from raytrain_fast.checkpoint.verify import (
    CheckpointStatus,
    checkpoint_health,
    first_problem,
    inspect_checkpoint,
    list_checkpoint_dirs,
    verify_checkpoint,
)
from raytrain_fast.errors import CheckpointError


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint failed verification; `reason` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"checkpoint {path} is incomplete: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):
        return (IncompleteCheckpointError, (self.path, self.reason))


def _download_verified(
    filesystem: pafs.FileSystem, path: str, relative: str, target: Path, *, algorithm: str, entry: FileEntry | None
) -> tuple[int, str]:
    """Stream `path/relative` into `target` (its folder made), hashing as it goes: (bytes read, "" or the problem)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with filesystem.open_input_stream(f"{path}/{relative}") as stream, open(target, "wb") as sink:
        size, checksum = hash_stream(stream.read, algorithm=algorithm, chunk_bytes=REMOTE_CHUNK_BYTES, sink=sink)
    if entry is not None and (size != entry.size or checksum != entry.checksum):
        return size, f"{relative} does not match its checksum (altered or corrupted after save)"
    return size, ""


def download_checkpoint(filesystem: pafs.FileSystem, path: str, local_dir: str) -> str:
    """Download the checkpoint `path` into `local_dir` (emptied first), verifying every file against
    its manifest while it streams (one read per byte). Returns local_dir.

    Raises IncompleteCheckpointError (a CheckpointError) when it is incomplete or altered; local_dir
    is then emptied again, so a half-verified checkpoint is never left behind to be loaded.
    """
    path = path.rstrip("/")
    status = inspect_checkpoint(filesystem, path, checksums=False)  # manifests + sizes first: cheap
    if not status.complete:
        raise IncompleteCheckpointError(path, status.reason)
    shutil.rmtree(local_dir, ignore_errors=True)
    os.makedirs(local_dir)
    jobs = _manifest_jobs(status)

    def fetch(item: tuple[str, tuple[str, FileEntry | None]]) -> str:
        relative, (algorithm, entry) = item
        target = Path(local_dir, relative)
        return _download_verified(filesystem, path, relative, target, algorithm=algorithm, entry=entry)[1]

    problem = first_problem(fetch, jobs)
    if problem:
        shutil.rmtree(local_dir, ignore_errors=True)
        os.makedirs(local_dir)
        raise IncompleteCheckpointError(path, problem)
    return local_dir


def find_resumable_checkpoint(
    filesystem: pafs.FileSystem, run_path: str, *, download_to: str | None = None
) -> tuple[str | None, list[tuple[str, str]]]:
    """(newest complete and healthy checkpoint of the run or None, [(skipped newer checkpoint, reason), ...]).

    download_to: also download the chosen checkpoint there, verifying checksums while downloading
    (each byte is read once: the cheap way to resume from S3). Without it, every file of the
    candidate is read once just to verify it.
    """
    skipped: list[tuple[str, str]] = []
    for _, path in list_checkpoint_dirs(filesystem, run_path):
        reason = checkpoint_health(filesystem, path)
        if not reason and download_to is None:
            reason = verify_checkpoint(filesystem, path)[1]
        elif not reason:
            try:
                download_checkpoint(filesystem, path, download_to)
            except IncompleteCheckpointError as error:
                reason = error.reason
        if not reason:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


# --- one rank's share (resume) ------------------------------------------------------------------

_RNG_STATE_FILE = re.compile(r"(?:^|/)rng_state_rank(\d+)\.pt$")


def file_rank(relative: str) -> int | None:
    """The rank a checkpoint file belongs to, or None for a file every rank loads (model states,
    train state, config, manifests, `latest`): DeepSpeed's optimizer shard of that rank (named by
    DeepSpeed: engine/deepspeed_compat.py, imported here because it imports torch) or our RNG states."""
    from raytrain_fast.engine.deepspeed_compat import zero_shard_rank

    if match := _RNG_STATE_FILE.search(relative):
        return int(match.group(1))
    return zero_shard_rank(relative)


@dataclass(kw_only=True)
class RankDownload:
    """What `download_for_rank` did on this rank."""

    local_dir: str
    """The node-local directory holding the files (shared by the node's ranks)."""
    downloaded_bytes: int
    """Bytes this rank read from storage (files another rank of the node fetched first are not counted)."""
    needed_bytes: int
    """Bytes of the files this rank loads (its share of the checkpoint)."""
    checkpoint_bytes: int
    """Bytes of the whole checkpoint (every rank's files): what each rank downloaded before."""


def node_restore_dir(path: str, manifests: list[RankManifest], *, base: str | None = None) -> str:
    """A directory on this node for one checkpoint, the same for every rank of the node: named
    after the checkpoint's path and its manifests' creation times (a checkpoint rewritten under the
    same name gets another directory)."""
    import hashlib
    import tempfile

    key = path + "|" + ",".join(f"{m.rank}:{m.created_unix!r}" for m in manifests)
    name = hashlib.sha1(key.encode()).hexdigest()[:16]
    return os.path.join(base or tempfile.gettempdir(), "raytrain-fast-restore", name)


def _manifest_jobs(status: CheckpointStatus, *, rank: int | None = None) -> dict[str, tuple[str, FileEntry | None]]:
    """relative path -> (checksum algorithm, its manifest entry): every manifest (entry None: they are
    checked as a whole by `inspect_checkpoint`) and the files it lists, only those `rank` loads if given."""
    jobs: dict[str, tuple[str, FileEntry | None]] = {}
    for manifest in status.manifests:
        jobs[manifest_name(manifest.rank)] = (manifest.algorithm, None)
        for entry in manifest.files:
            if rank is None or file_rank(entry.path) in (None, rank):
                jobs[entry.path] = (manifest.algorithm, entry)
    return jobs


def _fetch_once_per_node(
    filesystem: pafs.FileSystem, path: str, local_dir: str, relative: str, *, algorithm: str, entry: FileEntry | None
) -> tuple[int, str]:
    """Fetch `relative` into the node's `local_dir` unless a rank of the node already did: (bytes read,
    "" or the problem). A per-file lock (fcntl) makes the first rank fetch it; the file appears under
    its final name only once its checksum matched, so the others find it there and read nothing."""
    import fcntl

    target = Path(local_dir, relative)
    if target.exists():
        return 0, ""
    lock_path = Path(local_dir, ".locks", relative.replace("/", "__") + ".lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if target.exists():  # another rank of the node fetched it while this one waited
                return 0, ""
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            try:
                size, problem = _download_verified(filesystem, path, relative, partial, algorithm=algorithm, entry=entry)
                if not problem:
                    os.replace(partial, target)  # whole and verified, or absent
                return size, problem
            finally:
                partial.unlink(missing_ok=True)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def download_for_rank(
    filesystem: pafs.FileSystem, path: str, *, rank: int, base_dir: str | None = None
) -> RankDownload:
    """Download what rank `rank` loads from the checkpoint `path` (the model states, its own
    optimizer shard and RNG states, the small state files, every manifest) into a directory shared
    by the ranks of this node, checksumming every byte as it streams.

    Ranks of one node share one download (`_fetch_once_per_node`). Raises IncompleteCheckpointError
    when a file this rank needs is missing or altered (the partial file is removed; the directory is
    kept for the node's other ranks and removed by `Checkpointer`).
    """
    path = path.rstrip("/")
    status = inspect_checkpoint(filesystem, path, checksums=False)
    if not status.complete:
        raise IncompleteCheckpointError(path, status.reason)
    local_dir = node_restore_dir(path, status.manifests, base=base_dir)
    os.makedirs(os.path.join(local_dir, ".locks"), exist_ok=True)
    jobs = _manifest_jobs(status, rank=rank)
    downloaded = 0
    counter_lock = threading.Lock()

    def fetch(item: tuple[str, tuple[str, FileEntry | None]]) -> str:
        nonlocal downloaded
        relative, (algorithm, entry) = item
        size, problem = _fetch_once_per_node(filesystem, path, local_dir, relative, algorithm=algorithm, entry=entry)
        with counter_lock:
            downloaded += size
        return problem

    problem = first_problem(fetch, jobs)
    if problem:
        raise IncompleteCheckpointError(path, problem)
    needed = sum(entry.size for _, entry in jobs.values() if entry is not None)
    return RankDownload(
        local_dir=local_dir, downloaded_bytes=downloaded, needed_bytes=needed, checkpoint_bytes=status.num_bytes
    )
