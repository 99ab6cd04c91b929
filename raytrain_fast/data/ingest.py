"""Training-side ingest: a per-rank, resumable stream of micro-batches from prepared shards.

The order, the rank slicing, the global `DataPosition` and the sequential reads are described in
docs/data.md ("How training reads the shards"); the order itself is `order.py`. With W ranks and
micro-batch B, rank r's k-th micro-batch since the start position P is
stream[P + (k * W + r) * B : P + (k * W + r + 1) * B].

Reading goes through Ray Data: one small read task per piece of the plan (num_cpus=0, one at a time,
on this node); `iter_torch_batches` collates the next batches while the step runs. A producer thread
hands batches over through a small queue, `HANDOVER_BATCHES` micro-batches at a time, so the step loop
only ever blocks on `queue.get()`, once per group (the loop times that wait: TrainMetrics' data wait).
"""

from __future__ import annotations

import collections
import json
import logging
import pickle
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs

from raytrain_fast._ray_compat import DATA_EXECUTOR_LOGGER
from raytrain_fast.data.manifest import MANIFEST_NAME, Manifest, shard_locations
from raytrain_fast.data.order import (  # the order is its own module; these names stay importable from here
    SHUFFLE_WINDOW_SHARDS, DataPosition, EpochOrder, locate_absolute, rank_stream, shard_order, usable_rows,
    window_permutation, window_rows,
)
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

logger = logging.getLogger("raytrain_fast")
NODE_ID_LABEL = "ray.io/node-id"  # every Ray node carries its id under this label
_WINDOWS_PER_DATASET = 2  # a Ray Dataset covers about this many windows' worth of micro-batches
HANDOVER_BATCHES = 8
"""Micro-batches per Ray Data batch and per hand-over to the step loop. Each batch Ray Data delivers
wakes its prefetch, format and producer threads, and each wake takes a core from a torch thread (on
2 cores, a step's parallel regions then wait for it): in groups, those wakes come once per 8 micro-batches,
and the loop takes 7 of 8 micro-batches from its own buffer without any thread."""


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
# Ray Data pieces (run in read tasks and in iter_torch_batches' threads)


class _ReadPieces:
    """map_batches function: one pickled piece ([(source, shard path)], which of them and which row each
    sequence comes from, in stream order) -> those rows, in that order. Shards are read whole: sequential
    reads, shuffled in memory. `filesystems`: one per source (a mixture's, or the single source's)."""

    def __init__(self, filesystems: list[pafs.FileSystem]) -> None:
        self.filesystems = filesystems

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        from raytrain_fast.data.manifest import read_shard

        tables = []
        for spec in batch["piece"]:
            paths, which, rows = pickle.loads(spec)
            read = [read_shard(path, self.filesystems[source]) for source, path in paths]
            offsets = np.concatenate([[0], np.cumsum([t.num_rows for t in read])])
            tables.append(pa.concat_tables(read).take(pa.array(offsets[which] + rows)))
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
    position: Any
    """Position after this batch (every rank has taken it): a DataPosition, or a mixture's."""


@dataclass
class _Failure:
    error: BaseException


@dataclass
class _Chunk:
    first_batch: int
    pieces: list[bytes]
    seq_ids: np.ndarray
    """The seq_ids the chunk's batches must hold, in order (the resume contract, checked)."""


# ---------------------------------------------------------------------------------------------
# The iterator


