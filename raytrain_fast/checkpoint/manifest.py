"""Per-rank manifests that prove a checkpoint in storage is complete and unaltered: what a rank writes
(rank_manifest.py), how a checkpoint in storage is checked (verify.py) and read back (download.py).
This module hands their names on.

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

from raytrain_fast.checkpoint.download import (
    IncompleteCheckpointError,
    RankDownload,
    download_checkpoint,
    download_for_rank,
    file_rank,
    find_resumable_checkpoint,
    node_restore_dir,
    rank_needs,
)
from raytrain_fast.checkpoint.rank_manifest import (
    FileEntry,
    RankManifest,
    default_algorithm,
    manifest_name,
    write_rank_manifest,
)
from raytrain_fast.checkpoint.verify import (
    CheckpointStatus,
    checkpoint_health,
    inspect_checkpoint,
    list_checkpoint_dirs,
    state_health,
    step_from_name,
    verify_checkpoint,
)

__all__ = [
    "CheckpointStatus",
    "FileEntry",
    "IncompleteCheckpointError",
    "RankDownload",
    "RankManifest",
    "checkpoint_health",
    "default_algorithm",
    "download_checkpoint",
    "download_for_rank",
    "file_rank",
    "find_resumable_checkpoint",
    "inspect_checkpoint",
    "list_checkpoint_dirs",
    "manifest_name",
    "node_restore_dir",
    "rank_needs",
    "state_health",
    "step_from_name",
    "verify_checkpoint",
    "write_rank_manifest",
]
