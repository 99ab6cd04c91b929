"""Per-rank manifests that prove a checkpoint in storage is complete and unaltered.

At save time every rank writes `manifest.rank<r>.json` LAST into its local checkpoint directory,
listing each file that rank wrote (relative path, size, checksum) plus rank, world size and step.
Ray Train merges every rank's directory into one `checkpoint_<step>` directory in storage, so a
checkpoint there is complete when:
  - manifests for ranks 0..world_size-1 all exist and agree on world size and step, and
  - every file they list is present with the listed size (cheap: one listing) and checksum
    (reads every byte: done while downloading for resume, see `download_checkpoint`).
A worker that died mid-save or mid-upload leaves a manifest or a listed file missing; a file
altered after upload fails its checksum. Either way resume skips it and takes the previous one.

Checksums: xxh3-64 (xxhash, a Ray dependency; ~10 GB/s, so hashing a multi-GB checkpoint from
the page cache costs well under a second) or zlib's crc32 where xxhash is missing. The manifest
names its algorithm, so a reader verifies with the one the writer used.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from raytrain_fast.checkpoint.layout import STATE_FILE
from raytrain_fast.errors import CheckpointError

MANIFEST_FORMAT = 1
LOCAL_CHUNK_BYTES = 1 << 20  # page-cache reads at save time
REMOTE_CHUNK_BYTES = 16 << 20  # one ranged GET per chunk from S3: fewer, larger requests
NUM_IO_THREADS = 4
_MANIFEST_RE = re.compile(r"^manifest\.rank(\d+)\.json$")
_CHECKPOINT_DIR_RE = re.compile(r"^checkpoint_(\d+)$")


def manifest_name(rank: int) -> str:
    return f"manifest.rank{rank}.json"


# ---------------------------------------------------------------- checksums


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _new_hasher(algorithm: str):
    if algorithm == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    raise CheckpointError(f"unknown checksum algorithm '{algorithm}' in a checkpoint manifest")


def _available_algorithms() -> set[str]:
    return {"crc32", default_algorithm()}


def default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "crc32"
    return "xxh3_64"


def _hash_stream(read: Callable[[int], bytes], *, algorithm: str, chunk_bytes: int, sink=None) -> tuple[int, str]:
    """(bytes read, hex checksum) of a stream; every chunk also goes to `sink` (a writable file) if given."""
    hasher, size = _new_hasher(algorithm), 0
    while chunk := read(chunk_bytes):
        hasher.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return size, hasher.hexdigest()


# ---------------------------------------------------------------- the manifest


@dataclass(kw_only=True)
class FileEntry:
    path: str
    """Relative to the checkpoint directory, '/'-separated."""
    size: int
    checksum: str


@dataclass(kw_only=True)
class RankManifest:
    rank: int
    world_size: int
    step: int
    algorithm: str
    files: list[FileEntry] = field(default_factory=list)
    format: int = MANIFEST_FORMAT
    created_unix: float = 0.0

    @property
    def num_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankManifest:
        """Raises ValueError (with what is wrong) for anything that is not a valid manifest."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a format-{MANIFEST_FORMAT} manifest")
        try:
            files = [FileEntry(path=str(f["path"]), size=int(f["size"]), checksum=str(f["checksum"])) for f in data["files"]]
            return cls(
                rank=int(data["rank"]), world_size=int(data["world_size"]), step=int(data["step"]),
                algorithm=str(data["algorithm"]), files=files, created_unix=float(data.get("created_unix", 0.0)),
            )
        except (KeyError, TypeError) as error:
            raise ValueError(f"missing or malformed field {error}") from None


