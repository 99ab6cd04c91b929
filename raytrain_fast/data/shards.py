"""Packing tokenized parts into fixed-length rows and writing them as Parquet shards (training and
validation), and reading and clearing what an output directory holds."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_fast.data.inputs import Listing, Source
from raytrain_fast.data.manifest import MANIFEST_NAME, Manifest, Shard, Skipped, SourceFile, join_uri
from raytrain_fast.data.tokenizing import Part, Progress
from raytrain_fast.errors import DataError
from raytrain_fast.storage import store_corruption_hint

VAL_DIR = "val"


class ShardWriter:
    """Concatenates token arrays and writes every `rows_per_shard` rows of seq_len + 1 ids as a shard."""

    def __init__(
        self, *, filesystem: pafs.FileSystem, root: str, seq_len: int, rows_per_shard: int, dtype: np.dtype, prefix: str = ""
    ) -> None:
        self.filesystem, self.root, self.row, self.rows_per_shard, self.dtype = filesystem, root, seq_len + 1, rows_per_shard, dtype
        self.prefix = prefix
        """Shard paths start with it: `val/` for the validation split."""
        self.tokens_added = 0
        self.buffer: list[np.ndarray] = []
        self.buffered = 0
        self.shards: list[Shard] = []
        self.num_rows = 0
        self.max_token_id = -1
        # Parquet encoding releases the GIL: two writer threads overlap it with reading and tokenizing.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="shard-writer")
        self.pending: list[Future] = []

    def add(self, tokens: np.ndarray | None) -> None:
        if tokens is None or not len(tokens):
            return
        self.max_token_id = max(self.max_token_id, int(tokens.max()))
        self.tokens_added += len(tokens)
        self.buffer.append(tokens)
        self.buffered += len(tokens)
        shard_tokens = self.rows_per_shard * self.row
        if self.buffered >= shard_tokens:
            stream = np.concatenate(self.buffer)
            cut = len(stream) // shard_tokens * shard_tokens
            for start in range(0, cut, shard_tokens):
                self._write(stream[start : start + shard_tokens])
            self.buffer, self.buffered = ([stream[cut:]], len(stream) - cut) if cut < len(stream) else ([], 0)

    def finish(self) -> int:
        """Write the last (smaller) shard; returns how many tail tokens did not fill a row."""
        stream = np.concatenate(self.buffer) if self.buffer else np.zeros(0, dtype=self.dtype)
        full = len(stream) // self.row * self.row
        if full:
            self._write(stream[:full])
        for future in self.pending:
            future.result()
        self.pool.shutdown()
        return len(stream) - full

    def abort(self) -> None:
        self.pool.shutdown(cancel_futures=True)

    def _write(self, tokens: np.ndarray) -> None:
        num_rows = len(tokens) // self.row
        shard = Shard(path=f"{self.prefix}shard-{len(self.shards):05d}.parquet", num_rows=num_rows, first_seq_id=self.num_rows)
        self.shards.append(shard)
        self.num_rows += num_rows
        while len(self.pending) >= 4:  # bound memory: at most a few shards in flight
            self.pending.pop(0).result()
        self.pending.append(self.pool.submit(self._write_table, shard, tokens.astype(self.dtype, copy=False)))

    def _write_table(self, shard: Shard, tokens: np.ndarray) -> None:
        table = pa.table({
            "seq_id": pa.array(np.arange(shard.first_seq_id, shard.first_seq_id + shard.num_rows, dtype=np.int64)),
            "tokens": pa.FixedSizeListArray.from_arrays(pa.array(tokens), self.row),
        })
        # Measured on stdlib shards (CPU time per 1M-token shard): dictionary encoding (pyarrow's default)
        # + zstd level 1 costs the same as dictionary alone (~24 ms) and halves the bytes (~0.5 byte per
        # byte-level token); min/max statistics of a list column help no reader and cost ~20%.
        pq.write_table(
            table, join_uri(self.root, shard.path), filesystem=self.filesystem, compression="zstd",
            compression_level=1, write_statistics=False, row_group_size=max(1, shard.num_rows),
        )


class ValPacker:
    """Routes each part's held-out documents to the validation writer, up to the hashed split's cap
    (then to training: a chosen document past the cap trains, it is never dropped)."""

    def __init__(self, writer: ShardWriter, train_writer: ShardWriter, *, max_tokens: int) -> None:
        self.writer, self.train_writer, self.max_tokens = writer, train_writer, max_tokens
        self.num_documents = 0
        self.hashed_documents = 0
        """Of num_documents, those held out of the training inputs (not --val-input files)."""
        self.sources: list[SourceFile] = []
        """--val-input files."""
        self.dropped = 0

    def add(self, part: Part, source: Source) -> None:
        if part.val_tokens is None:
            return
        capped = source.val_fraction < 1.0 and self.max_tokens and self.writer.tokens_added >= self.max_tokens
        if capped:
            self.train_writer.add(part.val_tokens)
        else:
            self.writer.add(part.val_tokens)
            self.num_documents += part.val_documents
            self.hashed_documents += part.val_documents if source.val_fraction < 1.0 else 0

    def finish(self) -> None:
        self.dropped = self.writer.finish()


@dataclass
class Packed:
    """What packing used and skipped."""

    hashed: list[tuple[str, int, str]] = field(default_factory=list)
    """(uri, size, sha256) of every file read whole, for the manifest's sources_hash."""
    used: list[SourceFile] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    num_tokens: int = 0
    dropped: int = 0


