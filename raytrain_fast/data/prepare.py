"""`prepare_data`: text files (local or S3) -> tokenized, packed, fixed-length sequences in Parquet
shards plus `manifest.json`.

Pipeline: list the inputs (files, directories, globs, s3:// URIs) -> read and tokenize every file
(in parallel with Ray Data, or in this process where that is faster, see `parallel`) -> append the
end-of-document id -> concatenate in source order -> cut into rows of seq_len + 1 ids -> write shards
(seq_id int64, tokens fixed_size_list) -> write the manifest last. Files that cannot be used are
listed with the reason, never dropped silently.

The validation split is chosen per document, before packing: a document goes to `val/` shards when
a hash of its content falls under `val_fraction` (so a document is never in both splits, duplicates
land together, and preparing again chooses the same documents), until the split holds
VAL_MAX_TOKENS; or every document of the `val_inputs` files does.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import json
import math
import os
import sys
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_fast.data.ingest import NODE_ID_LABEL
from raytrain_fast.data.manifest import (
    FORMAT_VERSION, MANIFEST_NAME, Manifest, Shard, Skipped, SourceFile, ValidationSplit, join_uri,
)
from raytrain_fast.data.tokenizer import TokenizerSpec, load_tokenizer
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

JSONL_SUFFIXES = (".jsonl", ".ndjson")
SHARD_TOKENS = 1 << 20
"""Default shard size in tokens (~1 MiB on disk for bytes). Shards are the unit of the per-epoch
shuffle and of the split across ranks, so many small shards shuffle better than a few big ones."""
DEFAULT_VAL_FRACTION = 0.005
VAL_MAX_TOKENS = 1 << 23
"""Cap of the hashed validation split (~8M tokens): evaluation reads a fixed subset of it anyway
(eval.sequences), so a larger split would only take documents from training."""
VAL_DIR = "val"
_RAY_BYTES_THRESHOLD = 1 << 30  # the byte tokenizer is a memcpy: Ray only pays off for huge local inputs
_GLOB_CHARS = "*?["


@dataclass
class _Source:
    uri: str
    """Canonical name: absolute local path or s3://bucket/key."""
    location: str
    """`local` or `s3`: which filesystem reads it."""
    path: str
    """Path inside that filesystem."""
    size: int
    mtime_ns: int | None
    val_fraction: float = 0.0
    """Share of this file's documents that go to the validation split (1.0: a --val-input file)."""


@dataclass
class _FileResult:
    index: int
    sha256: str = ""
    tokens: np.ndarray | None = None
    num_documents: int = 0
    skip_reason: str = ""
    """Non-empty: the whole file was not used."""
    partial_reason: str = ""
    """Non-empty: some records of a JSONL file were not used."""
    val_tokens: np.ndarray | None = None
    """The tokens of the documents chosen for validation (None: none were)."""
    val_documents: int = 0


@dataclass
class _Listing:
    sources: list[_Source] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Listing the inputs


def _canonical_input(item: str) -> str:
    if item.startswith("s3://"):
        return item.rstrip("/")
    if item.startswith("file://"):
        item = item[len("file://"):]
    return os.path.abspath(os.path.expanduser(item))


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _walk_local(root: str, listing: _Listing, exclude: str | None) -> int:
    """Every non-hidden file under `root`, sorted; hidden entries are reported, not read."""
    found = 0
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in [d for d in dirs if _is_hidden(d)]:
            listing.skipped.append(Skipped(path=os.path.join(directory, name), reason="hidden directory (not read)"))
        dirs[:] = [d for d in dirs if not _is_hidden(d) and os.path.join(directory, d) != exclude]
        for name in sorted(files):
            path = os.path.join(directory, name)
            if _is_hidden(name):
                listing.skipped.append(Skipped(path=path, reason="hidden file (not read)"))
                continue
            _add_local_file(path, listing)
            found += 1
    return found


def _add_local_file(path: str, listing: _Listing) -> None:
    try:
        stat = os.stat(path)
    except OSError as error:
        listing.skipped.append(Skipped(path=path, reason=f"cannot be read ({error.strerror})"))
        return
    listing.sources.append(_Source(uri=path, location="local", path=path, size=stat.st_size, mtime_ns=stat.st_mtime_ns))