def write_rank_manifest(local_dir: str, *, rank: int, world_size: int, step: int) -> RankManifest:
    """List, size and checksum every file this rank wrote into `local_dir`; write the manifest last.

    Call after every other file of this rank's checkpoint is written (DeepSpeed's save, the train
    state, the config) and before `ray.train.report`. Costs one read of the rank's files, normally
    from the page cache.
    """
    algorithm = default_algorithm()
    root = Path(local_dir)
    entries: list[FileEntry] = []
    for directory, subdirs, names in os.walk(root):
        subdirs.sort()
        for name in sorted(names):
            file_path = Path(directory, name)
            relative = file_path.relative_to(root).as_posix()
            if _MANIFEST_RE.match(relative) or name.startswith(".manifest."):
                continue
            with open(file_path, "rb") as handle:
                size, checksum = _hash_stream(handle.read, algorithm=algorithm, chunk_bytes=LOCAL_CHUNK_BYTES)
            entries.append(FileEntry(path=relative, size=size, checksum=checksum))
    manifest = RankManifest(
        rank=rank, world_size=world_size, step=step, algorithm=algorithm, files=entries, created_unix=time.time()
    )
    temporary = root / f".manifest.rank{rank}.json.tmp"
    temporary.write_text(manifest.to_json())
    os.replace(temporary, root / manifest_name(rank))  # atomic: the manifest exists whole or not at all
    return manifest


# ---------------------------------------------------------------- verification


@dataclass(kw_only=True)
class CheckpointStatus:
    path: str
    step: int | None
    world_size: int | None
    ranks_found: list[int]
    num_bytes: int
    """Bytes of all files in the checkpoint directory."""
    complete: bool
    reason: str
    """Why it is not complete ('' when complete)."""
    checksums_verified: bool
    manifests: list[RankManifest] = field(default_factory=list, repr=False)


def _listing(filesystem: pafs.FileSystem, path: str) -> dict[str, int]:
    """Relative path -> size of every file under `path` (one recursive listing)."""
    prefix = path.rstrip("/") + "/"
    infos = filesystem.get_file_info(pafs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True))
    return {info.path[len(prefix):]: info.size for info in infos if info.type == pafs.FileType.File and info.path.startswith(prefix)}


def _read_small(filesystem: pafs.FileSystem, path: str) -> bytes:
    with filesystem.open_input_stream(path) as stream:
        return stream.read()


