"""`manifest.json`: what a prepared dataset holds and how it was made.

Written last by `prepare_data`, so a directory with a manifest is complete. Shard paths are relative
to the manifest's directory, so a prepared dataset can be copied or moved (local dir <-> bucket).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any

from raytrain_fast.errors import DataError

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


@dataclass(kw_only=True)
class TokenizerInfo:
    """Which tokenizer made the tokens: two datasets with the same `kind` and `hash` tokenize alike."""

    kind: str
    """`byte` (bytes 0-255 plus EOD) or `hf` (a HuggingFace `tokenizers` JSON file)."""
    name: str
    """`byte`, or the tokenizer file as given."""
    hash: str
    """sha256 of the tokenizer file (of a fixed description for `byte`)."""
    vocab_size: int
    """Number of token ids, special tokens included; the model's vocab_size must be at least this."""
    eod_id: int
    """Token id appended after every document."""
    bos_id: int | None = None
    """Token id put before every document: the one the tokenizer file's post-processor adds (Llama 3's
    `<|begin_of_text|>`, Mistral's `<s>`); None when it adds none (byte, Qwen, GPT-2 style)."""

    def identity(self) -> dict[str, str]:
        # With a BOS the same file makes other tokens: a key of its own (without, the key stays as it was).
        return {"kind": self.kind, "hash": self.hash, **({"bos_id": str(self.bos_id)} if self.bos_id is not None else {})}


@dataclass(kw_only=True)
class SourceFile:
    path: str
    """Local absolute path or s3:// URI."""
    size: int
    sha256: str
    num_documents: int
    """Plain-text files are one document; JSONL files one per usable record."""
    num_tokens: int
    """Tokens this file contributed, EOD tokens included."""
    mtime_ns: int | None = None
    """Local files only: lets a cache notice a changed file without reading it (not part of any hash)."""


@dataclass(kw_only=True)
class Skipped:
    path: str
    reason: str
    partial: bool = False
    """True: the file was used; only some of its JSONL records were skipped (the reason says which)."""


@dataclass(kw_only=True)
class Shard:
    path: str
    """Relative to the manifest's directory."""
    num_rows: int
    first_seq_id: int
    """Rows hold seq_ids first_seq_id .. first_seq_id + num_rows - 1, in order."""


@dataclass(kw_only=True)
class ValidationSplit:
    """The held-out validation sequences: whole documents kept out of training (see data.md)."""

    method: str
    """`hash`: documents whose content hash falls under `fraction` (capped at `max_tokens`);
    `inputs`: every document of the separate `--val-input` files."""
    fraction: float
    """The share of documents asked for (method `hash`); 1.0 for `inputs`."""
    max_tokens: int
    """Cap of the hashed split: once it holds this many tokens, further chosen documents train (0 = none)."""
    num_sequences: int
    num_documents: int
    num_dropped_tokens: int
    """Tokens of the split's final, incomplete row that were not written."""
    shards: list[Shard]
    """Paths relative to the manifest's directory (`val/shard-*.parquet`); seq_ids count from 0."""
    sources: list[SourceFile] = field(default_factory=list)
    """The `--val-input` files (method `inputs`); empty for `hash` (the documents come from `sources`)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ValidationSplit:
        values = dict(data)
        values["shards"] = [Shard(**s) for s in data["shards"]]
        values["sources"] = [SourceFile(**s) for s in data.get("sources", [])]
        return cls(**values)


@dataclass(kw_only=True)
class Manifest:
    """A prepared dataset: fixed-length packed sequences in Parquet shards.

    Each row is one sequence: `seq_id` (int64, global, in packing order) and `tokens`
    (fixed-size list of seq_len + 1 token ids: the model reads seq_len and predicts the shifted seq_len).
    Documents are concatenated in source order, each followed by the EOD token, and cut into rows; the
    tail shorter than one row is dropped (counted in `num_dropped_tokens`).
    """

    format_version: int = FORMAT_VERSION
    seq_len: int
    num_sequences: int
    num_documents: int
    num_dropped_tokens: int
    """Tokens of the final, incomplete row that were not written."""
    max_token_id: int
    token_dtype: str
    """numpy dtype of the stored ids: uint16 for vocabularies up to 65,536, else uint32."""
    tokenizer: TokenizerInfo
    recipe: dict[str, Any]
    """What was asked for (inputs, seq_len, tokenizer identity, shard sizing, max_tokens); with
    `sources_hash` it decides whether preparing again is a no-op or a conflict."""
    sources: list[SourceFile]
    sources_hash: str
    """sha256 over (path, size, sha256) of every source file, in order."""
    skipped: list[Skipped] = field(default_factory=list)
    """Everything that was given but not used, with the reason (nothing is dropped silently)."""
    shards: list[Shard]
    validation: ValidationSplit | None = None
    """The held-out split; None for data prepared before splits existed (or with an empty split).
    The counts above (num_sequences, num_documents, shards) are the training split's."""
    root: str = ""
    """Directory (or URI) the manifest was read from; not stored in the file."""

    @property
    def num_tokens(self) -> int:
        """Tokens stored: num_sequences x (seq_len + 1)."""
        return self.num_sequences * (self.seq_len + 1)

    def to_json(self) -> str:
        # json asks `default` for each dataclass in turn: no copies (dataclasses.asdict deep-copies
        # thousands of source entries slowly). `root` is where the manifest was read from, not stored.
        return json.dumps(self, default=_stored_fields, indent=1) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, root: str = "") -> Manifest:
        try:
            version = data.get("format_version")
            if version != FORMAT_VERSION:
                raise DataError(
                    f"manifest at {root or '?'} has format_version {version!r}; this raytrain_fast reads "
                    f"version {FORMAT_VERSION}. Prepare the data again with this version."
                )
            values = dict(data)
            values["tokenizer"] = TokenizerInfo(**data["tokenizer"])
            values["sources"] = [SourceFile(**s) for s in data["sources"]]
            values["skipped"] = [Skipped(**s) for s in data.get("skipped", [])]
            values["shards"] = [Shard(**s) for s in data["shards"]]
            values["validation"] = ValidationSplit.from_dict(data["validation"]) if data.get("validation") else None
            return cls(**values, root=root)
        except (KeyError, TypeError) as error:
            raise DataError(f"manifest at {root or '?'} is malformed ({error}); prepare the data again") from None