def _list_s3(item: str, filesystem: pafs.FileSystem, listing: _Listing) -> None:
    path = item[len("s3://"):]
    pattern = path if any(c in path for c in _GLOB_CHARS) else None
    if pattern is not None:
        base = pattern[: min(pattern.index(c) for c in _GLOB_CHARS if c in pattern)].rsplit("/", 1)[0]
        infos = _s3_files_under(base, filesystem, item)
        matches = [info for info in infos if fnmatch.fnmatchcase(info.path, pattern)]
        if not matches:
            listing.skipped.append(Skipped(path=item, reason="matched no files"))
        infos = matches
    else:
        info = _s3_info(path, filesystem, item)
        if info.type == pafs.FileType.File:
            infos = [info]
        elif info.type == pafs.FileType.Directory:
            infos = _s3_files_under(path, filesystem, item)
            if not infos:
                listing.skipped.append(Skipped(path=item, reason="no files under this prefix"))
        else:
            listing.skipped.append(Skipped(path=item, reason="does not exist"))
            return
    for info in sorted(infos, key=lambda i: i.path):
        if _is_hidden(info.base_name):
            listing.skipped.append(Skipped(path=f"s3://{info.path}", reason="hidden file (not read)"))
            continue
        listing.sources.append(_Source(uri=f"s3://{info.path}", location="s3", path=info.path, size=info.size, mtime_ns=None))


def _s3_info(path: str, filesystem: pafs.FileSystem, item: str) -> pafs.FileInfo:
    try:
        return filesystem.get_file_info(path)
    except OSError as error:
        raise DataError(f"input '{item}' cannot be listed: {error}") from None


def _s3_files_under(base: str, filesystem: pafs.FileSystem, item: str) -> list[pafs.FileInfo]:
    try:
        infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    except OSError as error:
        raise DataError(f"input '{item}' cannot be listed: {error}") from None
    return [info for info in infos if info.type == pafs.FileType.File]


def _list_inputs(inputs: list[str], *, s3: pafs.FileSystem | None, exclude: str | None) -> _Listing:
    listing = _Listing()
    for item in inputs:
        if item.startswith("s3://"):
            assert s3 is not None  # built by the caller whenever an input is on S3
            _list_s3(item, s3, listing)
        elif any(c in item for c in _GLOB_CHARS):
            matches = sorted(glob.glob(item, recursive=True))
            if not matches:
                listing.skipped.append(Skipped(path=item, reason="matched no files"))
            for match in matches:
                if os.path.isdir(match):
                    _walk_local(match, listing, exclude)
                else:
                    _add_local_file(match, listing)
        elif os.path.isdir(item):
            if _walk_local(item, listing, exclude) == 0:
                listing.skipped.append(Skipped(path=item, reason="directory has no (non-hidden) files"))
        elif os.path.exists(item):
            _add_local_file(item, listing)
        else:
            listing.skipped.append(Skipped(path=item, reason="does not exist"))

    unique: list[_Source] = []
    seen: set[str] = set()
    for source in listing.sources:
        if source.uri in seen:
            listing.skipped.append(Skipped(path=source.uri, reason="listed twice (used once)"))
        elif exclude is not None and source.location == "local" and source.path.startswith(exclude + os.sep):
            listing.skipped.append(Skipped(path=source.uri, reason="inside the output directory"))
        else:
            seen.add(source.uri)
            unique.append(source)
    listing.sources = unique
    return listing


# ---------------------------------------------------------------------------------------------
# Reading and tokenizing one file (runs in this process or in Ray Data tasks)


def _read(source_location: str, path: str, filesystems: dict[str, pafs.FileSystem]) -> bytes:
    if source_location == "local":
        with open(path, "rb") as file:
            return file.read()
    with filesystems[source_location].open_input_stream(path) as stream:
        return stream.read()


def _documents(data: bytes, *, jsonl: bool) -> tuple[list[bytes], str, str]:
    """(documents, skip_reason, partial_reason) of a file's bytes."""
    if not data:
        return [], "empty file", ""
    if b"\x00" in data:
        return [], "binary file (contains NUL bytes)", ""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        return [], f"not UTF-8 text (invalid byte at offset {error.start})", ""
    if not jsonl:
        return [data], "", ""
    documents: list[bytes] = []
    bad: Counter[str] = Counter()
    first_bad: dict[str, int] = {}
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): JSON strings may hold U+2028
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            problem = "not valid JSON"
        else:
            value = record.get("text") if isinstance(record, dict) else None
            if not isinstance(value, str):
                problem = "no string 'text' field"
            elif not value:
                problem = "empty 'text'"
            else:
                documents.append(value.encode("utf-8"))
                continue
        bad[problem] += 1
        first_bad.setdefault(problem, number)
    summary = ", ".join(f"{count} {problem} (first at line {first_bad[problem]})" for problem, count in bad.items())
    if not documents:
        return [], f"no usable JSONL records: {summary}" if summary else "no JSONL records", ""
    return documents, "", f"{sum(bad.values())} JSONL records skipped: {summary}" if bad else ""


