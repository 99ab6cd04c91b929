"""Training-side ingest: a per-rank, resumable stream of micro-batches from prepared shards.

The plan is deterministic, so a resumed run continues exactly where it stopped:
  - each epoch, the shards are put in an order drawn from (seed, epoch) and read as one stream;
  - with N sequences and W ranks, rank r takes stream rows [r * N // W, (r + 1) * N // W), so every rank
    has the same number of sequences per epoch (the N % W rows at the end of the stream wait for the
    next epoch, where a different order puts other rows there);
  - each rank drops the last partial micro-batch of its share.
Every rank therefore sits at the same `DataPosition` (epoch, sequences consumed in it) after every
step: one position, saved by rank 0, restores all of them.

Reading goes through Ray Data: one small read task per shard segment (num_cpus=0, one at a time, on
this node) feeds `iter_torch_batches(prefetch_batches=...)`, whose threads collate the next batches while
the step runs; a producer thread starts the pipeline as soon as the iterator is built and hands batches
over through a small queue, so the step loop only ever blocks on `queue.get()` (the loop times that
wait itself: TrainMetrics' data wait).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_fast.data.manifest import MANIFEST_NAME, Manifest
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

logger = logging.getLogger("raytrain_fast")
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its id under this label
_SEGMENTS_PER_DATASET = 64  # epochs are chained into one Ray Dataset until it has this many segments


@dataclass(kw_only=True)
class DataPosition:
    """Where a rank's data stream stands: the next batch starts at sequence `consumed` of `epoch`."""

    epoch: int = 0
    consumed: int = 0
    """Sequences this rank has consumed in `epoch` (the same on every rank)."""
    world_size: int | None = None
    """World size the position was taken at; resuming on another world size is approximate."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DataPosition:
        unknown = set(data) - {"epoch", "consumed", "world_size"}
        if unknown:
            raise DataError(f"data position has unknown keys {sorted(unknown)}: {data}")
        position = cls(**data)
        if position.epoch < 0 or position.consumed < 0:
            raise DataError(f"data position must not be negative: {data}")
        return position


# ---------------------------------------------------------------------------------------------
# Manifest loading and checks


def load_manifest(uri: str, storage: StorageConfig | None = None) -> Manifest:
    """The manifest of prepared data at `uri` (its directory or the manifest.json itself)."""
    root = uri.rstrip("/")
    if root.endswith("/" + MANIFEST_NAME) or root == MANIFEST_NAME:
        root = root[: -len(MANIFEST_NAME)].rstrip("/")
    filesystem, path = resolve_filesystem(root, storage or StorageConfig())
    manifest_path = f"{path.rstrip('/')}/{MANIFEST_NAME}"
    try:
        with filesystem.open_input_stream(manifest_path) as stream:
            raw = stream.read()
    except FileNotFoundError:
        raise DataError(
            f"no prepared data at '{uri}': {MANIFEST_NAME} is missing. Run `raytrain-fast prepare-data "
            f"--output {uri} ...` first (a preparation that was interrupted writes no manifest)."
        ) from None
    except OSError as error:
        raise DataError(f"cannot read {MANIFEST_NAME} at '{uri}': {error}") from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as error:
        from raytrain_fast.storage import store_corruption_hint

        raise DataError(f"{MANIFEST_NAME} at '{uri}' is not valid JSON ({error}). {store_corruption_hint(raw)}.") from None
    return Manifest.from_dict(data, root=root if "://" in root else path)


def check_manifest_matches(
    manifest: Manifest,
    *,
    seq_len: int,
    vocab_size: int,
    micro_batch: int | None = None,
    world_size: int | None = None,
    max_sequences: int | None = None,
) -> list[str]:
    """Problems that make `manifest` unusable for this model / batch setup (empty list = fine).

    Meant to be raised as one ConfigError before any worker starts.
    """
    problems = []
    where = manifest.root or "the prepared data"
    if manifest.seq_len != seq_len:
        problems.append(
            f"data.seq_len is {seq_len} but {where} was prepared with seq_len {manifest.seq_len}; "
            f"set data.seq_len={manifest.seq_len} or prepare the data again with seq_len {seq_len}"
        )
    tokenizer = manifest.tokenizer
    if tokenizer.vocab_size > vocab_size:
        problems.append(
            f"model.vocab_size ({vocab_size}) is smaller than the vocabulary of the tokenizer the data was "
            f"prepared with ({tokenizer.name}: {tokenizer.vocab_size} tokens); set model.vocab_size >= "
            f"{tokenizer.vocab_size} (a multiple of 64 is fastest: {-(-tokenizer.vocab_size // 64) * 64})"
        )
    elif manifest.max_token_id >= vocab_size:
        problems.append(f"{where} holds token id {manifest.max_token_id}, outside model.vocab_size ({vocab_size})")
    if micro_batch is not None and world_size is not None:
        available = manifest.num_sequences if not max_sequences else min(max_sequences, manifest.num_sequences)
        per_rank = available // world_size
        if per_rank < micro_batch:
            problems.append(
                f"{where} has {available:,} sequences to use: {per_rank} per worker, fewer than one micro-batch of "
                f"{micro_batch}; add data, or lower train.micro_batch or resources.num_workers"
            )
    return problems


# ---------------------------------------------------------------------------------------------
# The deterministic plan


@dataclass(frozen=True)
class Segment:
    """Rows [start, stop) of shard `shard`."""

    shard: int
    start: int
    stop: int


def shard_order(num_shards: int, *, seed: int, epoch: int) -> list[int]:
    """The shards' order in `epoch`: sorted by a hash of (seed, epoch, shard).

    A hash, not numpy's RNG, so the order cannot change with a library upgrade between a run and its resume.
    """
    keys = [hashlib.blake2b(f"{seed}:{epoch}:{i}".encode(), digest_size=8).digest() for i in range(num_shards)]
    return sorted(range(num_shards), key=keys.__getitem__)


def usable_rows(manifest: Manifest, max_sequences: int | None = None) -> list[int]:
    """Rows of each shard that are used: all of them, or only those with seq_id < max_sequences."""
    if not max_sequences:
        return [s.num_rows for s in manifest.shards]
    return [max(0, min(s.num_rows, max_sequences - s.first_seq_id)) for s in manifest.shards]


def rank_plan(shard_rows: list[int], *, seed: int, epoch: int, rank: int, world_size: int) -> list[Segment]:
    """Rank `rank`'s share of `epoch`, in reading order: rows [r * N // W, (r + 1) * N // W) of the shuffled stream."""
    per_rank = sum(shard_rows) // world_size
    return _stream_slice(shard_rows, shard_order(len(shard_rows), seed=seed, epoch=epoch), rank * per_rank, (rank + 1) * per_rank)


