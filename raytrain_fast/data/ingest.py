"""Training-side ingest: a per-rank, resumable stream of micro-batches from the run's prepared sources
(a single data.source is a mixture of one: data/mixture.py).

The order, the rank slicing, the global position and the sequential reads are described in
docs/data.md ("How training reads the shards"); each source's order is `order.py`, the interleave
`mixture.py`. With W ranks and micro-batch B, rank r's k-th micro-batch since the start position P is
stream[P + (k * W + r) * B : P + (k * W + r + 1) * B].

Reading goes through Ray Data: one small read task per piece of the plan (num_cpus=0, one at a time,
on this node); `iter_torch_batches` collates the next batches while the step runs. A producer thread
hands batches over through a small queue, `HANDOVER_BATCHES` micro-batches at a time, so the step loop
only ever blocks on `queue.get()`, once per group (the loop times that wait: TrainMetrics' data wait).
"""

from __future__ import annotations

import collections
import dataclasses
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
from raytrain_fast.data.inputs import NODE_ID_LABEL
from raytrain_fast.data.manifest import read_shard, shard_locations
from raytrain_fast.data.mixture import (
    MixturePosition, MixtureSchedule, Source, identity, mixture_problems, mixture_rank_stream, window_cuts,
)
from raytrain_fast.data.order import EpochOrder, usable_rows, window_rows
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig

logger = logging.getLogger("raytrain_fast")
_WINDOWS_PER_DATASET = 2  # a Ray Dataset covers about this many windows' worth of micro-batches
HANDOVER_BATCHES = 8
"""Micro-batches per Ray Data batch and per hand-over to the step loop. Each batch Ray Data delivers
wakes its prefetch, format and producer threads, and each wake takes a core from a torch thread (on
2 cores, a step's parallel regions then wait for it): in groups, those wakes come once per 8 micro-batches,
and the loop takes 7 of 8 micro-batches from its own buffer without any thread."""


# ---------------------------------------------------------------------------------------------
# Ray Data pieces (run in read tasks and in iter_torch_batches' threads)


class _ReadPieces:
    """map_batches function: one pickled piece ([(source, shard path)], which of them and which row each
    sequence comes from, in stream order) -> those rows, in that order. Shards are read whole: sequential
    reads, shuffled in memory. `filesystems`: one per source (a mixture's, or the single source's)."""

    def __init__(self, filesystems: list[pafs.FileSystem]) -> None:
        self.filesystems = filesystems

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
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
    position: MixturePosition
    """Position after this batch (every rank has taken it)."""


@dataclass
class _Chunk:
    first_batch: int
    pieces: list[bytes]
    seq_ids: np.ndarray
    """The seq_ids the chunk's batches must hold, in order (the resume contract, checked)."""


# ---------------------------------------------------------------------------------------------
# The iterator