def is_validation_document(document: bytes, fraction: float) -> bool:
    """Whether a document belongs to the validation split: a hash of its content, not its place, so
    the choice is the same on every preparation and identical documents share a split."""
    if fraction >= 1.0:
        return True
    digest = hashlib.blake2b(document, digest_size=8, person=b"rtf-val-split").digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def read_documents(location: str, path: str, filesystems: dict[str, pafs.FileSystem]) -> tuple[bytes | None, list[bytes], str, str]:
    """(the file's bytes, its documents, skip_reason, partial_reason) of one listed input: a JSONL
    file's usable `text` records, any other file as one document. Bytes None: it could not be read."""
    try:
        data = _read(location, path, filesystems)
    except OSError as error:
        return None, [], f"cannot be read ({error})", ""
    return (data, *_documents(data, jsonl=path.lower().endswith(JSONL_SUFFIXES)))


def list_inputs(
    inputs: list[str], storage: StorageConfig, *, exclude: str | None = None
) -> tuple[_Listing, dict[str, pafs.FileSystem]]:
    """The files `inputs` name, listed as prepare_data lists them (hidden, missing and duplicate
    entries in `.skipped`), and the filesystems that read them (see `read_documents`)."""
    canonical = [_canonical_input(item) for item in inputs]
    filesystems: dict[str, pafs.FileSystem] = {"local": pafs.LocalFileSystem()}
    if any(item.startswith("s3://") for item in canonical):
        filesystems["s3"] = resolve_filesystem("s3://", storage)[0]
    return _list_inputs(canonical, s3=filesystems.get("s3"), exclude=exclude), filesystems


def _tokenize_one(
    index: int, location: str, path: str, spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem], val_fraction: float = 0.0
) -> _FileResult:
    data, documents, skip_reason, partial_reason = read_documents(location, path, filesystems)
    if data is None:
        return _FileResult(index=index, skip_reason=skip_reason)
    result = _FileResult(index=index, sha256=hashlib.sha256(data).hexdigest(), skip_reason=skip_reason, partial_reason=partial_reason)
    if documents:
        chosen = [val_fraction > 0 and is_validation_document(d, val_fraction) for d in documents]
        if any(chosen):
            held_out = [d for d, c in zip(documents, chosen) if c]
            result.val_tokens, result.val_documents = spec.encode_documents(held_out), len(held_out)
            documents = [d for d, c in zip(documents, chosen) if not c]
        result.tokens = spec.encode_documents(documents)
        result.num_documents = len(documents) + result.val_documents
    return result


class _TokenizeBatch:
    """Ray Data map_batches function: a batch of file rows -> one result row per file."""

    def __init__(self, spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem]) -> None:
        self.spec, self.filesystems = spec, filesystems

    def __call__(self, batch: dict[str, np.ndarray]) -> pa.Table:
        results = [
            _tokenize_one(int(i), str(loc), str(p), self.spec, self.filesystems, float(f))
            for i, loc, p, f in zip(batch["index"], batch["location"], batch["path"], batch["val_fraction"])
        ]
        return pa.table({
            "index": pa.array([r.index for r in results], pa.int64()),
            "sha256": [r.sha256 for r in results],
            "num_documents": pa.array([r.num_documents for r in results], pa.int64()),
            "skip_reason": [r.skip_reason for r in results],
            "partial_reason": [r.partial_reason for r in results],
            "tokens": pa.array([b"" if r.tokens is None else r.tokens.tobytes() for r in results], pa.large_binary()),
            "val_tokens": pa.array([b"" if r.val_tokens is None else r.val_tokens.tobytes() for r in results], pa.large_binary()),
            "val_documents": pa.array([r.val_documents for r in results], pa.int64()),
        })


def _results_local(sources: list[_Source], spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem]):
    for index, source in enumerate(sources):
        yield _tokenize_one(index, source.location, source.path, spec, filesystems, source.val_fraction)