class BatchIterator(Iterator):
    """(tokens, seq_ids) micro-batches for one rank, epoch after epoch, resumable at a `DataPosition`.

    tokens: (micro_batch, seq_len + 1) int64 on `device`; seq_ids: (micro_batch,) int64 on the CPU.
    Every rank of a run must use the same manifest, seed, micro_batch and world_size; the position
    may come from a run with other ones.
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
        self._setup(rank, world_size, micro_batch, seed, prefetch_batches, device)
        self.manifest = manifest
        self.shard_rows = usable_rows(manifest, max_sequences)
        self.sequences_per_epoch = sum(self.shard_rows)
        """Sequences in the global stream per epoch (all ranks together)."""
        if self.sequences_per_epoch < micro_batch * world_size:
            raise DataError(
                f"the prepared data at {manifest.root} has {self.sequences_per_epoch:,} usable sequences: "
                f"{self.sequences_per_epoch // world_size} per rank with {world_size} ranks, fewer than one micro-batch of {micro_batch}"
            )
        position = position or DataPosition()
        if position.legacy_world_size is not None:
            logger.warning(
                "this checkpoint's data position (epoch %d, %d sequences per rank on %d ranks) comes from the older "
                "shard-order stream: continuing at the same share of epoch %d in the sequence-shuffled stream, whose "
                "order is new (some sequences of this epoch may repeat or be skipped; later epochs are exact)",
                position.epoch, position.consumed // position.legacy_world_size, position.legacy_world_size, position.epoch,
            )
        absolute = position.epoch * self.sequences_per_epoch + min(position.consumed, self.sequences_per_epoch)
        self._start = DataPosition(epoch=absolute // self.sequences_per_epoch, consumed=absolute % self.sequences_per_epoch)
        self._position = self._start
        self._filesystems, self._paths, self._first_seq_id = shard_locations([manifest], storage)
        chunk_rows = int(window_rows(self.shard_rows) * _WINDOWS_PER_DATASET)
        self._batches_per_chunk = max(1, chunk_rows // (micro_batch * world_size))
        self._orders: dict[int, EpochOrder] = {}
        self._start_pipeline()

    def _setup(
        self, rank: int, world_size: int, micro_batch: int, seed: int, prefetch_batches: int, device: Any
    ) -> None:
        """The settings every reader checks and keeps, single source or mixture."""
        import torch

        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        if micro_batch < 1 or prefetch_batches < 1:
            raise DataError(f"micro_batch and prefetch_batches must be >= 1, got {micro_batch} and {prefetch_batches}")
        self.rank, self.world_size, self.micro_batch, self.seed = rank, world_size, micro_batch, seed
        self.prefetch_batches, self.device = prefetch_batches, torch.device(device)

    def _start_pipeline(self) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch_batches)  # of groups of micro-batches
        self._ready: collections.deque[_Item] = collections.deque()  # the group being taken
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=f"batches-rank{self.rank}", daemon=True)
        self._thread.start()  # the pipeline warms up while the caller builds its model

    @property
    def position(self) -> DataPosition:
        """Where the global stream stands after the batches taken so far (same on every rank at a step
        boundary). Save it with the checkpoint."""
        return DataPosition(epoch=self._position.epoch, consumed=self._position.consumed)

    @property
    def epochs(self) -> float:
        """Epochs of the global stream taken so far (2.5 = two whole passes and half of the third):
        plain arithmetic on the position, no device work."""
        return self._position.epoch + self._position.consumed / self.sequences_per_epoch

    def __next__(self) -> tuple[Any, Any]:
        if not self._ready:
            group = self._queue.get()
            if isinstance(group, _Failure):
                self._queue.put(group)  # every later next() raises too
                raise group.error
            self._ready.extend(group)
        item = self._ready.popleft()
        self._position = item.position
        tokens = item.tokens
        if self.device.type != "cpu":
            tokens = tokens.to(self.device, non_blocking=True)  # from pinned memory: an async copy
        return tokens, item.seq_ids

    def close(self) -> None:
        """Stop the producer thread and the Ray Data pipeline behind it."""
        self._stop.set()
        self._ready.clear()
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

    def _position_after(self, batches: int) -> DataPosition:
        absolute = self._start.epoch * self.sequences_per_epoch + self._start.consumed + batches * self.world_size * self.micro_batch
        return DataPosition(epoch=absolute // self.sequences_per_epoch, consumed=absolute % self.sequences_per_epoch)

    def _plan(self, first_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard index into `_paths`, row) of every sequence of this rank's next `_batches_per_chunk`
        micro-batches, and where to cut them into read pieces: one per (epoch, window) run, so that
        each piece reads one window's shards once."""
        epochs, windows, shards, rows = rank_stream(
            self.shard_rows, seed=self.seed, start=self._start, rank=self.rank, world_size=self.world_size,
            micro_batch=self.micro_batch, batches=self._batches_per_chunk, first_batch=first_batch, orders=self._orders,
        )
        return shards, rows, np.flatnonzero(np.diff(epochs * (1 << 32) + windows)) + 1

    def _chunk(self, first_batch: int) -> _Chunk:
        shards, rows, cuts = self._plan(first_batch)
        pieces = []
        for piece_shards, piece_rows in zip(np.split(shards, cuts), np.split(rows, cuts)):
            unique, which = np.unique(piece_shards, return_inverse=True)
            paths = [self._paths[int(s)] for s in unique]
            pieces.append(pickle.dumps((paths, which.astype(np.int64), piece_rows.astype(np.int64))))
        return _Chunk(first_batch=first_batch, pieces=pieces, seq_ids=self._first_seq_id[shards] + rows)

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
            first = 0
            while not self._stop.is_set():
                chunk = self._chunk(first)
                try:
                    if not self._produce_chunk(chunk):
                        return
                except Exception as error:
                    raise self._damaged_shard(chunk) or error
                first += self._batches_per_chunk
        except BaseException as error:  # handed to the caller's next()
            self._put(_Failure(error))

    def _damaged_shard(self, chunk: _Chunk) -> DataError | None:
        """After the pipeline failed on `chunk`: its shards read again here, in this process. A Ray
        Data task's error reaches the caller as text only, so a missing or unreadable shard (an error
        every retry would meet) is named this way; None: the shards read fine (a transient failure)."""
        try:
            _ReadPieces(self._filesystems)({"piece": chunk.pieces})
        except DataError as error:
            return error
        except Exception:  # noqa: BLE001 - not a damaged shard: the pipeline's own error stands
            return None
        return None

    def _produce_chunk(self, chunk: _Chunk) -> bool:
        """The chunk's micro-batches, checked against the plan, handed over in groups of `HANDOVER_BATCHES`."""
        planned = self._batches_per_chunk
        group = min(HANDOVER_BATCHES, planned)
        batches = self._dataset(chunk.pieces).iter_torch_batches(
            batch_size=self.micro_batch * group,
            prefetch_batches=1,  # one group ahead inside Ray Data, `prefetch_batches` groups in the queue
            collate_fn=_collate_class(),
            device="cpu",  # moved in next(): seq_ids stay on the host for bookkeeping
            pin_memory=self.device.type == "cuda",
            drop_last=False,  # a chunk is a whole number of micro-batches; its last group may be shorter
        )
        produced = 0
        for batch in batches:
            items = []
            for tokens, seq_ids in zip(batch["tokens"].split(self.micro_batch), batch["seq_ids"].split(self.micro_batch)):
                if produced == planned:
                    raise DataError("internal: the data pipeline returned more batches than planned")
                self._check_order(chunk, produced, seq_ids)
                produced += 1
                items.append(_Item(tokens=tokens, seq_ids=seq_ids, position=self._position_after(chunk.first_batch + produced)))
            if not self._put(items):
                return False
        if produced != planned:
            raise DataError(f"internal: the data pipeline returned {produced} batches, {planned} were planned")
        return True

    def _check_order(self, chunk: _Chunk, index: int, seq_ids: Any) -> None:
        expected = chunk.seq_ids[index * self.micro_batch : (index + 1) * self.micro_batch]
        if not np.array_equal(seq_ids.numpy(), expected):
            raise DataError(
                f"internal: the data pipeline returned sequences out of order (rank {self.rank}, batch "
                f"{chunk.first_batch + index} after {self._start}); exact resume would break"
            )

    def _dataset(self, pieces: list[bytes]):
        import ray
        import ray.data

        dataset = ray.data.from_items([{"piece": piece} for piece in pieces], override_num_blocks=len(pieces))
        dataset = dataset.map_batches(
            _ReadPieces(self._filesystems),
            batch_size=1,
            batch_format="numpy",
            compute=ray.data.TaskPoolStrategy(size=1),
            # The training workers hold every CPU of their node; a reader that asked for one would never
            # be scheduled. Reading a window is milliseconds of I/O and decoding, off the step's thread.
            num_cpus=0,
            label_selector={NODE_ID_LABEL: ray.get_runtime_context().get_node_id()},  # read next to the trainer
        )
        context = dataset.context
        context.enable_progress_bars = False
        context.print_on_execution_start = False
        context.execution_options.preserve_order = True  # the plan's order is the resume contract
        hide_execution_summaries()
        return dataset


class _HideExecutionSummary(logging.Filter):
    """Marks Ray Data's "Dataset ... execution finished in N seconds" record hidden: Ray Data's
    console handler drops hidden records (HiddenRecordFilter, Ray 2.60) and its file handler keeps
    them in ray-data.log. The ingest runs one short Dataset per couple of windows, so the console
    got one such line per epoch or more."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "execution finished in" in str(record.msg):
            record.hide = True
        return True


def hide_execution_summaries() -> None:
    """Install _HideExecutionSummary once in this process (idempotent)."""
    executor_logger = logging.getLogger(DATA_EXECUTOR_LOGGER)
    if not any(isinstance(f, _HideExecutionSummary) for f in executor_logger.filters):
        executor_logger.addFilter(_HideExecutionSummary())
