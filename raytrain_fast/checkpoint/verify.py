"""Whether a checkpoint in storage is complete and unaltered: manifests for ranks 0..world_size-1 that
agree on world size and step, every listed file present with its size (one listing) and checksum
(every byte read); and whether its training state is healthy (no divergence recorded)."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow.fs as pafs

from raytrain_fast.checkpoint.layout import STATE_FILE
from raytrain_fast.checkpoint.rank_manifest import (
    AVAILABLE_ALGORITHMS,
    FileEntry,
    MANIFEST_RE,
    NUM_IO_THREADS,
    REMOTE_CHUNK_BYTES,
    RankManifest,
    hash_stream,
)


_CHECKPOINT_DIR_RE = re.compile(r"^checkpoint_(\d+)$")


@dataclass(kw_only=True)
class CheckpointStatus:
    path: str
    step: int | None
    world_size: int | None = None
    ranks_found: list[int] = field(default_factory=list)
    num_bytes: int = 0
    """Bytes of all files in the checkpoint directory."""
    complete: bool = False
    reason: str = ""
    """Why it is not complete ('' when complete)."""
    manifests: list[RankManifest] = field(default_factory=list, repr=False)


def _listing(filesystem: pafs.FileSystem, path: str) -> dict[str, int]:
    """Relative path -> size of every file under `path` (one recursive listing)."""
    prefix = path.rstrip("/") + "/"
    infos = filesystem.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True))
    return {info.path[len(prefix):]: info.size for info in infos if info.type == pafs.FileType.File and info.path.startswith(prefix)}


def read_file(filesystem: pafs.FileSystem, path: str) -> bytes:
    """The whole file at `path`, in one read."""
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def step_from_name(path: str) -> int | None:
    match = _CHECKPOINT_DIR_RE.match(path.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def inspect_checkpoint(filesystem: pafs.FileSystem, path: str, *, checksums: bool = True) -> CheckpointStatus:
    """Status of the checkpoint directory `path` (no scheme; a path inside `filesystem`).

    checksums=False checks manifests and sizes only (one listing plus one small read per rank):
    cheap enough for listing runs. checksums=True also reads every listed file.
    """
    path = path.rstrip("/")
    status = CheckpointStatus(path=path, step=step_from_name(path))
    status.reason = _inspect(filesystem, path, status, checksums=checksums)
    status.complete = not status.reason
    return status


def _inspect(filesystem: pafs.FileSystem, path: str, status: CheckpointStatus, *, checksums: bool) -> str:
    """Fills in `status` as far as the checks get. Returns why the checkpoint is not complete ("" when it is)."""
    try:
        files = _listing(filesystem, path)
    except OSError as error:
        return f"cannot list it: {error}"
    status.num_bytes = sum(files.values())
    if not files:
        return "it is empty or does not exist"
    manifests, reason = _read_rank_manifests(filesystem, path, files)
    if reason:
        return reason
    status.manifests, status.ranks_found = manifests, [m.rank for m in manifests]
    reason = _check_ranks(status, manifests)
    if reason:
        return reason
    listed, reason = _check_listed_files(manifests, files)
    if reason:
        return reason
    if checksums:
        return _check_checksums(filesystem, path, manifests, listed)
    return ""


def _read_rank_manifests(filesystem: pafs.FileSystem, path: str, files: dict[str, int]) -> tuple[list[RankManifest], str]:
    """Every rank's manifest in the directory (`files`: its listing), or why they cannot be used."""
    manifest_names = sorted((int(m.group(1)), name) for name in files if (m := MANIFEST_RE.match(name)))
    if not manifest_names:
        return [], "it has no manifest: its save or upload never finished (or it was not written by raytrain_fast)"
    manifests: list[RankManifest] = []
    for rank, name in manifest_names:
        raw = b""
        try:
            raw = read_file(filesystem, f"{path}/{name}")
            manifest = RankManifest.from_json(raw)
        except (OSError, ValueError) as error:
            from raytrain_fast.storage import store_corruption_hint

            hint = f". {store_corruption_hint(raw)}" if isinstance(error, ValueError) else ""
            return [], f"{name} is unreadable: {error}{hint}"
        if manifest.algorithm not in AVAILABLE_ALGORITHMS:
            return [], f"{name} uses checksum '{manifest.algorithm}', not available here (pip install xxhash)"
        if manifest.rank != rank:
            return [], f"{name} says it belongs to rank {manifest.rank}"
        manifests.append(manifest)
    return manifests, ""