def _results_ray(sources: list[_Source], spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem]):
    """Tokenize in Ray Data tasks; yields results in source order."""
    import ray
    import ray.data

    num_cpus = max(1, int(ray.available_resources().get("CPU", 1)))
    files_per_task = max(1, min(64, math.ceil(len(sources) / (4 * num_cpus))))
    remote_args: dict = {}
    if any(s.location == "local" for s in sources):
        # Local paths exist on this node only: keep the tasks here.
        remote_args["label_selector"] = {NODE_ID_LABEL: ray.get_runtime_context().get_node_id()}
    items = [{"index": i, "location": s.location, "path": s.path, "val_fraction": s.val_fraction} for i, s in enumerate(sources)]
    dataset = ray.data.from_items(items, override_num_blocks=max(1, math.ceil(len(items) / files_per_task)))
    dataset = dataset.map_batches(
        _TokenizeBatch(spec, filesystems), batch_size=files_per_task, batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=num_cpus), **remote_args,
    )
    _quiet(dataset.context)
    dataset.context.execution_options.preserve_order = True
    dtype = spec.dtype
    pending: dict[int, _FileResult] = {}
    next_index = 0
    for table in dataset.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=2):
        columns = table.to_pydict()
        for i in range(table.num_rows):
            raw, val_raw = columns["tokens"][i], columns["val_tokens"][i]
            pending[columns["index"][i]] = _FileResult(
                index=columns["index"][i], sha256=columns["sha256"][i],
                tokens=np.frombuffer(raw, dtype=dtype) if raw else np.zeros(0, dtype=dtype), num_documents=columns["num_documents"][i],
                skip_reason=columns["skip_reason"][i], partial_reason=columns["partial_reason"][i],
                val_tokens=np.frombuffer(val_raw, dtype=dtype) if val_raw else None, val_documents=columns["val_documents"][i],
            )
        while next_index in pending:  # preserve_order keeps blocks in order; this makes sure of it
            yield pending.pop(next_index)
            next_index += 1
    assert not pending and next_index == len(sources), "Ray Data lost tokenized files"


@contextlib.contextmanager
def _ray_running():
    """Use the Ray instance this process is connected to, else start a local one for the duration."""
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(include_dashboard=False, configure_logging=False, log_to_driver=False)
    try:
        yield
    finally:
        from raytrain_fast._ray_compat import wait_for_ray_data_iterators

        wait_for_ray_data_iterators()  # this process iterated the tokenized blocks itself
        ray.shutdown()


def _quiet(context) -> None:
    context.enable_progress_bars = False
    context.print_on_execution_start = False


# ---------------------------------------------------------------------------------------------
# Packing and writing shards


class _ShardWriter:
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

    def add(self, tokens: np.ndarray) -> None:
        if not len(tokens):
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


# ---------------------------------------------------------------------------------------------
# Progress and the public entry point


class _Progress:
    def __init__(self, total_files: int, *, enabled: bool, every_s: float = 2.0) -> None:
        self.total, self.enabled, self.every_s = total_files, enabled, every_s
        self.start = self.last = time.perf_counter()

    def update(self, files: int, tokens: int, skipped: int, *, force: bool = False) -> None:
        now = time.perf_counter()
        if self.enabled and (force or now - self.last >= self.every_s):
            self.last = now
            print(
                f"prepare-data: {files}/{self.total} files, {tokens:,} tokens, {skipped} skipped, {now - self.start:.1f}s",
                file=sys.stderr, flush=True,
            )


def _hash_sources(entries: list[tuple[str, int, str]]) -> str:
    digest = hashlib.sha256()
    for path, size, sha in entries:
        digest.update(f"{path}\0{size}\0{sha}\n".encode())
    return digest.hexdigest()


def _read_manifest(filesystem: pafs.FileSystem, root: str, display_root: str) -> Manifest | None:
    path = join_uri(root, MANIFEST_NAME)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        raw = stream.read()
    try:
        data = json.loads(raw)
    except json.JSONDecodeError:
        from raytrain_fast.storage import store_corruption_hint

        raise DataError(
            f"{display_root}/{MANIFEST_NAME} is not valid JSON. {store_corruption_hint(raw)} (delete it or pass --overwrite)."
        ) from None
    return Manifest.from_dict(data, root=display_root)


def _recipe_differences(old: dict, new: dict) -> list[str]:
    names = {"inputs": "inputs", "seq_len": "seq_len", "tokenizer": "tokenizer", "rows_per_shard": "shard size"}
    differences = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            if key == "inputs":
                differences.append(f"inputs differ ({len(old.get(key) or [])} before, {len(new.get(key) or [])} now)")
            else:
                differences.append(f"{names.get(key, key)}: {old.get(key)!r} before, {new.get(key)!r} now")
    return differences


def _hash_inputs(listing: _Listing, filesystems: dict[str, pafs.FileSystem]) -> list[tuple[str, int, str]]:
    """(path, size, sha256) of every readable input, as prepare_data records them."""
    entries = []
    for source in listing.sources:
        try:
            data = _read(source.location, source.path, filesystems)
        except OSError:
            continue
        entries.append((source.uri, source.size, hashlib.sha256(data).hexdigest()))
    return entries


