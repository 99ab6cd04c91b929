"""What a rank writes last into its checkpoint directory: `manifest.rank<r>.json`, listing each file
it wrote (relative path, size, checksum) with its rank, world size and step. Checksums: xxh3-64
(xxhash), or zlib's crc32 where xxhash is missing; the manifest names its algorithm, so a reader
verifies with the one the writer used (docs/architecture.md, "Checkpoint layout")."""

from __future__ import annotations

import json
import os
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from raytrain_fast.errors import CheckpointError

try:
    import xxhash
except ImportError:
    xxhash = None

MANIFEST_FORMAT = 1
LOCAL_CHUNK_BYTES = 1 << 20  # page-cache reads at save time
REMOTE_CHUNK_BYTES = 16 << 20  # one ranged GET per chunk from S3: fewer, larger requests
NUM_IO_THREADS = 4
MANIFEST_RE = re.compile(r"^manifest\.rank(\d+)\.json$")
DEFAULT_ALGORITHM = "crc32" if xxhash is None else "xxh3_64"
AVAILABLE_ALGORITHMS = {"crc32", DEFAULT_ALGORITHM}


def manifest_name(rank: int) -> str:
    return f"manifest.rank{rank}.json"


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: bytes | memoryview) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _new_hasher(algorithm: str):
    if algorithm == "xxh3_64" and xxhash is not None:
        return xxhash.xxh3_64()
    if algorithm == "crc32":
        return _Crc32()
    raise CheckpointError(f"unknown checksum algorithm '{algorithm}' in a checkpoint manifest")


def hash_stream(read: Callable[[int], bytes], *, algorithm: str, chunk_bytes: int, sink=None) -> tuple[int, str]:
    """(bytes read, hex checksum) of a stream; every chunk also goes to `sink` (a writable file) if given."""
    hasher, size = _new_hasher(algorithm), 0
    while chunk := read(chunk_bytes):
        hasher.update(chunk)
        size += len(chunk)
        if sink is not None:
            sink.write(chunk)
    return size, hasher.hexdigest()


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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> RankManifest:
        """Raises ValueError (with what is wrong) for anything that is not a valid manifest."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise ValueError(f"not a format-{MANIFEST_FORMAT} manifest")
        try:
            known = {entry.name for entry in fields(cls)}  # a newer writer's extra keys are ignored
            given = {key: value for key, value in data.items() if key in known}
            return cls(**{**given, "files": [FileEntry(**entry) for entry in data["files"]]})
        except (KeyError, TypeError) as error:
            raise ValueError(f"missing or malformed field {error}") from None


def write_rank_manifest(local_dir: str, *, rank: int, world_size: int, step: int) -> RankManifest:
    """List, size and checksum every file this rank wrote into `local_dir`; write the manifest last,
    once every other file of the rank's checkpoint is written (one read of them, normally from the page cache)."""
    algorithm = DEFAULT_ALGORITHM
    root = Path(local_dir)
    entries: list[FileEntry] = []
    for directory, subdirs, names in os.walk(root):
        subdirs.sort()
        for name in sorted(names):
            file_path = Path(directory, name)
            relative = file_path.relative_to(root).as_posix()
            if MANIFEST_RE.match(relative) or name.startswith(".manifest."):
                continue
            with open(file_path, "rb") as handle:
                size, checksum = hash_stream(handle.read, algorithm=algorithm, chunk_bytes=LOCAL_CHUNK_BYTES)
            entries.append(FileEntry(path=relative, size=size, checksum=checksum))
    manifest = RankManifest(
        rank=rank, world_size=world_size, step=step, algorithm=algorithm, files=entries, created_unix=time.time()
    )
    temporary = root / f".manifest.rank{rank}.json.tmp"
    temporary.write_text(manifest.to_json())
    os.replace(temporary, root / manifest_name(rank))  # atomic: the manifest exists whole or not at all
    return manifest