def _stream_slice(shard_rows: list[int], order: list[int], lo: int, hi: int) -> list[Segment]:
    segments, offset = [], 0
    for shard in order:
        rows = shard_rows[shard]
        start, stop = max(lo, offset), min(hi, offset + rows)
        if start < stop:
            segments.append(Segment(shard, start - offset, stop - offset))
        offset += rows
        if offset >= hi:
            break
    return segments


def _skip(segments: list[Segment], rows: int) -> list[Segment]:
    out = []
    for segment in segments:
        length = segment.stop - segment.start
        if rows >= length:
            rows -= length
            continue
        out.append(Segment(segment.shard, segment.start + rows, segment.stop))
        rows = 0
    return out


def _take(segments: list[Segment], rows: int) -> list[Segment]:
    out = []
    for segment in segments:
        if rows <= 0:
            break
        length = min(rows, segment.stop - segment.start)
        out.append(Segment(segment.shard, segment.start, segment.start + length))
        rows -= length
    return out


# ---------------------------------------------------------------------------------------------
# Ray Data pieces (run in read tasks and in iter_torch_batches' threads)


class _ReadSegments:
    """map_batches function: rows of (path, start, stop) -> those rows of those Parquet shards."""

    def __init__(self, filesystem: pafs.FileSystem) -> None:
        self.filesystem = filesystem

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        import pyarrow.parquet as pq

        tables = []
        for path, start, stop in zip(batch["path"], batch["start"], batch["stop"]):
            table = pq.read_table(str(path), filesystem=self.filesystem, columns=["seq_id", "tokens"])
            tables.append(table.slice(int(start), int(stop) - int(start)))
        return pa.concat_tables(tables)


def _collate_class():
    from ray.data.collate_fn import ArrowBatchCollateFn

    class TokenCollate(ArrowBatchCollateFn):
        """Arrow batch -> {"tokens": (B, seq_len + 1) int64, "seq_ids": (B,) int64}, without per-row Python."""

        def __call__(self, batch: pa.Table) -> dict:
            import torch

            tokens = batch.column("tokens").combine_chunks()
            ids = tokens.flatten().to_numpy(zero_copy_only=False)  # flatten() honours slice offsets
            seq_ids = np.asarray(batch.column("seq_id").combine_chunks().to_numpy(), dtype=np.int64).copy()
            return {
                "tokens": torch.from_numpy(ids.astype(np.int64).reshape(len(tokens), -1)),
                "seq_ids": torch.from_numpy(seq_ids),
            }

    return TokenCollate()