def _summarize_skipped(skipped: list[Skipped], limit: int = 10, *, listed: bool = True) -> str:
    """One line (limit=0) or a line and up to `limit` paths: inputs skipped whole, and apart from
    them the records skipped inside inputs that were used (those files are not skipped). listed:
    point to the manifest's list (False where no manifest is written)."""
    if not skipped:
        return ""
    whole = [s for s in skipped if not s.partial]
    partial = [s for s in skipped if s.partial]
    heads = []
    if whole:
        counts = Counter(s.reason.split(" (")[0].split(":")[0] for s in whole)
        heads.append(f"skipped {len(whole)} input(s): " + ", ".join(f"{n} {reason}" for reason, n in counts.most_common()))
    if len(partial) == 1:
        count, _, detail = partial[0].reason.partition(": ")
        heads.append(f"used {partial[0].path}; {count} in it: {detail}")
    elif partial:
        heads.append(f"used {len(partial)} JSONL inputs without some of their records")
    head = "; ".join(heads)
    where = f" (each listed under 'skipped' in {MANIFEST_NAME})" if listed else ""
    if limit == 0:  # one summary line; the paths are in the manifest
        return head + where
    lines = [head, *(f"  {s.path}: {s.reason}" for s in skipped[:limit])]
    if len(skipped) > limit:
        lines.append(f"  ... and {len(skipped) - limit} more{where.replace('each', 'all')}")
    return "\n".join(lines)


def prepare_data(
    *,
    inputs: list[str],
    output: str,
    seq_len: int,
    tokenizer: str = "byte",
    storage: StorageConfig | None = None,
    overwrite: bool = False,
    rows_per_shard: int | None = None,
    num_shards_hint: int | None = None,
    parallel: bool | None = None,
    verbose: bool = True,
    val_fraction: float | None = None,
    val_inputs: list[str] | None = None,
    split_names: tuple[str, str] = ("--val-fraction", "--val-input"),
) -> Manifest:
    """Tokenize and pack `inputs` into Parquet shards plus `manifest.json` under `output`.

    inputs: files, directories (read recursively, hidden entries skipped), globs, or s3:// URIs (a
        key, a prefix, or a glob); `.jsonl`/`.ndjson` files hold one document per line in a `text`
        field, every other file is one plain-text document (UTF-8).
    output: a local directory or s3://bucket/prefix (the bucket must exist).
    tokenizer: `byte` (ids 0-255 plus EOD 256, vocab 257), a tokenizer.json or an HF directory holding one.
    storage: endpoint/region for s3:// inputs, output and tokenizer (credentials from the environment).
    overwrite: replace an existing prepared dataset made from different inputs or settings. Preparing
        the same inputs with the same settings again is a no-op either way.
    rows_per_shard / num_shards_hint: shard size (default ~1M tokens per shard); the hint is turned
        into rows per shard from the input size, so the shard count is approximate.
    parallel: tokenize in Ray Data tasks (True), in this process (False), or decide (None): Ray Data
        for a HuggingFace tokenizer, S3 inputs or more than 1 GiB of input; the byte tokenizer on local
        files is a memcpy that starting Ray worker processes would only slow down.
    val_fraction: share of documents held out for validation, chosen by a hash of each document's
        content, in (0, 0.5]; None = DEFAULT_VAL_FRACTION (0.5%). The split stops growing at
        VAL_MAX_TOKENS. With the default, a split that comes out empty (a corpus of a few documents)
        is left out with a warning; asked for explicitly, it is an error.
    val_inputs: a separate validation corpus (same forms as `inputs`) instead of a hashed split.
    split_names: the two settings above as the caller's user writes them (flags or data.* keys), for messages."""
    started, storage = time.perf_counter(), storage or StorageConfig()
    _check_arguments(inputs, seq_len=seq_len, rows_per_shard=rows_per_shard, num_shards_hint=num_shards_hint)
    split = _SplitRequest.of(val_fraction, val_inputs, split_names)
    spec = load_tokenizer(tokenizer, storage)
    canonical = [_canonical_input(item) for item in inputs]
    filesystems: dict[str, pafs.FileSystem] = {"local": pafs.LocalFileSystem()}
    if any(item.startswith("s3://") for item in canonical + split.inputs):
        filesystems["s3"] = resolve_filesystem("s3://", storage)[0]
    out = _Output.resolve(output, storage)
    listing = split.listing(_list_inputs(canonical, s3=filesystems.get("s3"), exclude=out.exclude), filesystems, out.exclude)
    recipe = {
        "inputs": canonical, "seq_len": seq_len, "tokenizer": spec.info.identity(),
        "rows_per_shard": rows_per_shard, "num_shards_hint": num_shards_hint, **split.recipe(),
    }
    existing = _read_manifest(out.filesystem, out.root, out.display_root)
    if existing is not None and _holds_this_data(existing, recipe, listing, filesystems, output=output, overwrite=overwrite):
        if verbose:
            print(f"prepare-data: {out.display_root} already holds this data (same inputs, seq_len and tokenizer); nothing to do.", file=sys.stderr, flush=True)
        return existing
    if not listing.sources:
        raise DataError(f"no input files to prepare: check the --input paths.\n{_summarize_skipped(listing.skipped, limit=20)}")
    total_bytes = sum(s.size for s in listing.sources)
    if parallel is None:
        parallel = spec.json_text is not None or "s3" in filesystems or total_bytes > _RAY_BYTES_THRESHOLD
    rows_per_shard = rows_per_shard or _rows_per_shard(total_bytes, spec, seq_len=seq_len, num_shards_hint=num_shards_hint)

    _clear_output(out.filesystem, out.root, existing)
    writer, val = split.writers(out.filesystem, out.root, seq_len=seq_len, rows_per_shard=rows_per_shard, dtype=spec.dtype)
    progress = _Progress(len(listing.sources), enabled=verbose)
    hashed, used, skipped, num_tokens, dropped = _tokenize_and_pack(listing, spec, filesystems, writer, progress, val, parallel=parallel)
    manifest = Manifest(
        format_version=FORMAT_VERSION, seq_len=seq_len, num_sequences=writer.num_rows,
        num_documents=sum(s.num_documents for s in used) - val.hashed_documents, num_dropped_tokens=dropped,
        max_token_id=max(writer.max_token_id, val.writer.max_token_id), token_dtype=spec.dtype.name, tokenizer=spec.info,
        recipe=recipe, sources=used, sources_hash=_hash_sources(hashed), skipped=skipped, shards=writer.shards,
        validation=split.result(val, verbose=verbose), root=out.display_root,
    )
    with out.filesystem.open_output_stream(join_uri(out.root, MANIFEST_NAME)) as stream:  # written last: marks completion
        stream.write(manifest.to_json().encode())
    if verbose:
        progress.update(len(listing.sources), num_tokens, sum(not s.partial for s in skipped), force=True)
        _print_summary(manifest, seconds=time.perf_counter() - started, parallel=parallel)
    return manifest


