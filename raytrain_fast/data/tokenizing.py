"""Tokenizing the listed inputs, in this process or in Ray Data tasks, as a stream of `Part`s in source
order: a file's documents are tokenized a batch at a time (see readers.BATCH_BYTES), so a file of any
size is never whole in memory; the last part of a file carries its verdict (hash, skip reasons).

The validation split is chosen here, per document: a document goes to `val_tokens` when a hash of its
content falls under the source's `val_fraction`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import pickle
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_fast._ray_compat import DATA_EXECUTOR_LOGGER, wait_for_ray_data_iterators
from raytrain_fast.data.inputs import NODE_ID_LABEL, Source
from raytrain_fast.data.readers import FileReader, input_format, verdict
from raytrain_fast.data.tokenizer import TokenizerSpec
from raytrain_fast.console import say

_BLOCK_BYTES = 16 << 20
"""Token bytes a Ray Data task gathers before handing a block on: many small files make one block."""


@dataclass
class Part:
    """Tokens of consecutive documents of one file; the file's last part (`last`) has its verdict."""

    index: int
    """The file's position in the listing."""
    piece: int = 0
    """Which piece of a file read by several tasks (row groups of a Parquet file), in file order."""
    records: Any = None
    """A piece's last part: its unusable records (FileReader.records), for the file's verdict."""
    tokens: np.ndarray | None = None
    val_tokens: np.ndarray | None = None
    """The tokens of the documents chosen for validation (None: none were)."""
    num_documents: int = 0
    """Documents of this part, validation ones included."""
    val_documents: int = 0
    num_bytes: int = 0
    """Text bytes of this part's documents."""
    last: bool = False
    sha256: str = ""
    skip_reason: str = ""
    """Non-empty: the whole file was not used."""
    partial_reason: str = ""
    """Non-empty: some records of the file were not used."""
    fatal: str = ""
    """Non-empty: every record of the file was bad; preparing stops with this message."""


def is_validation_document(document: bytes, fraction: float) -> bool:
    """Whether a document belongs to the validation split: a hash of its content, not its place, so
    the choice is the same on every preparation and identical documents share a split."""
    if fraction >= 1.0:
        return True
    digest = hashlib.blake2b(document, digest_size=8, person=b"rtf-val-split").digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def tokenize_file(
    index: int, source: Source, spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem], *, text_field: str,
    piece: int = 0, row_groups: tuple[int, int] | None = None,
) -> Iterator[Part]:
    """The parts of one file (or of one piece of it: row_groups), its last part marked."""
    reader = FileReader(source.location, source.path, filesystems, text_field=text_field, row_groups=row_groups)
    for documents in reader.batches():
        part = Part(index=index, piece=piece, num_documents=len(documents), num_bytes=sum(len(d) for d in documents))
        if source.val_fraction > 0:
            chosen = [is_validation_document(d, source.val_fraction) for d in documents]
            if any(chosen):
                held_out = [d for d, c in zip(documents, chosen) if c]
                part.val_tokens, part.val_documents = spec.encode_documents(held_out), len(held_out)
                documents = [d for d, c in zip(documents, chosen) if not c]
        part.tokens = spec.encode_documents(documents)
        yield part
    yield Part(
        index=index, piece=piece, last=True, sha256=reader.sha256, skip_reason=reader.skip_reason,
        partial_reason=reader.partial_reason, fatal=reader.fatal, records=reader.records,
    )


def results_local(sources: list[Source], spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem], *, text_field: str):
    for index, source in enumerate(sources):
        yield from tokenize_file(index, source, spec, filesystems, text_field=text_field)


def _to_table(parts: list[Part]) -> pa.Table:
    """A Ray Data block of parts, each pickled whole (its numpy arrays pickle as their bytes)."""
    return pa.table({"part": pa.array([pickle.dumps(part) for part in parts], pa.large_binary())})


class _TokenizeBatch:
    """Ray Data map_batches function: a batch of file rows -> blocks of parts, in file order."""

    def __init__(self, spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem], text_field: str) -> None:
        self.spec, self.filesystems, self.text_field = spec, filesystems, text_field

    def __call__(self, batch: dict[str, np.ndarray]) -> Iterator[pa.Table]:
        # Ray gave this task one CPU: a Hugging Face tokenizer's encode_batch would start a thread per
        # core of the node in every task (N tasks x N threads); one thread each keeps to what Ray gave.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        parts: list[Part] = []
        size = 0
        for index, piece, source, row_groups in map(pickle.loads, batch["item"]):
            for part in tokenize_file(index, source, self.spec, self.filesystems, text_field=self.text_field,
                                      piece=piece, row_groups=row_groups):
                parts.append(part)
                size += sum(0 if t is None else t.nbytes for t in (part.tokens, part.val_tokens))
                if size >= _BLOCK_BYTES:
                    yield _to_table(parts)
                    parts, size = [], 0
        if parts:
            yield _to_table(parts)


