"""`prepare_data`: text (local or S3) -> tokenized, packed, fixed-length sequences in Parquet shards
plus `manifest.json` (docs/data.md, "raytrain-fast prepare-data", says what users see).

Pipeline: list the inputs (`inputs.py`) -> read every file as a stream (`readers.py`) and tokenize it a
batch of documents at a time, in Ray Data tasks or in this process (`tokenizing.py`), choosing the
validation split per document by a hash of its content (`split.py`) -> pack into rows of seq_len + 1
ids and write the shards (`shards.py`) -> write the manifest last.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import pyarrow.fs as pafs
import pyarrow.parquet as pq

from raytrain_fast.data.inputs import Listing, canonical_input, input_filesystems, list_sources, summarize_skipped
from raytrain_fast.data.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest, join_uri
from raytrain_fast.data.readers import DEFAULT_TEXT_FIELD, file_sha256, parquet_column_problem, input_format
from raytrain_fast.data.shards import VAL_DIR, Packed, ShardWriter, ValPacker, clear_output, hash_sources, pack, read_manifest
from raytrain_fast.data.split import SplitRequest
from raytrain_fast.data.tokenizer import TokenizerSpec, load_tokenizer
from raytrain_fast.data.tokenizing import Progress, ray_running, results_local, results_ray
from raytrain_fast.errors import DataError
from raytrain_fast.console import say
from raytrain_fast.storage import StorageConfig, resolve_filesystem

SHARD_TOKENS = 1 << 20
"""Default shard size in tokens (~1 MiB on disk for bytes). Shards are the unit of the per-epoch
shuffle and of the split across ranks, so many small shards shuffle better than a few big ones."""
_RAY_BYTES_THRESHOLD = 1 << 30  # the byte tokenizer is a memcpy: Ray only pays off for huge local inputs


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
        local = isinstance(filesystem, pafs.LocalFileSystem)
        bucket = root.split("/", 1)[0]
        if not local and filesystem.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise DataError(f"output '{output}': bucket '{bucket}' does not exist (create it first)")
        return cls(filesystem=filesystem, root=root, display_root=display_root, exclude=root if local else None)


def _holds_this_data(
    existing: Manifest, recipe: dict, listing: Listing, filesystems: dict[str, pafs.FileSystem], *, output: str, overwrite: bool
) -> bool:
    """True when `existing` was prepared from these very inputs and settings (preparing again is a
    no-op); False when it is to be replaced (overwrite); else a DataError says what differs."""
    differences = _recipe_differences(existing.recipe, recipe)
    if not differences:
        if hash_sources(_hash_inputs(listing, filesystems)) == existing.sources_hash:
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


def _say_summary(manifest: Manifest, *, seconds: float, parallel: bool) -> None:
    say(
        f"prepare-data: {manifest.num_sequences:,} sequences of {manifest.seq_len + 1} tokens from {len(manifest.sources)} files "
        f"({manifest.num_documents:,} documents) in {len(manifest.shards)} shards at {manifest.root} "
        f"({seconds:.1f}s, {'Ray Data' if parallel else 'in-process'} tokenizing); "
        f"{manifest.num_dropped_tokens} tail tokens did not fill a sequence",
        stderr=True,
    )
    split = manifest.validation
    if split is not None:
        how = "from --val-input" if split.method == "inputs" else f"{split.fraction:g} of the documents by content hash"
        say(
            f"prepare-data: validation split: {split.num_sequences:,} sequences ({split.num_documents:,} documents, {how}) "
            f"in {len(split.shards)} shards under {VAL_DIR}/; training keeps {manifest.num_documents:,} documents",
            stderr=True,
        )
    if manifest.skipped:
        say(f"prepare-data: {summarize_skipped(manifest.skipped, limit=0)}", stderr=True)



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


def _hash_inputs(listing: Listing, filesystems: dict[str, pafs.FileSystem]) -> list[tuple[str, int, str]]:
    """(path, size, sha256) of every readable input, as prepare_data records them."""
    entries = []
    for source in listing.sources:
        try:
            entries.append((source.uri, source.size, file_sha256(source.location, source.path, filesystems)))
        except OSError:
            continue
    return entries


def _check_inputs(listing: Listing, filesystems: dict[str, pafs.FileSystem], *, text_field: str) -> None:
    """Before any tokenizing: something to read, and the first Parquet file's text column (a footer
    read), so that a wrong --text-field fails in seconds; every other file is checked as it is read."""
    if not listing.sources:
        raise DataError(f"no input files to prepare: check the --input paths.\n{summarize_skipped(listing.skipped, limit=20)}")
    if not any(s.size for s in listing.sources):
        raise DataError(f"the inputs hold no text ({len(listing.sources)} empty file(s): {listing.sources[0].uri}): add text to them."
                        f"\n{summarize_skipped(listing.skipped, limit=20)}".rstrip())
    source = next((s for s in listing.sources if input_format(s.path)[0] == "parquet" and s.size), None)
    if source is None:
        return
    try:
        schema = pq.read_schema(source.path, filesystem=filesystems[source.location])
    except (OSError, ValueError):
        return  # not a Parquet file: reading it skips it with the reason
    problem = parquet_column_problem(schema, text_field)
    if problem:
        raise DataError(f"input {source.uri}: {problem}")


@dataclass(kw_only=True)
class _Job:
    """What to tokenize and how."""

    spec: TokenizerSpec
    listing: Listing
    filesystems: dict[str, pafs.FileSystem]
    text_field: str
    parallel: bool
    verbose: bool


def _tokenize_and_pack(job: _Job, writer: ShardWriter, progress: Progress, val: ValPacker) -> Packed:
    """Tokenize every input (Ray Data tasks or this process) and pack the parts, see `shards.pack`.
    Raises DataError when they do not fill a single sequence."""
    with contextlib.ExitStack() as stack:
        if job.parallel:
            stack.enter_context(ray_running())
            parts = results_ray(job.listing.sources, job.spec, job.filesystems, text_field=job.text_field)
        else:
            parts = results_local(job.listing.sources, job.spec, job.filesystems, text_field=job.text_field)
        packed = pack(parts, job.listing, writer, progress, val)
    if not writer.num_rows:
        raise DataError(
            f"the inputs hold {packed.num_tokens:,} tokens, fewer than one sequence of seq_len + 1 = {writer.row}; "
            f"add text or lower seq_len.\n{summarize_skipped(packed.skipped)}".rstrip()
        )
    return packed


def _write(
    job: _Job, out: _Output, split: SplitRequest, recipe: dict, *, seq_len: int, rows_per_shard: int, existing: Manifest | None
) -> Manifest:
    """Tokenize, pack and write the shards, then the manifest (last: it marks the output complete)."""
    created = out.filesystem.get_file_info(out.root).type == pafs.FileType.NotFound
    clear_output(out.filesystem, out.root, existing)
    writer, val = split.writers(out.filesystem, out.root, seq_len=seq_len, rows_per_shard=rows_per_shard, dtype=job.spec.dtype)
    progress = Progress(len(job.listing.sources), enabled=job.verbose)
    try:
        packed = _tokenize_and_pack(job, writer, progress, val)
    except DataError:  # too little text: leave no empty val/ (or output directory) behind
        if created:
            out.filesystem.delete_dir(out.root)
        else:
            clear_output(out.filesystem, out.root, None)
        raise
    manifest = Manifest(
        format_version=FORMAT_VERSION, seq_len=seq_len, num_sequences=writer.num_rows,
        num_documents=sum(s.num_documents for s in packed.used) - val.hashed_documents, num_dropped_tokens=packed.dropped,
        max_token_id=max(writer.max_token_id, val.writer.max_token_id), token_dtype=job.spec.dtype.name,
        tokenizer=job.spec.info, recipe=recipe, sources=packed.used, sources_hash=hash_sources(packed.hashed),
        skipped=packed.skipped, shards=writer.shards, validation=split.result(val, verbose=job.verbose), root=out.display_root,
    )
    with out.filesystem.open_output_stream(join_uri(out.root, MANIFEST_NAME)) as stream:
        stream.write(manifest.to_json().encode())
    progress.update(force=True)
    return manifest


def prepare_data(
    *, inputs: list[str], output: str, seq_len: int, tokenizer: str = "byte", storage: StorageConfig | None = None,
    overwrite: bool = False, rows_per_shard: int | None = None, num_shards_hint: int | None = None,
    parallel: bool | None = None, verbose: bool = True, val_fraction: float | None = None,
    val_inputs: list[str] | None = None, split_names: tuple[str, str] = ("--val-fraction", "--val-input"),
    text_field: str = DEFAULT_TEXT_FIELD,
) -> Manifest:
    """Tokenize and pack `inputs` into Parquet shards plus `manifest.json` under `output`.

    inputs: files, directories (read recursively, hidden entries skipped), globs, or s3:// URIs (a key,
        a prefix, or a glob). `.jsonl`/`.ndjson` files hold a document a line in the `text_field` field,
        `.parquet` files a document a row in the `text_field` column; `.gz`/`.zst` files are read
        decompressed (`.jsonl.zst`); every other file is one UTF-8 document.
    output: a local directory or s3://bucket/prefix (the bucket must exist).
    tokenizer: `byte` (ids 0-255 plus EOD 256, vocab 257), a tokenizer.json or an HF directory holding one.
    storage: endpoint/region for s3:// inputs, output and tokenizer (credentials from the environment).
    overwrite: replace a prepared dataset made from other inputs or settings (the same ones: a no-op).
    rows_per_shard / num_shards_hint: shard size (default ~1M tokens per shard); the hint is turned
        into rows per shard from the input size, so the shard count is approximate.
    parallel: tokenize in Ray Data tasks (True), in this process (False), or decide (None): Ray Data for
        a HuggingFace tokenizer, S3 inputs or more than 1 GiB of input (the byte tokenizer is a memcpy).
    val_fraction / val_inputs / split_names: the validation split, see `split.SplitRequest.of`."""
    started, storage = time.perf_counter(), storage or StorageConfig()
    _check_arguments(inputs, seq_len=seq_len, rows_per_shard=rows_per_shard, num_shards_hint=num_shards_hint)
    split = SplitRequest.of(val_fraction, val_inputs, split_names)
    spec = load_tokenizer(tokenizer, storage)
    canonical = [canonical_input(item) for item in inputs]
    filesystems = input_filesystems(canonical + split.inputs, storage)
    out = _Output.resolve(output, storage)
    listing = split.listing(list_sources(canonical, s3=filesystems.get("s3"), exclude=out.exclude), filesystems, out.exclude)
    recipe = {
        "inputs": canonical, "seq_len": seq_len, "tokenizer": spec.info.identity(), "rows_per_shard": rows_per_shard,
        "num_shards_hint": num_shards_hint, **split.recipe(),
        **({"text_field": text_field} if text_field != DEFAULT_TEXT_FIELD else {}),  # older recipes keep matching
    }
    existing = read_manifest(out.filesystem, out.root, out.display_root)
    if existing is not None and _holds_this_data(existing, recipe, listing, filesystems, output=output, overwrite=overwrite):
        if verbose:
            say(f"prepare-data: {out.display_root} already holds this data (same inputs, seq_len and tokenizer); nothing to do.", stderr=True)
        return existing
    _check_inputs(listing, filesystems, text_field=text_field)
    total_bytes = sum(s.size for s in listing.sources)
    if parallel is None:
        parallel = spec.json_text is not None or "s3" in filesystems or total_bytes > _RAY_BYTES_THRESHOLD
    job = _Job(spec=spec, listing=listing, filesystems=filesystems, text_field=text_field, parallel=parallel, verbose=verbose)
    rows = rows_per_shard or _rows_per_shard(total_bytes, spec, seq_len=seq_len, num_shards_hint=num_shards_hint)
    manifest = _write(job, out, split, recipe, seq_len=seq_len, rows_per_shard=rows, existing=existing)
    if verbose:
        _say_summary(manifest, seconds=time.perf_counter() - started, parallel=parallel)
    return manifest