def _tokenize_and_pack(
    listing: _Listing, spec: TokenizerSpec, filesystems: dict[str, pafs.FileSystem], writer: _ShardWriter,
    progress: _Progress, val: _ValPacker, *, parallel: bool,
):
    """Tokenize every input (Ray Data tasks or this process) and pack the results, see `_pack`.
    Raises DataError when they do not fill a single sequence."""
    with contextlib.ExitStack() as stack:
        if parallel:
            stack.enter_context(_ray_running())
            results = _results_ray(listing.sources, spec, filesystems)
        else:
            results = _results_local(listing.sources, spec, filesystems)
        packed = _pack(results, listing, writer, progress, val)
    if not writer.num_rows:
        _, _, skipped, num_tokens, _ = packed
        raise DataError(
            f"the inputs hold {num_tokens:,} tokens, fewer than one sequence of seq_len + 1 = {writer.row}; "
            f"add text or lower seq_len.\n{_summarize_skipped(skipped)}".rstrip()
        )
    return packed


@dataclass(kw_only=True)
class _SplitRequest:
    """What was asked of the validation split: a hashed share of the inputs, or separate inputs."""

    fraction: float
    explicit: bool
    """Asked for on the command line (an empty split is then an error, not a warning)."""
    inputs: list[str]
    """Canonical --val-input items (empty: a hashed split)."""
    names: tuple[str, str] = ("--val-fraction", "--val-input")
    """How the caller spells the two settings in messages: prepare-data's flags, or pretrain's data.* keys."""

    @classmethod
    def of(cls, val_fraction: float | None, val_inputs: list[str] | None,
           names: tuple[str, str] = ("--val-fraction", "--val-input")) -> _SplitRequest:
        if val_fraction is not None and val_inputs:
            raise DataError(f"pass either {names[0]} (a share of the input) or {names[1]} (a separate corpus), not both")
        if val_fraction is not None and not 0.0 < val_fraction <= 0.5:
            raise DataError(
                f"{names[0]} must be in (0, 0.5], got {val_fraction}: it is the share of documents held out "
                f"for validation (default {DEFAULT_VAL_FRACTION})"
            )
        inputs = [_canonical_input(item) for item in val_inputs or []]
        fraction = 1.0 if inputs else (val_fraction if val_fraction is not None else DEFAULT_VAL_FRACTION)
        return cls(fraction=fraction, explicit=val_fraction is not None or bool(inputs), inputs=inputs, names=names)

    def recipe(self) -> dict[str, Any]:
        return {"val_inputs": self.inputs} if self.inputs else {"val_fraction": self.fraction}

    def listing(self, train: _Listing, filesystems: dict[str, pafs.FileSystem], exclude: str | None) -> _Listing:
        """The training listing with every source's share set, plus the --val-input files."""
        for source in train.sources:
            source.val_fraction = 0.0 if self.inputs else self.fraction
        if not self.inputs:
            return train
        held = _list_inputs(self.inputs, s3=filesystems.get("s3"), exclude=exclude)
        training = {s.uri for s in train.sources}
        both = [s.uri for s in held.sources if s.uri in training]
        if both:
            raise DataError(f"{len(both)} file(s) are both --input and --val-input (e.g. {both[0]}); a document must be in one split only")
        for source in held.sources:
            source.val_fraction = 1.0
        held.skipped = [Skipped(path=s.path, reason=f"--val-input: {s.reason}") for s in held.skipped]
        return _Listing(sources=train.sources + held.sources, skipped=train.skipped + held.skipped)

    def writers(
        self, filesystem: pafs.FileSystem, root: str, *, seq_len: int, rows_per_shard: int, dtype: np.dtype
    ) -> tuple[_ShardWriter, _ValPacker]:
        """The training shards' writer and the validation split's packer (its shards under val/)."""
        filesystem.create_dir(join_uri(root, VAL_DIR), recursive=True)
        writer = _ShardWriter(filesystem=filesystem, root=root, seq_len=seq_len, rows_per_shard=rows_per_shard, dtype=dtype)
        held = _ShardWriter(filesystem=filesystem, root=root, seq_len=seq_len, rows_per_shard=rows_per_shard, dtype=dtype, prefix=f"{VAL_DIR}/")
        return writer, _ValPacker(held, writer, max_tokens=0 if self.inputs else VAL_MAX_TOKENS)

    def result(self, val: _ValPacker, *, verbose: bool) -> ValidationSplit | None:
        """The split for the manifest; None (with a warning) when the default share chose nothing."""
        if not val.writer.num_rows:
            fraction, separate = self.names
            fix = (
                f"add documents to {separate}" if self.inputs else
                f"raise {fraction} (now {self.fraction}; a corpus of few large files holds few documents) or set {separate}"
            )
            message = f"the validation split came out empty ({val.writer.tokens_added:,} tokens, fewer than one sequence); {fix}"
            if self.explicit:
                raise DataError(message)
            if verbose:
                who = "prepare-data: warning" if fraction.startswith("--") else "Data: warning"
                print(f"{who}: {message}. Prepared without one: evaluation will be off.", file=sys.stderr, flush=True)
            return None
        return ValidationSplit(
            method="inputs" if self.inputs else "hash", fraction=self.fraction, max_tokens=val.max_tokens,
            num_sequences=val.writer.num_rows, num_documents=val.num_documents, num_dropped_tokens=val.dropped,
            shards=val.writer.shards, sources=val.sources,
        )