def results_ray(sources: list[Source], spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem], *, text_field: str):
    """Tokenize in Ray Data tasks; yields parts in source order."""
    import ray
    import ray.data

    num_cpus = max(1, int(ray.available_resources().get("CPU", 1)))
    files_per_task = max(1, min(64, math.ceil(len(sources) / (4 * num_cpus))))
    remote_args: dict = {}
    if any(s.location == "local" for s in sources):
        # Local paths exist on this node only: keep the tasks here.
        remote_args["label_selector"] = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}
    items = _work_items(sources, filesystems, num_cpus=num_cpus)
    num_blocks = max(1, math.ceil(len(items) / files_per_task))
    dataset = ray.data.from_items([{"item": pickle.dumps(item)} for item in items], override_num_blocks=num_blocks)
    dataset = dataset.map_batches(  # no more tasks at once than blocks: Ray Data warns of the idle rest otherwise
        _TokenizeBatch(spec, filesystems, text_field), batch_size=files_per_task, batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=min(num_cpus, num_blocks)), **remote_args,
    )
    _quiet(dataset.context)
    dataset.context.execution_options.preserve_order = True
    order = [(index, piece) for index, piece, _, _ in items]
    pieces = _Pieces({index: piece + 1 for index, piece in order}, text_field=text_field)
    pending: dict[tuple[int, int], list[Part]] = {}
    done = 0
    for table in dataset.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
        for part in map(pickle.loads, table.column("part").to_pylist()):
            pending.setdefault((part.index, part.piece), []).append(part)
        while done < len(order) and pending.get(order[done]):  # preserve_order keeps blocks in order; this makes sure of it
            parts = pending.pop(order[done])
            yield from filter(None, map(pieces.join, parts))
            done += parts[-1].last  # else more of this piece is to come
    assert not pending and done == len(order), "Ray Data lost tokenized files"


def _work_items(sources: list[Source], filesystems: dict[str, pafs.FileSystem], *, num_cpus: int) -> list[tuple]:
    """A task's units of work, (file index, piece, source, row groups or None): a file; with fewer files
    than CPUs, a Parquet file of several row groups is cut into pieces of consecutive row groups (a
    footer read each), so that every CPU has work."""
    per_file = math.ceil(num_cpus / len(sources)) if len(sources) < num_cpus else 1
    items = []
    for index, source in enumerate(sources):
        groups = _num_row_groups(source, filesystems) if per_file > 1 and input_format(source.path)[0] == "parquet" else 0
        num_pieces = min(per_file, groups)
        if num_pieces < 2:
            items.append((index, 0, source, None))
            continue
        bounds = [round(k * groups / num_pieces) for k in range(num_pieces + 1)]
        items += [(index, k, source, (bounds[k], bounds[k + 1])) for k in range(num_pieces)]
    return items


def _num_row_groups(source: Source, filesystems: dict[str, pafs.FileSystem]) -> int:
    try:
        return pq.read_metadata(source.path, filesystem=filesystems[source.location]).num_row_groups
    except (OSError, pa.ArrowException):
        return 0  # not Parquet after all: read whole, and skipped with the reason


class _Pieces:
    """Joins the pieces of a file read by several tasks back into one file's parts: a piece's last part
    carries no tokens, so it is held back, and the final piece's one becomes the file's verdict."""

    def __init__(self, num_pieces: dict[int, int], *, text_field: str) -> None:
        self.num_pieces, self.text_field = num_pieces, text_field
        self.records: list = []
        self.errors: list[str] = []
        self.documents, self.sha256, self.fatal = 0, "", ""

    def join(self, part: Part) -> Part | None:
        if self.num_pieces[part.index] == 1:
            return part
        self.documents += part.num_documents
        if not part.last:
            return part
        self.records += [part.records] if part.records else []
        self.errors += [reason for reason in (part.skip_reason, part.partial_reason) if reason]
        self.sha256, self.fatal = self.sha256 or part.sha256, self.fatal or part.fatal
        if part.piece + 1 < self.num_pieces[part.index]:
            return None
        skip, partial, fatal = (verdict(self.records, num_documents=self.documents, text_field=self.text_field)
                                if self.records else ("", "", ""))
        if self.errors:  # a piece that could not be read (all of it, or from some row on)
            skip, partial = ("", "; ".join(filter(None, [partial, *self.errors]))) if self.documents else (self.errors[0], "")
        joined = Part(index=part.index, last=True, sha256=self.sha256, skip_reason=skip, partial_reason=partial, fatal=self.fatal or fatal)
        self.__init__(self.num_pieces, text_field=self.text_field)
        return joined


@contextlib.contextmanager
def ray_running():
    """Use the Ray instance this process is connected to, else start a local one for the duration."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        yield
    finally:
        wait_for_ray_data_iterators()  # this process iterated the tokenized blocks itself
        ray.shutdown()


def _quiet(context) -> None:
    """prepare-data prints its own progress: no Ray Data progress bars, start line or finish line."""
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    logging.getLogger(DATA_EXECUTOR_LOGGER).setLevel(logging.WARNING)


class Progress:
    """prepare-data's progress line: files, documents, tokens and throughput, at most every `every_s`."""

    def __init__(self, total_files: int, *, enabled: bool, every_s: float = 2.0) -> None:
        self.total, self.enabled, self.every_s = total_files, enabled, every_s
        self.start = self.last = time.perf_counter()
        self.files = self.documents = self.tokens = self.num_bytes = self.skipped = 0

    def add(self, part: Part, *, skipped: int) -> None:
        self.files += part.last
        self.documents += part.num_documents
        self.tokens += sum(0 if t is None else len(t) for t in (part.tokens, part.val_tokens))
        self.num_bytes += part.num_bytes
        self.skipped = skipped
        self.update()

    def update(self, *, force: bool = False) -> None:
        now = time.perf_counter()
        if self.enabled and (force or now - self.last >= self.every_s):
            self.last = now
            say(f"prepare-data: {self.line(now)}", stderr=True)

    def line(self, now: float | None = None) -> str:
        seconds = max(1e-9, (now or time.perf_counter()) - self.start)
        return (
            f"{self.files}/{self.total} files, {self.documents:,} documents, {self.tokens:,} tokens, "
            f"{self.skipped} skipped, {seconds:.1f}s ({self.tokens / seconds / 1e6:.2f}M tokens/s, "
            f"{self.num_bytes / seconds / 1e6:.1f} MB/s of text)"
        )