def _check_ranks(status: CheckpointStatus, manifests: list[RankManifest]) -> str:
    """The manifests come from one save (same world size and step) and every rank wrote one; sets
    the status' world size and step."""
    world_sizes, steps = {m.world_size for m in manifests}, {m.step for m in manifests}
    if len(world_sizes) > 1 or len(steps) > 1:
        return f"its manifests disagree (world sizes {sorted(world_sizes)}, steps {sorted(steps)}): ranks from different saves"
    status.world_size, manifest_step = world_sizes.pop(), steps.pop()
    if status.step is not None and manifest_step != status.step:
        return f"its manifests are for step {manifest_step}, not {status.step}"
    status.step = manifest_step
    missing_ranks = sorted(set(range(status.world_size)) - set(status.ranks_found))
    if missing_ranks:
        return (
            f"manifest missing for rank(s) {', '.join(map(str, missing_ranks))} of {status.world_size}: "
            "those ranks' save or upload never finished"
        )
    return ""


def _check_listed_files(
    manifests: list[RankManifest], files: dict[str, int]
) -> tuple[dict[str, tuple[int, FileEntry]], str]:
    """Every file a manifest lists is there with its size. Returns (relative path -> (rank, entry), why not)."""
    listed: dict[str, tuple[int, FileEntry]] = {}
    for manifest in manifests:
        for entry in manifest.files:
            if entry.path in listed and listed[entry.path][1].checksum != entry.checksum:
                return listed, (
                    f"{entry.path} was written by ranks {listed[entry.path][0]} and {manifest.rank} with different "
                    "contents; Ray's merge of the ranks' directories kept only one"
                )
            listed[entry.path] = (manifest.rank, entry)
    for relative, (rank, entry) in listed.items():
        if relative not in files:
            return listed, f"{relative} (written by rank {rank}) is missing"
        if files[relative] != entry.size:
            return listed, f"{relative} has {files[relative]:,} bytes, its manifest says {entry.size:,} (truncated or altered)"
    return listed, ""


def _check_checksums(
    filesystem: pafs.FileSystem, path: str, manifests: list[RankManifest], listed: dict[str, tuple[int, FileEntry]]
) -> str:
    """Every listed file's contents match its checksum (read in parallel)."""
    algorithms = {m.rank: m.algorithm for m in manifests}

    def check(item: tuple[str, tuple[int, FileEntry]]) -> str:
        relative, (rank, entry) = item
        with filesystem.open_input_stream(f"{path}/{relative}") as stream:
            _, checksum = hash_stream(stream.read, algorithm=algorithms[rank], chunk_bytes=REMOTE_CHUNK_BYTES)
        return "" if checksum == entry.checksum else f"{relative} does not match its checksum (altered or corrupted after save)"

    return first_problem(check, listed)


def first_problem(check: Callable[[Any], str], jobs: Mapping[str, Any]) -> str:
    """`check` over every (relative path, job) on the I/O threads: the first problem any reported
    ("" when none), or the OSError that stopped them."""
    try:
        with ThreadPoolExecutor(NUM_IO_THREADS) as pool:
            problems = [p for p in pool.map(check, jobs.items()) if p]
    except OSError as error:
        return f"a file could not be read: {error}"
    return problems[0] if problems else ""


def verify_checkpoint(filesystem: pafs.FileSystem, path: str, *, checksums: bool = True) -> tuple[bool, str]:
    """(complete, reason it is not) for the checkpoint directory `path` inside `filesystem`."""
    status = inspect_checkpoint(filesystem, path, checksums=checksums)
    return status.complete, status.reason


def list_checkpoint_dirs(filesystem: pafs.FileSystem, run_path: str) -> list[tuple[int, str]]:
    """(step, path) of every `checkpoint_<digits>` directory of a run, newest (highest step) first."""
    infos = filesystem.get_file_info(pafs.FileSelector(run_path.rstrip("/"), recursive=False, allow_not_found=True))
    found = [
        (step, info.path)
        for info in infos
        if info.type == pafs.FileType.Directory and (step := step_from_name(info.path)) is not None
    ]
    return sorted(found, reverse=True)


def state_health(state: Mapping[str, Any]) -> str:
    """Why a checkpoint's saved TrainState (as a dict) is not healthy, or "" when it is: its
    `health` record says the state was not finite, or (a checkpoint written before that record
    existed) its metrics at save time hold a non-finite loss or gradient norm."""
    health = state.get("health") or {}
    if health.get("finite") is False:
        return f"its state was not healthy when saved (loss {health.get('loss')}, grad norm {health.get('grad_norm')})"
    metrics = state.get("metrics") or {}
    for name in ("train/loss", "train/grad_norm"):
        value = metrics.get(name)
        if isinstance(value, (int, float)) and not math.isfinite(value):
            return f"its {name} at save time is {value} (the weights may be non-finite)"
    return ""


def saved_state(filesystem: pafs.FileSystem, path: str) -> dict[str, Any]:
    """The train_state.json of the checkpoint at `path` as a dict ({} when it cannot be read). One small read."""
    try:
        state = json.loads(read_file(filesystem, f"{path.rstrip('/')}/{STATE_FILE}"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def checkpoint_health(filesystem: pafs.FileSystem, path: str) -> str:
    """`state_health` of the checkpoint at `path` ("" = healthy); a checkpoint without a readable
    state file is left to the completeness checks."""
    return state_health(saved_state(filesystem, path))
