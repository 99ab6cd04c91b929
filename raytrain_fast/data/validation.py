"""The evaluation side of the validation split: which held-out sequences each rank evaluates.

The set is fixed for a run (the same sequences at every evaluation, so values compare over time)
and spread evenly over the whole split rather than its first rows, which would all come from the
first few documents. Rank r of W evaluates its contiguous share of that set. The split is small
(capped when prepared), so each rank reads its rows with pyarrow once, when the loop starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from raytrain_fast.data.manifest import Manifest, join_uri
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem


@dataclass(frozen=True)
class SourceSplit:
    """One source's part of the validation tokens (its val/loss/<name>)."""

    name: str
    rows: int
    """This rank's rows of the source, consecutive in `tokens` in the order of the splits."""
    total: int
    """The source's evaluation sequences across all ranks."""
    weight: float
    """The source's normalised mixture weight: val/loss is the weighted mean of the per-source losses."""


def evaluation_ids(num_available: int, count: int) -> np.ndarray:
    """`count` distinct seq_ids of a split of `num_available`, evenly spaced from 0."""
    if not 0 < count <= num_available:
        raise DataError(f"cannot evaluate {count} sequences of a validation split of {num_available}")
    return np.arange(count, dtype=np.int64) * num_available // count


def load_validation_tokens(
    manifest: Manifest, *, count: int, rank: int, world_size: int, storage: StorageConfig | None = None
) -> np.ndarray:
    """(n, seq_len + 1) int64 tokens of this rank's share of the `count` evaluation sequences."""
    split = manifest.validation
    if split is None:
        raise DataError(f"the prepared data at {manifest.root} has no validation split; prepare it again")
    ids = evaluation_ids(split.num_sequences, count)
    wanted = ids[rank * count // world_size: (rank + 1) * count // world_size]  # shares differ by one sequence at most
    import pyarrow.parquet as pq

    filesystem, root = resolve_filesystem(manifest.root, storage or StorageConfig())
    rows: list[np.ndarray] = []
    for shard in split.shards:
        local = wanted[(wanted >= shard.first_seq_id) & (wanted < shard.first_seq_id + shard.num_rows)] - shard.first_seq_id
        if not len(local):
            continue
        table = pq.read_table(join_uri(root, shard.path), filesystem=filesystem, columns=["tokens"])
        tokens = table.column("tokens").combine_chunks().flatten().to_numpy(zero_copy_only=False)
        rows.append(tokens.reshape(shard.num_rows, manifest.seq_len + 1)[local].astype(np.int64))
    width = manifest.seq_len + 1
    return np.concatenate(rows) if rows else np.zeros((0, width), dtype=np.int64)


def load_validation(
    sources: list, *, count: int, rank: int, world_size: int, storage: StorageConfig | None = None,
) -> tuple[np.ndarray, list[SourceSplit]]:
    """(tokens, splits): `count` evaluation sequences of every source that has a validation split (or
    all of its split, if smaller), this rank's share of each, one source after the other. Sources
    without a split get no val/loss; the weights of the others are normalised again."""
    with_split = [s for s in sources if s.manifest.validation is not None and s.manifest.validation.num_sequences > 0]
    total_weight = sum(s.weight for s in with_split)
    parts, splits = [], []
    for source in with_split:
        wanted = min(count, source.manifest.validation.num_sequences)
        rows = load_validation_tokens(source.manifest, count=wanted, rank=rank, world_size=world_size, storage=storage)
        parts.append(rows)
        splits.append(SourceSplit(name=source.name, rows=len(rows), total=wanted, weight=source.weight / total_weight))
    width = (sources[0].manifest.seq_len + 1) if sources else 1
    return (np.concatenate(parts) if parts else np.zeros((0, width), dtype=np.int64)), splits


