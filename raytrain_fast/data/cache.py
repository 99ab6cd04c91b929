"""Corpora prepared once and reused: the default `stdlib` corpus and plain local files/directories go
through `prepare_data` into a cache directory keyed by (source, seq_len, tokenizer, Python version)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import shutil
import sys
import sysconfig

import pyarrow.fs as pafs

from raytrain_fast.data.corpus import stdlib_files
from raytrain_fast.console import say
from raytrain_fast.data.manifest import MANIFEST_NAME, join_uri
from raytrain_fast.data.inputs import canonical_input, list_inputs
from raytrain_fast.data.prepare import prepare_data
from raytrain_fast.data.readers import DEFAULT_TEXT_FIELD, TEXT_FIELD_SETTING, name_settings
from raytrain_fast.data.tokenizer import load_tokenizer
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

STDLIB = "stdlib"
_CACHE_INFO = "cache.json"


def is_prepared(uri: str, storage: StorageConfig) -> bool:
    """Whether `uri` holds a complete prepared dataset (its manifest.json)."""
    filesystem, path = resolve_filesystem(uri, storage)
    try:
        return filesystem.get_file_info(join_uri(path, MANIFEST_NAME)).type == pafs.FileType.File
    except OSError:
        return False




def text_problem(source: str, storage: StorageConfig, *, setting: str, remedy: str = "") -> str | None:
    """Why `source` (the value of `setting`, data.source or one of data.sources), when it is text to
    prepare, cannot be: missing, or holding no text (only empty files). Its files are listed as
    prepare-data lists them: a check of seconds, before Ray starts. `remedy` ends each message."""
    if source == STDLIB or is_prepared(source, storage):
        return None
    try:
        listing = list_inputs([source], storage)[0]
    except DataError:  # a bucket that cannot be listed
        listing = None
    if not (listing and listing.sources) and ("://" in source or not os.path.exists(source)):
        return (f"{setting} '{source}' does not exist: give a prepared dataset (directory or s3:// URI holding "
                f"manifest.json), text to prepare (file, directory, glob) or 'stdlib'{remedy}")
    if not any(s.size > 0 for s in (listing.sources if listing else [])):
        return f"{setting} '{source}' is empty (no file with any text): add text to it{remedy}"
    return None


def _fingerprint(inputs: list[str], storage: StorageConfig) -> str:
    """sha256 over (path, size, mtime) of every input file: notices changed files without reading them."""
    listing = list_inputs(inputs, storage)[0]
    digest = hashlib.sha256()
    for source in listing.sources:
        digest.update(f"{source.uri}\0{source.size}\0{source.mtime_ns}\n".encode())
    for skipped in listing.skipped:
        digest.update(f"{skipped.path}\0{skipped.reason}\n".encode())
    return digest.hexdigest()


def _read_info(uri: str, storage: StorageConfig) -> dict:
    filesystem, path = resolve_filesystem(uri, storage)
    try:
        with filesystem.open_input_stream(join_uri(path, _CACHE_INFO)) as stream:
            return json.loads(stream.read())
    except (OSError, ValueError):
        return {}


def _cache_key(canonical: dict, *, seq_len: int, tokenizer: object, val_fraction: float | None, val_inputs: list[str]) -> str:
    # The split settings only when set, so that corpora cached with the default split keep their key.
    split = {**({"val_fraction": val_fraction} if val_fraction is not None else {}), **({"val_inputs": val_inputs} if val_inputs else {})}
    return hashlib.sha256(
        # "split": a corpus cached before validation splits existed is prepared again, with one.
        json.dumps({**canonical, **split, "seq_len": seq_len, "tokenizer": tokenizer, "split": "val-v1"}, sort_keys=True).encode()
    ).hexdigest()[:16]


def _inputs_of(source: str) -> tuple[list[str], str, dict]:
    """(input paths, a readable slug for the cache directory, the source as the cache key sees it)."""
    if source == STDLIB:
        slug = f"stdlib-{platform.python_implementation().lower()}{platform.python_version()}"
        return [str(p) for p in stdlib_files()], slug, {"source": STDLIB, "python": sys.version, "stdlib": sysconfig.get_paths()["stdlib"]}
    item = canonical_input(source)
    if not item.startswith("s3://") and not any(c in item for c in "*?[") and not os.path.exists(item):
        raise DataError(f"data source '{source}' does not exist; give a text file, a directory, a glob or 'stdlib'")
    slug = "".join(c if c.isalnum() or c in "-_." else "_" for c in os.path.basename(item.rstrip("/")))[:40] or "corpus"
    return [item], slug, {"source": item}


PRETRAIN_NAMES = {TEXT_FIELD_SETTING: "data.text_field", "--input": "data.source", "--tokenizer": "data.tokenizer"}
"""prepare-data's flags that a message about a source prepared on the fly names as pretrain's settings."""


def ensure_prepared_corpus(
    source: str = STDLIB,
    *,
    seq_len: int,
    cache_dir: str,
    tokenizer: str = "byte",
    storage: StorageConfig | None = None,
    verbose: bool = True,
    val_fraction: float | None = None,
    val_input: str | None = None,
    text_field: str = DEFAULT_TEXT_FIELD,
) -> str:
    """The manifest directory (URI) of `source`, prepared on first use and reused afterwards.

    source: `stdlib` (this Python's standard library, .py files only), a local file, directory or glob,
        or an already prepared dataset (a directory or s3:// URI holding manifest.json), returned as is.
    cache_dir: local directory or s3:// URI under which prepared corpora are kept. Workers on other
        nodes must be able to read it: use shared storage or a bucket on a multi-node cluster.
    A cached corpus is prepared again when its files changed (path, size or modification time).
    val_fraction / val_input: its validation split (data.val_fraction / data.val_input); part of the cache key.
    text_field: the JSONL field / Parquet column of the text; part of the cache key when not `text`.
    """
    storage = storage or StorageConfig()
    if source != STDLIB and is_prepared(source, storage):
        return source.rstrip("/") if "://" in source else os.path.abspath(os.path.expanduser(source))

    spec = load_tokenizer(tokenizer, storage)
    inputs, slug, canonical = _inputs_of(source)
    if text_field != DEFAULT_TEXT_FIELD:  # only when set, so that cached corpora keep their key
        canonical["text_field"] = text_field
    val_inputs = [canonical_input(val_input)] if val_input else []
    key = _cache_key(canonical, seq_len=seq_len, tokenizer=spec.info.identity(), val_fraction=val_fraction, val_inputs=val_inputs)
    target = join_uri(cache_dir.rstrip("/") if "://" in cache_dir else os.path.abspath(os.path.expanduser(cache_dir)), f"{slug}-seq{seq_len}-{key}")
    fingerprint = _fingerprint(inputs + val_inputs, storage)
    if is_prepared(target, storage) and _read_info(target, storage).get("fingerprint") == fingerprint:
        return target

    if verbose:
        say(f"Preparing '{source}' (seq_len {seq_len}, tokenizer {spec.info.name}) once into {target}", stderr=True)
    prepare = functools.partial(
        prepare_data, inputs=inputs, seq_len=seq_len, tokenizer=tokenizer, storage=storage, overwrite=True, verbose=verbose,
        val_fraction=val_fraction, val_inputs=val_inputs or None, split_names=("data.val_fraction", "data.val_input"),
        text_field=text_field,
    )
    info = json.dumps({"source": source, "seq_len": seq_len, "tokenizer": spec.info.name, "fingerprint": fingerprint}).encode()
    try:
        if "://" in target:
            prepare(output=target)
            filesystem, path = resolve_filesystem(target, storage)
            with filesystem.open_output_stream(join_uri(path, _CACHE_INFO)) as stream:
                stream.write(info)
        else:
            _prepare_in_place(target, prepare, info, fingerprint=fingerprint, storage=storage, verbose=verbose)
    except DataError as error:  # its advice names pretrain's settings, not prepare-data's flags
        raise DataError(name_settings(str(error), PRETRAIN_NAMES)) from None
    return target


def _prepare_in_place(target: str, prepare, info: bytes, *, fingerprint: str, storage: StorageConfig, verbose: bool) -> None:
    """Local: prepare next to the target and rename it into place, so a concurrent run sees either
    nothing or a complete dataset."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    staging = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        prepare(output=staging)
        with open(os.path.join(staging, _CACHE_INFO), "wb") as file:
            file.write(info)
        if os.path.exists(target):
            stale = f"{target}.stale-{os.getpid()}"
            os.rename(target, stale)
            shutil.rmtree(stale, ignore_errors=True)
        os.rename(staging, target)
        if verbose:
            say(f"Prepared corpus moved into place: {target}", stderr=True)
    except OSError:
        if not (is_prepared(target, storage) and _read_info(target, storage).get("fingerprint") == fingerprint):
            raise  # not a lost race with a concurrent run that finished first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