def pack(parts, listing: Listing, writer: ShardWriter, progress: Progress, val: ValPacker) -> Packed:
    """Feed tokenized parts (in source order) to the shard writers; collect what was used and skipped.
    Raises DataError for a file whose every record was bad."""
    packed = Packed(skipped=list(listing.skipped))
    documents = tokens = 0
    try:
        for part in parts:
            source = listing.sources[part.index]
            writer.add(part.tokens)
            val.add(part, source)
            documents += part.num_documents
            tokens += sum(0 if t is None else len(t) for t in (part.tokens, part.val_tokens))
            if part.last:
                _file_done(part, source, packed, val, documents=documents, tokens=tokens)
                documents = tokens = 0
            progress.add(part, skipped=sum(not s.partial for s in packed.skipped))
        packed.dropped = writer.finish()
        val.finish()
    except BaseException:
        writer.abort()
        val.writer.abort()
        raise
    return packed


def _file_done(part: Part, source: Source, packed: Packed, val: ValPacker, *, documents: int, tokens: int) -> None:
    if part.fatal:
        raise DataError(f"input {source.uri}: {part.fatal}")
    if part.sha256:
        packed.hashed.append((source.uri, source.size, part.sha256))
    if part.skip_reason:
        packed.skipped.append(Skipped(path=source.uri, reason=part.skip_reason))
        return
    if part.partial_reason:
        packed.skipped.append(Skipped(path=source.uri, reason=part.partial_reason, partial=True))
    packed.num_tokens += tokens
    entry = SourceFile(
        path=source.uri, size=source.size, sha256=part.sha256, num_documents=documents, num_tokens=tokens, mtime_ns=source.mtime_ns,
    )
    (val.sources if source.val_fraction >= 1.0 else packed.used).append(entry)


def hash_sources(entries: list[tuple[str, int, str]]) -> str:
    digest = hashlib.sha256()
    for path, size, sha in entries:
        digest.update(f"{path}\0{size}\0{sha}\n".encode())
    return digest.hexdigest()


def read_manifest(filesystem: pafs.FileSystem, root: str, display_root: str) -> Manifest | None:
    path = join_uri(root, MANIFEST_NAME)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        raw = stream.read()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        raise DataError(
            f"{display_root}/{MANIFEST_NAME} is not valid JSON. {store_corruption_hint(raw)} (delete it or pass --overwrite)."
        ) from None
    return Manifest.from_dict(data, root=display_root)


def clear_output(filesystem: pafs.FileSystem, root: str, existing: Manifest | None) -> None:
    """Remove a previous manifest (first: the directory stops counting as complete) and its shards."""
    info = filesystem.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        filesystem.create_dir(root, recursive=True)
        return
    if info.type != pafs.FileType.Directory:
        raise DataError(f"output '{root}' exists and is not a directory")
    manifest_path = join_uri(root, MANIFEST_NAME)
    if existing is not None:
        filesystem.delete_file(manifest_path)
    for entry in filesystem.get_file_info(pafs.FileSelector(root, recursive=False)):
        if entry.type == pafs.FileType.File and entry.base_name.startswith("shard-") and entry.base_name.endswith(".parquet"):
            filesystem.delete_file(entry.path)
        elif entry.type == pafs.FileType.Directory and entry.base_name == VAL_DIR:
            filesystem.delete_dir(entry.path)