class BatchIterator(Iterator):
    """(tokens, seq_ids) micro-batches for one rank from the run's sources, resumable at a saved position.

    tokens: (micro_batch, seq_len + 1) int64 on `device`; seq_ids: (micro_batch,) int64 on the CPU, each
    source's own. Every rank of a run must use the same sources, seed, micro_batch and world_size; the
    position may come from a run with other ones (a resize), or of other sources or weights (then this
    mixture goes on from it: `MixturePosition.continued`).
    """

    def __init__(
        self, sources: list[Source], *, rank: int, world_size: int, micro_batch: int, seed: int = 0,
        prefetch_batches: int = 2, device: Any = "cpu", position: dict[str, Any] | None = None,
        storage: StorageConfig | None = None,
    ) -> None:
        import torch

        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        if micro_batch < 1 or prefetch_batches < 1:
            raise DataError(f"micro_batch and prefetch_batches must be >= 1, got {micro_batch} and {prefetch_batches}")
        if problems := mixture_problems(sources):
            raise DataError("; ".join(problems))
        self.rank, self.world_size, self.micro_batch, self.seed = rank, world_size, micro_batch, seed
        self.prefetch_batches, self.device = prefetch_batches, torch.device(device)
        self.names, self.mixture = [s.name for s in sources], identity(sources)
        self.schedule = MixtureSchedule([s.weight for s in sources])
        self.source_rows = [usable_rows(s.manifest, s.max_sequences) for s in sources]
        self.source_sizes = np.asarray([s.num_sequences for s in sources], dtype=np.int64)
        self._start = self._position = self.read_position(position)
        self._filesystems, self._paths, self._first_seq_id = shard_locations([s.manifest for s in sources], storage)
        self._first_shard = np.cumsum([0] + [len(s.manifest.shards) for s in sources])[:-1]
        """Index into `_paths` of each source's first shard."""
        chunk_rows = int(max(map(window_rows, self.source_rows)) * _WINDOWS_PER_DATASET)
        self._batches_per_chunk = max(1, chunk_rows // (micro_batch * world_size))
        self._orders: list[dict[int, EpochOrder]] = [{} for _ in sources]
        self._queue: queue.Queue = queue.Queue(maxsize=self.prefetch_batches)  # groups of micro-batches, or an error
        self._ready: collections.deque[_Item] = collections.deque()  # the group being taken
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name=f"batches-rank{self.rank}", daemon=True)
        self._thread.start()  # the pipeline warms up while the caller builds its model

    def read_position(self, saved: dict[str, Any] | None) -> MixturePosition:
        """A saved position (None: the start) in this iterator's mixture."""
        if saved is None:
            return MixturePosition(sources=self.mixture)
        saved_position = MixturePosition.from_dict(saved, first=self.mixture[0], first_rows=int(self.source_sizes[0]))
        return saved_position.continued(self.mixture)

    @property
    def position(self) -> MixturePosition:
        """Where the global stream stands after the batches taken so far (the same on every rank at a
        step boundary). Save it with the checkpoint."""
        return self._position

    def given(self) -> dict[str, int]:
        """Sequences each source has given so far (those the mixture no longer holds included)."""
        now = self.schedule.counts(self._position.consumed - self._start.start)
        return {**self._start.before, **{n: self._start.before.get(n, 0) + int(c) for n, c in zip(self.names, now)}}

    @property
    def epochs(self) -> float:
        """The most-repeated source's passes so far (2.5 = two whole passes and half of the third):
        plain arithmetic on the position, no device work."""
        given = self.given()
        return max(given[n] / int(size) for n, size in zip(self.names, self.source_sizes))

    def sequences_since(self, saved: dict[str, Any] | None) -> int:
        """Sequences of the global stream taken since the saved position `saved` (None: the start)."""
        return self._position.consumed - self.read_position(saved).consumed

    def source_metrics(self, *, seq_len: int) -> dict[str, float]:
        """Tokens, passes and weight of each source at the current position: arithmetic, no device work."""
        given = self.given()
        values = {f"data/tokens/{name}": float(count * seq_len) for name, count in given.items()}
        for name, size, weight in zip(self.names, self.source_sizes.tolist(), self.schedule.weights.tolist()):
            values.update({f"data/epochs/{name}": given[name] / size, f"data/weight/{name}": weight})
        return values

    def __next__(self) -> tuple[Any, Any]:
        if not self._ready:
            group = self._queue.get()
            if isinstance(group, BaseException):
                self._queue.put(group)  # every later next() raises too
                raise group
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

    def _position_after(self, batches: int) -> MixturePosition:
        return dataclasses.replace(self._start, consumed=self._start.consumed + batches * self.world_size * self.micro_batch)

    def _plan(self, first_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard index into `_paths`, row) of every sequence of this rank's next `_batches_per_chunk`
        micro-batches, and where to cut them into read pieces (`mixture.window_cuts`)."""
        sources, shards, rows, windows = mixture_rank_stream(
            self.source_rows, self.schedule, seed=self.seed, position=self._start, rank=self.rank,
            world_size=self.world_size, micro_batch=self.micro_batch, batches=self._batches_per_chunk,
            first_batch=first_batch, orders=self._orders,
        )
        return self._first_shard[sources] + shards, rows, window_cuts(sources, windows)

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
            self._put(error)

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
