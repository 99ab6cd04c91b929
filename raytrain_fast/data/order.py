"""The deterministic, world-size-free order of the training stream (see ingest.py's docstring and
docs/data.md, "How training reads the shards"): shards ordered by a hash of (seed, epoch), cut into
shuffle windows whose sequences are permuted by a hash of (seed, epoch, window); epochs follow each
other in one endless stream. Hashes, not a library RNG, so the order survives library upgrades.
A place in it is one global index (data/mixture.py `MixturePosition`)."""

from __future__ import annotations

import hashlib

import numpy as np

from raytrain_fast.data.manifest import Manifest

SHUFFLE_WINDOW_SHARDS = 16
"""Shards whose sequences are shuffled together (about 16M tokens at the default shard size)."""


def shard_order(num_shards: int, *, seed: int, epoch: int) -> list[int]:
    """The shards' order in `epoch`: sorted by a hash of (seed, epoch, shard)."""
    keys = [hashlib.blake2b(f"{seed}:{epoch}:{i}".encode(), digest_size=8).digest() for i in range(num_shards)]
    return sorted(range(num_shards), key=keys.__getitem__)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """A fixed 64-bit mixing function (SplitMix64's finalizer), vectorized: stable across library versions."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def window_permutation(length: int, *, seed: int, epoch: int, window: int) -> np.ndarray:
    """Positions 0..length-1 of a window in their shuffled order, drawn from (seed, epoch, window)."""
    key = int.from_bytes(hashlib.blake2b(f"{seed}:{epoch}:{window}".encode(), digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        keys = _splitmix64(np.arange(length, dtype=np.uint64) ^ np.uint64(key))
    return np.argsort(keys, kind="stable")


def usable_rows(manifest: Manifest, max_sequences: int | None = None) -> list[int]:
    """Rows of each shard that are used: all of them, or only those with seq_id < max_sequences."""
    if not max_sequences:
        return [s.num_rows for s in manifest.shards]
    return [max(0, min(s.num_rows, max_sequences - s.first_seq_id)) for s in manifest.shards]


def window_rows(shard_rows: list[int]) -> float:
    """Sequences in an average shuffle window of a source whose shards hold `shard_rows` usable rows."""
    return sum(shard_rows) * min(SHUFFLE_WINDOW_SHARDS, len(shard_rows)) / max(1, len(shard_rows))


class EpochOrder:
    """The global order of one epoch: stream offset -> (shard, row), windows computed on first use."""

    def __init__(self, shard_rows: list[int], *, seed: int, epoch: int) -> None:
        self.seed, self.epoch = seed, epoch
        order = [s for s in shard_order(len(shard_rows), seed=seed, epoch=epoch) if shard_rows[s] > 0]
        self.order = np.asarray(order, dtype=np.int64)
        rows = np.asarray([shard_rows[s] for s in order], dtype=np.int64)
        self.shard_start = np.concatenate([[0], np.cumsum(rows)])  # stream offset of each ordered shard
        self.window_start = self.shard_start[::SHUFFLE_WINDOW_SHARDS]
        if self.window_start[-1] != self.shard_start[-1]:
            self.window_start = np.append(self.window_start, self.shard_start[-1])
        self._permutations: dict[int, np.ndarray] = {}

    def windows_of(self, offsets: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.window_start, offsets, side="right") - 1

    def locate(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of the sequences at these stream offsets of the epoch."""
        windows = self.windows_of(offsets)
        source = np.empty_like(offsets)
        for window in np.unique(windows):
            mask = windows == window
            start = int(self.window_start[window])
            source[mask] = start + self._permutation(int(window))[offsets[mask] - start]
        ordered = np.searchsorted(self.shard_start, source, side="right") - 1
        return self.order[ordered], source - self.shard_start[ordered]

    def _permutation(self, window: int) -> np.ndarray:
        if window not in self._permutations:
            length = int(self.window_start[window + 1] - self.window_start[window])
            self._permutations[window] = window_permutation(length, seed=self.seed, epoch=self.epoch, window=window)
        return self._permutations[window]


def rank_indexes(
    start: int, *, rank: int, world_size: int, micro_batch: int, batches: int, first_batch: int
) -> np.ndarray:
    """Stream indexes of rank `rank`'s micro-batches first_batch .. first_batch + batches - 1 after index
    `start`, in order: micro-batch k is start + (k * world_size + rank) * micro_batch .. + micro_batch - 1."""
    k = np.arange(first_batch, first_batch + batches, dtype=np.int64)
    firsts = start + (k * world_size + rank) * micro_batch
    return (firsts[:, None] + np.arange(micro_batch, dtype=np.int64)[None, :]).ravel()


def locate_absolute(
    shard_rows: list[int], absolute: np.ndarray, *, seed: int, orders: dict[int, EpochOrder],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(epochs, windows, shards, rows) of the sequences at these indexes of the endless stream
    (epoch after epoch). `orders`: the caller's cache of EpochOrder by epoch."""
    total = sum(shard_rows)
    epochs, offsets = absolute // total, absolute % total
    windows, shards, rows = np.empty_like(absolute), np.empty_like(absolute), np.empty_like(absolute)
    for epoch in np.unique(epochs).tolist():
        if epoch not in orders:
            for old in [e for e in orders if e < min(epochs)]:
                del orders[old]  # the stream only moves forward
            orders[epoch] = EpochOrder(shard_rows, seed=seed, epoch=epoch)
        mask = epochs == epoch
        windows[mask] = orders[epoch].windows_of(offsets[mask])
        shards[mask], rows[mask] = orders[epoch].locate(offsets[mask])
    return epochs, windows, shards, rows