def load_manifest(uri: str, storage: Any = None) -> Manifest:
    """The manifest of prepared data at `uri` (its directory or the manifest.json itself). `storage`:
    a StorageConfig or None."""
    from raytrain_fast.storage import StorageConfig, resolve_filesystem, store_corruption_hint

    root = uri.rstrip("/")
    if root.endswith("/" + MANIFEST_NAME) or root == MANIFEST_NAME:
        root = root[: -len(MANIFEST_NAME)].rstrip("/")
    filesystem, path = resolve_filesystem(root, storage or StorageConfig())
    try:
        with filesystem.open_input_stream(f"{path.rstrip('/')}/{MANIFEST_NAME}") as stream:
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
        raise DataError(f"{MANIFEST_NAME} at '{uri}' is not valid JSON ({error}). {store_corruption_hint(raw)}.") from None
    return Manifest.from_dict(data, root=root if "://" in root else path)


def check_manifest_matches(manifest: Manifest, *, seq_len: int, vocab_size: int) -> list[str]:
    """Problems that make `manifest` unusable for this model (empty list = fine), meant to be raised
    as one ConfigError before any worker starts. A source smaller than a micro-batch is no problem: its
    stream goes on epoch after epoch (data/order.py)."""
    problems = []
    where = manifest.root or "the prepared data"
    if manifest.seq_len != seq_len:
        problems.append(
            f"{where} was prepared with seq_len {manifest.seq_len} but data.seq_len is {seq_len}: set "
            f"data.seq_len={manifest.seq_len} (every source of the run must have it), or prepare it again with --seq-len {seq_len}"
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
    return problems


def _stored_fields(entry: Any) -> dict[str, Any]:
    return {f.name: getattr(entry, f.name) for f in fields(entry) if f.name != "root"}


def join_uri(root: str, relative: str) -> str:
    return f"{root.rstrip('/')}/{relative}" if root else relative


def shard_locations(manifests: list[Manifest], storage: Any) -> tuple[list, list, Any]:
    """(a filesystem per manifest, (manifest index, path) and first seq_id of every shard, manifest after
    manifest): what the training readers read. `storage`: a StorageConfig or None."""
    import numpy as np

    from raytrain_fast.storage import StorageConfig, resolve_filesystem

    filesystems, paths, first_seq_ids = [], [], []
    for index, manifest in enumerate(manifests):
        filesystem, root = resolve_filesystem(manifest.root, storage or StorageConfig())
        filesystems.append(filesystem)
        paths += [(index, f"{root.rstrip('/')}/{shard.path}") for shard in manifest.shards]
        first_seq_ids += [shard.first_seq_id for shard in manifest.shards]
    return filesystems, paths, np.asarray(first_seq_ids, dtype=np.int64)


def read_shard(path: str, filesystem: Any) -> Any:
    """A training shard's seq_id and tokens columns. A shard that is missing or not a Parquet file
    is a DataError naming it (reading again meets the same file); a storage failure (OSError) stays
    itself (a retry may get through)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    fix = ("prepare the data again (`raytrain-fast prepare-data ... --overwrite`; for a source prepared on the fly, "
           "delete its directory and run again)")
    try:
        return pq.read_table(path, filesystem=filesystem, columns=["seq_id", "tokens"])
    except FileNotFoundError:
        raise DataError(f"the prepared data's shard {path} is missing: {fix}") from None
    except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
        raise DataError(f"the prepared data's shard {path} cannot be read ({error}): {fix}") from None