def _step_from_name(path: str) -> int | None:
    match = _CHECKPOINT_DIR_RE.match(path.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


def inspect_checkpoint(filesystem: pafs.FileSystem, path: str, *, checksums: bool = True) -> CheckpointStatus:
    """Status of the checkpoint directory `path` (no scheme; a path inside `filesystem`).

    checksums=False checks manifests and sizes only (one listing plus one small read per rank):
    cheap enough for listing runs. checksums=True also reads every listed file.
    """
    path = path.rstrip("/")
    status = CheckpointStatus(
        path=path, step=_step_from_name(path), world_size=None, ranks_found=[], num_bytes=0,
        complete=False, reason="", checksums_verified=False,
    )
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
        reason = _check_checksums(filesystem, path, manifests, listed)
        if reason:
            return reason
        status.checksums_verified = True
    return ""


def _read_rank_manifests(filesystem: pafs.FileSystem, path: str, files: dict[str, int]) -> tuple[list[RankManifest], str]:
    """Every rank's manifest in the directory (`files`: its listing), or why they cannot be used."""
    manifest_names = sorted((int(m.group(1)), name) for name in files if (m := _MANIFEST_RE.match(name)))
    if not manifest_names:
        return [], "it has no manifest: its save or upload never finished (or it was not written by raytrain_fast)"
    manifests: list[RankManifest] = []
    for rank, name in manifest_names:
        raw = b""
        try:
            raw = _read_small(filesystem, f"{path}/{name}")
            manifest = RankManifest.from_json(raw)
        except (OSError, ValueError) as error:
            from raytrain_fast.storage import store_corruption_hint

            hint = f". {store_corruption_hint(raw)}" if isinstance(error, ValueError) else ""
            return [], f"{name} is unreadable: {error}{hint}"
        if manifest.algorithm not in _available_algorithms():
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
            _, checksum = _hash_stream(stream.read, algorithm=algorithms[rank], chunk_bytes=REMOTE_CHUNK_BYTES)
        return "" if checksum == entry.checksum else f"{relative} does not match its checksum (altered or corrupted after save)"

    try:
        with ThreadPoolExecutor(NUM_IO_THREADS) as pool:
            problems = [p for p in pool.map(check, listed.items()) if p]
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
        if info.type == pafs.FileType.Directory and (step := _step_from_name(info.path)) is not None
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


def checkpoint_health(filesystem: pafs.FileSystem, path: str) -> str:
    """`state_health` of the checkpoint at `path` ("" = healthy). One small read; a checkpoint
    without a readable state file is left to the completeness checks."""
    try:
        state = json.loads(_read_small(filesystem, f"{path.rstrip('/')}/{STATE_FILE}"))
    except (OSError, ValueError):
        return ""
    return state_health(state) if isinstance(state, dict) else ""


def find_resumable_checkpoint(
    filesystem: pafs.FileSystem, run_path: str, *, checksums: bool = True, download_to: str | None = None
) -> tuple[str | None, list[tuple[str, str]]]:
    """(newest complete and healthy checkpoint of the run or None, [(skipped newer checkpoint, reason), ...]).

    download_to: also download the chosen checkpoint there, verifying checksums while downloading
    (each byte is read once: the cheap way to resume from S3). Without it, checksums=True reads
    every file of the candidate once just to verify it.
    """
    skipped: list[tuple[str, str]] = []
    for _, path in list_checkpoint_dirs(filesystem, run_path):
        unhealthy = checkpoint_health(filesystem, path)
        if unhealthy:
            skipped.append((path, unhealthy))
            continue
        if download_to is not None:
            try:
                download_checkpoint(filesystem, path, download_to)
                return path, skipped
            except IncompleteCheckpointError as error:
                skipped.append((path, error.reason))
                continue
        ok, reason = verify_checkpoint(filesystem, path, checksums=checksums)
        if ok:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


# ---------------------------------------------------------------- download


class IncompleteCheckpointError(CheckpointError):
    """A checkpoint failed verification; `reason` says why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"checkpoint {path} is incomplete: {reason}")
        self.path, self.reason = path, reason

    def __reduce__(self):
        return (IncompleteCheckpointError, (self.path, self.reason))


def _first_problem(fetch: Callable[[Any], str], jobs: Mapping[str, Any]) -> str:
    """`fetch` over every (relative path, job) on the I/O threads: the first problem any reported
    ("" when none), or the OSError that stopped them."""
    try:
        with ThreadPoolExecutor(NUM_IO_THREADS) as pool:
            problems = [p for p in pool.map(fetch, jobs.items()) if p]
    except OSError as error:
        problems = [f"a file could not be read: {error}"]
    return problems[0] if problems else ""


def _download_verified(
    filesystem: pafs.FileSystem, path: str, relative: str, target: Path, *, algorithm: str, entry: FileEntry | None
) -> tuple[int, str]:
    """Stream `path/relative` into `target`, hashing as it goes: (bytes read, "" or the problem)."""
    with filesystem.open_input_stream(f"{path}/{relative}") as stream, open(target, "wb") as sink:
        size, checksum = _hash_stream(stream.read, algorithm=algorithm, chunk_bytes=REMOTE_CHUNK_BYTES, sink=sink)
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
    jobs: dict[str, tuple[str, FileEntry | None]] = {}
    for manifest in status.manifests:
        jobs[manifest_name(manifest.rank)] = (manifest.algorithm, None)
        for entry in manifest.files:
            jobs[entry.path] = (manifest.algorithm, entry)

    def fetch(item: tuple[str, tuple[str, FileEntry | None]]) -> str:
        relative, (algorithm, entry) = item
        target = Path(local_dir, relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        return _download_verified(filesystem, path, relative, target, algorithm=algorithm, entry=entry)[1]

    problem = _first_problem(fetch, jobs)
    if problem:
        shutil.rmtree(local_dir, ignore_errors=True)
        os.makedirs(local_dir)
        raise IncompleteCheckpointError(path, problem)
    return local_dir


# ---------------------------------------------------------------- per-rank download (resume)

# Files that belong to one rank: DeepSpeed's optimizer shard (and, under ZeRO-3, its model-state
# part), our RNG states. A rank resuming at the same world size opens only its own (DeepSpeed
# 0.19.8, engine._get_all_zero_checkpoint_state_dicts: without zero_optimization.elastic_checkpoint
# it loads only the shard of its own data-parallel rank and passes None for the others; the other
# names are only tested with os.path.exists, which tolerates their absence).
_RANK_FILE_RES = (
    re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$"),
    re.compile(r"(?:^|/)rng_state_rank(\d+)\.pt$"),
)


def file_rank(relative: str) -> int | None:
    """The rank a checkpoint file belongs to, or None for a file every rank loads (model states,
    train state, config, manifests, `latest`)."""
    for pattern in _RANK_FILE_RES:
        if match := pattern.search(relative):
            return int(match.group(1))
    return None


def rank_needs(relative: str, rank: int) -> bool:
    owner = file_rank(relative)
    return owner is None or owner == rank


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


def download_for_rank(
    filesystem: pafs.FileSystem, path: str, *, rank: int, status: CheckpointStatus | None = None, base_dir: str | None = None
) -> RankDownload:
    """Download what rank `rank` loads from the checkpoint `path` (the model states, its own
    optimizer shard and RNG states, the small state files, every manifest) into a directory shared
    by the ranks of this node, checksumming every byte as it streams.

    Ranks of one node share one download: each file is fetched under a per-file lock (fcntl) by
    the first rank that needs it and appears under its final name only once its checksum matched,
    so the others find it there and read nothing. Raises IncompleteCheckpointError when a file
    this rank needs is missing or altered (the partial file is removed; the directory is kept for
    the node's other ranks and removed by `Checkpointer`).
    """
    import fcntl

    path = path.rstrip("/")
    if status is None:
        status = inspect_checkpoint(filesystem, path, checksums=False)
    if not status.complete:
        raise IncompleteCheckpointError(path, status.reason)
    local_dir = node_restore_dir(path, status.manifests, base=base_dir)
    os.makedirs(os.path.join(local_dir, ".locks"), exist_ok=True)
    jobs: dict[str, tuple[str, FileEntry | None]] = {}
    for manifest in status.manifests:
        jobs[manifest_name(manifest.rank)] = (manifest.algorithm, None)
        for entry in manifest.files:
            if rank_needs(entry.path, rank):
                jobs[entry.path] = (manifest.algorithm, entry)
    needed = sum(entry.size for _, entry in jobs.values() if entry is not None)
    downloaded = 0
    counter_lock = threading.Lock()

    def fetch(item: tuple[str, tuple[str, FileEntry | None]]) -> str:
        nonlocal downloaded
        relative, (algorithm, entry) = item
        target = Path(local_dir, relative)
        if target.exists():
            return ""
        lock_path = Path(local_dir, ".locks", relative.replace("/", "__") + ".lock")
        with open(lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if target.exists():  # another rank of the node fetched it while this one waited
                    return ""
                target.parent.mkdir(parents=True, exist_ok=True)
                partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
                try:
                    size, problem = _download_verified(filesystem, path, relative, partial, algorithm=algorithm, entry=entry)
                    with counter_lock:
                        downloaded += size
                    if problem:
                        return problem
                    os.replace(partial, target)  # whole and verified, or absent
                finally:
                    partial.unlink(missing_ok=True)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
        return ""

    problem = _first_problem(fetch, jobs)
    if problem:
        raise IncompleteCheckpointError(path, problem)
    return RankDownload(
        local_dir=local_dir, downloaded_bytes=downloaded, needed_bytes=needed, checkpoint_bytes=status.num_bytes
    )