def _check_arguments(inputs: list[str], *, seq_len: int, rows_per_shard: int | None, num_shards_hint: int | None) -> None:
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    if not inputs:
        raise DataError("no inputs given: pass files, directories, globs or s3:// URIs")
    for name, value in (("rows_per_shard", rows_per_shard), ("num_shards_hint", num_shards_hint)):
        if value is not None and value < 1:
            raise DataError(f"{name} must be >= 1, got {value}")


@dataclass(kw_only=True)
class _Output:
    """Where prepared data goes."""

    filesystem: pafs.FileSystem
    root: str
    """Path inside `filesystem`."""
    display_root: str
    """As users name it: the URI for S3, the path for local directories."""
    exclude: str | None
    """A local output directory, left out of the inputs' listing."""

    @classmethod
    def resolve(cls, output: str, storage: StorageConfig) -> _Output:
        filesystem, root = resolve_filesystem(output, storage)
        display_root = output.rstrip("/") if "://" in output else root
        if isinstance(filesystem, pafs.LocalFileSystem):
            return cls(filesystem=filesystem, root=root, display_root=display_root, exclude=root)
        bucket = root.split("/", 1)[0]
        if filesystem.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise DataError(f"output '{output}': bucket '{bucket}' does not exist (create it first)")
        return cls(filesystem=filesystem, root=root, display_root=display_root, exclude=None)


def _holds_this_data(
    existing: Manifest, recipe: dict, listing: _Listing, filesystems: dict[str, pafs.FileSystem], *, output: str, overwrite: bool
) -> bool:
    """True when `existing` was prepared from these very inputs and settings (preparing again is a
    no-op); False when it is to be replaced (overwrite); else a DataError says what differs."""
    differences = _recipe_differences(existing.recipe, recipe)
    if not differences:
        if _hash_sources(_hash_inputs(listing, filesystems)) == existing.sources_hash:
            return True
        differences = ["the input files changed since they were prepared"]
    if not overwrite:
        raise DataError(
            f"output '{output}' already holds prepared data made differently ({'; '.join(differences)}). "
            "Choose another output, or pass --overwrite to replace it."
        )
    return False