@dataclass
class _Item:
    tokens: Any
    seq_ids: Any
    position: DataPosition
    """Position after this batch."""


@dataclass
class _Failure:
    error: BaseException


# ---------------------------------------------------------------------------------------------
# The iterator


class BatchIterator(Iterator):
    """(tokens, seq_ids) micro-batches for one rank, epoch after epoch, resumable at a `DataPosition`.

    tokens: (micro_batch, seq_len + 1) int64 on `device`; seq_ids: (micro_batch,) int64 on the CPU.
    Every rank of a run must use the same manifest, seed, micro_batch and world_size.
    """

    def __init__(
        self,
        manifest: Manifest,
        *,
        rank: int,
        world_size: int,
        micro_batch: int,
        seed: int = 0,
        prefetch_batches: int = 2,
        device: Any = "cpu",
        position: DataPosition | None = None,
        storage: StorageConfig | None = None,
        max_sequences: int | None = None,
    ) -> None:
        import torch

        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        if micro_batch < 1 or prefetch_batches < 1:
            raise DataError(f"micro_batch and prefetch_batches must be >= 1, got {micro_batch} and {prefetch_batches}")
        self.manifest, self.rank, self.world_size, self.micro_batch, self.seed = manifest, rank, world_size, micro_batch, seed
        self.prefetch_batches = prefetch_batches
        self.device = torch.device(device)
        self.shard_rows = usable_rows(manifest, max_sequences)
        self.sequences_per_epoch = sum(self.shard_rows) // world_size
        """Sequences each rank owns per epoch (its last partial micro-batch is dropped)."""
        self.batches_per_epoch = self.sequences_per_epoch // micro_batch
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the prepared data at {manifest.root} has {sum(self.shard_rows):,} usable sequences: "
                f"{self.sequences_per_epoch} per rank with {world_size} ranks, fewer than one micro-batch of {micro_batch}"
            )
        self._position = self._normalize(position or DataPosition())
        self._filesystem, root_path = resolve_filesystem(manifest.root, storage or StorageConfig())
        self._paths = [f"{root_path.rstrip('/')}/{shard.path}" for shard in manifest.shards]
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch_batches)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=f"batches-rank{rank}", daemon=True)
        self._thread.start()  # the pipeline warms up while the caller builds its model

    @property
    def position(self) -> DataPosition:
        """Where the next batch starts. Save it with the checkpoint (same on every rank)."""
        return DataPosition(epoch=self._position.epoch, consumed=self._position.consumed, world_size=self.world_size)

    def __next__(self) -> tuple[Any, Any]:
        item = self._queue.get()
        if isinstance(item, _Failure):
            self._queue.put(item)  # every later next() raises too
            raise item.error
        self._position = item.position
        tokens = item.tokens
        if self.device.type != "cpu":
            tokens = tokens.to(self.device, non_blocking=True)  # from pinned memory: an async copy
        return tokens, item.seq_ids

    def close(self) -> None:
        """Stop the producer thread and the Ray Data pipeline behind it."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_thread", None) is not None and self._thread.is_alive():
            self._stop.set()

    # -- plan -------------------------------------------------------------------------------

    def _normalize(self, position: DataPosition) -> DataPosition:
        consumed = position.consumed
        if position.world_size is not None and position.world_size != self.world_size:
            consumed = consumed * position.world_size // self.world_size
            logger.warning(
                "resuming the data stream on %d ranks from a position taken on %d: continuing at about the same "
                "point of epoch %d, but not exactly (some sequences may repeat or be skipped in this epoch)",
                self.world_size, position.world_size, position.epoch,
            )
        if consumed + self.micro_batch > self.sequences_per_epoch:
            return DataPosition(epoch=position.epoch + 1, consumed=0)
        return DataPosition(epoch=position.epoch, consumed=consumed)

    def _epoch_segments(self, epoch: int, skip: int) -> tuple[list[Segment], int]:
        """(segments this rank reads in `epoch` after `skip` sequences, number of batches they make)."""
        plan = rank_plan(self.shard_rows, seed=self.seed, epoch=epoch, rank=self.rank, world_size=self.world_size)
        num_batches = (self.sequences_per_epoch - skip) // self.micro_batch
        return _take(_skip(plan, skip), num_batches * self.micro_batch), num_batches

    def _chunks(self) -> Iterator[list[tuple[int, int, int, list[Segment]]]]:
        """Lists of (epoch, first consumed, batches, segments), chained until a dataset has enough segments."""
        epoch, skip = self._position.epoch, self._position.consumed
        while True:
            chunk, count = [], 0
            while count < _SEGMENTS_PER_DATASET:
                segments, num_batches = self._epoch_segments(epoch, skip)
                chunk.append((epoch, skip, num_batches, segments))
                count += len(segments)
                epoch, skip = epoch + 1, 0
            yield chunk

    # -- producer thread --------------------------------------------------------------------

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for chunk in self._chunks():
                if not self._produce_chunk(chunk):
                    return
        except BaseException as error:  # handed to the caller's next()
            self._put(_Failure(error))

    def _produce_chunk(self, chunk: list[tuple[int, int, int, list[Segment]]]) -> bool:
        runs: list[tuple[int, int]] = []  # (first seq_id, count): what the batches must hold, in order
        items = []
        for _, _, _, segments in chunk:
            for s in segments:
                runs.append((self.manifest.shards[s.shard].first_seq_id + s.start, s.stop - s.start))
                items.append({"path": self._paths[s.shard], "start": s.start, "stop": s.stop})
        cursor = _RunCursor(runs)
        batches = self._dataset(items).iter_torch_batches(
            batch_size=self.micro_batch,
            prefetch_batches=self.prefetch_batches,
            collate_fn=_collate_class(),
            device="cpu",  # moved in next(): seq_ids stay on the host for bookkeeping
            pin_memory=self.device.type == "cuda",
            drop_last=False,  # every epoch's rows are already a multiple of micro_batch
        )
        planned = sum(num_batches for _, _, num_batches, _ in chunk)
        epochs = iter(chunk)
        epoch, skip, num_batches, _ = next(epochs)
        in_epoch = produced = 0
        for batch in batches:
            while in_epoch == num_batches:  # the previous batch ended its epoch
                epoch, skip, num_batches, _ = next(epochs, (None, 0, 0, None))
                in_epoch = 0
                if epoch is None:
                    raise DataError("internal: the data pipeline returned more batches than planned")
            seq_ids = batch["seq_ids"]
            if not np.array_equal(seq_ids.numpy(), cursor.take(self.micro_batch)):
                raise DataError(
                    f"internal: the data pipeline returned sequences out of order (epoch {epoch}, rank {self.rank}); "
                    "exact resume would break"
                )
            in_epoch += 1
            produced += 1
            if in_epoch == num_batches:
                after = DataPosition(epoch=epoch + 1, consumed=0)
            else:
                after = DataPosition(epoch=epoch, consumed=skip + in_epoch * self.micro_batch)
            if not self._put(_Item(tokens=batch["tokens"], seq_ids=seq_ids, position=after)):
                return False
        if produced != planned:
            raise DataError(f"internal: the data pipeline returned {produced} batches, {planned} were planned")
        return True

    def _dataset(self, items: list[dict]):
        import ray
        import ray.data

        dataset = ray.data.from_items(items, override_num_blocks=len(items))
        dataset = dataset.map_batches(
            _ReadSegments(self._filesystem),
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.TaskPoolStrategy(size=1),
            # The training workers hold every CPU of their node; a reader that asked for one would never
            # be scheduled. Reading a shard is milliseconds of I/O and decoding, off the step's thread.
            num_cpus=0,
            label_selector={NODE_ID_LABEL: ray.get_runtime_context().get_node_id()},  # read next to the trainer
        )
        context = dataset.context
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        context.execution_options.preserve_order = True  # the plan's order is the resume contract
        return dataset


class _RunCursor:
    """Walks (first, count) runs of consecutive seq_ids, handing out the next n ids."""

    def __init__(self, runs: list[tuple[int, int]]) -> None:
        self.runs, self.index, self.offset = runs, 0, 0

    def take(self, n: int) -> np.ndarray:
        parts = []
        while n > 0 and self.index < len(self.runs):
            first, count = self.runs[self.index]
            length = min(n, count - self.offset)
            parts.append(np.arange(first + self.offset, first + self.offset + length, dtype=np.int64))
            self.offset += length
            n -= length
            if self.offset == count:
                self.index, self.offset = self.index + 1, 0
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


__all__ = [
    "BatchIterator", "DataPosition", "Segment", "check_manifest_matches", "load_manifest", "rank_plan",
    "shard_order", "usable_rows",
]