def _rows_per_shard(total_bytes: int, spec: TokenizerSpec, *, seq_len: int, num_shards_hint: int | None) -> int:
    """The default shard size: ~SHARD_TOKENS per shard, or about `num_shards_hint` shards."""
    estimated_tokens = total_bytes if spec.json_text is None else total_bytes // 4  # BPE: ~4 bytes a token
    if num_shards_hint is not None:
        return max(1, math.ceil(estimated_tokens / (seq_len + 1) / num_shards_hint))
    return max(1, SHARD_TOKENS // (seq_len + 1))


def _print_summary(manifest: Manifest, *, seconds: float, parallel: bool) -> None:
    print(
        f"prepare-data: {manifest.num_sequences:,} sequences of {manifest.seq_len + 1} tokens from {len(manifest.sources)} files "
        f"({manifest.num_documents:,} documents) in {len(manifest.shards)} shards at {manifest.root} "
        f"({seconds:.1f}s, {'Ray Data' if parallel else 'in-process'} tokenizing); "
        f"{manifest.num_dropped_tokens} tail tokens did not fill a sequence",
        file=sys.stderr, flush=True,
    )
    split = manifest.validation
    if split is not None:
        how = "from --val-input" if split.method == "inputs" else f"{split.fraction:g} of the documents by content hash"
        print(
            f"prepare-data: validation split: {split.num_sequences:,} sequences ({split.num_documents:,} documents, {how}) "
            f"in {len(split.shards)} shards under {VAL_DIR}/; training keeps {manifest.num_documents:,} documents",
            file=sys.stderr, flush=True,
        )
    if manifest.skipped:
        print(f"prepare-data: {_summarize_skipped(manifest.skipped, limit=0)}", file=sys.stderr, flush=True)


def _pack(results, listing: _Listing, writer: _ShardWriter, progress: _Progress, val: _ValPacker):
    """Feed tokenized files (in source order) to the shard writers; collect what was used and skipped."""
    skipped = list(listing.skipped)
    used: list[SourceFile] = []
    hashed: list[tuple[str, int, str]] = []
    num_tokens = 0
    try:
        for done, result in enumerate(results, start=1):
            source = listing.sources[result.index]
            if result.sha256:
                hashed.append((source.uri, source.size, result.sha256))
            if result.skip_reason:
                skipped.append(Skipped(path=source.uri, reason=result.skip_reason))
            else:
                if result.partial_reason:
                    skipped.append(Skipped(path=source.uri, reason=result.partial_reason, partial=True))
                writer.add(result.tokens)
                val.add(result, source)
                num_tokens += len(result.tokens) + (0 if result.val_tokens is None else len(result.val_tokens))
                entry = SourceFile(
                    path=source.uri, size=source.size, sha256=result.sha256, num_documents=result.num_documents,
                    num_tokens=len(result.tokens) + (0 if result.val_tokens is None else len(result.val_tokens)),
                    mtime_ns=source.mtime_ns,
                )
                (val.sources if source.val_fraction >= 1.0 else used).append(entry)
            progress.update(done, num_tokens, sum(not s.partial for s in skipped))
        dropped = writer.finish()
        val.finish()
    except BaseException:
        writer.abort()
        val.writer.abort()
        raise
    return hashed, used, skipped, num_tokens, dropped


class _ValPacker:
    """Routes each file's held-out documents to the validation writer, up to the hashed split's cap
    (then to training: a chosen document past the cap trains, it is never dropped)."""

    def __init__(self, writer: _ShardWriter, train_writer: _ShardWriter, *, max_tokens: int) -> None:
        self.writer, self.train_writer, self.max_tokens = writer, train_writer, max_tokens
        self.num_documents = 0
        self.hashed_documents = 0
        """Of num_documents, those held out of the training inputs (not --val-input files)."""
        self.sources: list[SourceFile] = []
        """--val-input files."""
        self.dropped = 0

    def add(self, result: _FileResult, source: _Source) -> None:
        if result.val_tokens is None:
            return
        capped = source.val_fraction < 1.0 and self.max_tokens and self.writer.tokens_added >= self.max_tokens
        if capped:
            self.train_writer.add(result.val_tokens)
        else:
            self.writer.add(result.val_tokens)
            self.num_documents += result.val_documents
            self.hashed_documents += result.val_documents if source.val_fraction < 1.0 else 0

    def finish(self) -> None:
        self.dropped = self.writer.finish()


def _clear_output(filesystem: pafs.FileSystem, root: str, existing: Manifest | None) -> None:
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


__all__ = [
    "DEFAULT_VAL_FRACTION", "JSONL_SUFFIXES", "SHARD_TOKENS", "VAL_DIR", "VAL_MAX_TOKENS", "is_validation_document", "list_inputs",
    "prepare_data", "read_documents",
]
