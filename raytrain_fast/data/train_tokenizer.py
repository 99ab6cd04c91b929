"""`train_tokenizer`: a byte-level BPE trained with the `tokenizers` package's BpeTrainer on the inputs
`prepare_data` takes (listed and read by the same code), written as a Hugging Face tokenizer directory.

docs/models.md ("Train a tokenizer") describes the model, the output files and the id layout: the
byte tokenizer's (byte b is id b, the end-of-document token 256, the merges from 257), so the model
reads id 256 as the end of a document with either tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from raytrain_fast.config.data import BYTE_VOCAB_SIZE, EOD_TOKEN
from raytrain_fast.console import say
from raytrain_fast.data.hf_tokenizer import BYTE_EOD_TEXT, byte_tokenizer_json, hf_tokenizer_files
from raytrain_fast.data.manifest import Skipped, TokenizerInfo
from raytrain_fast.data.inputs import canonical_input, list_inputs, summarize_skipped
from raytrain_fast.data.readers import DEFAULT_TEXT_FIELD, FileReader
from raytrain_fast.data.tokenizer import EOD_CANDIDATES, TOKENIZER_FILE, TokenizerSpec
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig

DEFAULT_VOCAB_SIZE = 32000
"""Llama 2's and Mistral's size; a multiple of 64, the model's fastest vocab_size."""
MIN_VOCAB_SIZE = BYTE_VOCAB_SIZE + 1
"""256 bytes + the end-of-document token + at least one merge (257 is the byte tokenizer itself)."""
DEFAULT_MIN_FREQUENCY = 2
TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")


@dataclass(kw_only=True)
class TrainedTokenizer:
    """What `train_tokenizer` wrote and from what."""

    output: str
    """The directory, absolute."""
    vocab_size: int
    """Tokens in the vocabulary, the end-of-document token included: the model's vocab_size must be at least this."""
    asked_vocab_size: int
    eod_token: str
    eod_id: int
    num_files: int
    num_documents: int
    num_bytes: int
    skipped: list[Skipped] = field(default_factory=list)
    seconds: float = 0.0


class _Progress:
    """train-tokenizer's progress line while reading: at most one line every `every_s` seconds, on stderr."""

    def __init__(self, total_files: int, *, enabled: bool, every_s: float = 2.0) -> None:
        self.total, self.enabled, self.every_s = total_files, enabled, every_s
        self.start = self.last = time.perf_counter()
        self.shown: tuple[int, int, int] | None = None

    def update(self, files: int, num_bytes: int, skipped: int, *, force: bool = False) -> None:
        """A line at most every every_s; `force` (the end of reading) a line unless the last one said the same."""
        now = time.perf_counter()
        if self.enabled and (now - self.last >= self.every_s or (force and self.shown != (files, num_bytes, skipped))):
            self.last, self.shown = now, (files, num_bytes, skipped)
            say(
                f"train-tokenizer: {files}/{self.total} files, {num_bytes:,} bytes, {skipped} skipped, {now - self.start:.1f}s",
                stderr=True,
            )


def _check_arguments(inputs: list[str], *, output: str, vocab_size: int, min_frequency: int, eod_token: str) -> None:
    if not inputs:
        raise DataError("no inputs given: pass files, directories, globs or s3:// URIs")
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"--vocab-size must be at least {MIN_VOCAB_SIZE} (256 byte tokens, the end-of-document token and a merge), "
            f"got {vocab_size}; e.g. --vocab-size {DEFAULT_VOCAB_SIZE}. For bytes alone, prepare-data's --tokenizer byte needs no training"
        )
    if min_frequency < 1:
        raise DataError(f"--min-frequency must be >= 1, got {min_frequency}")
    if eod_token not in EOD_CANDIDATES:
        raise DataError(f"--eod-token must be one of {', '.join(EOD_CANDIDATES)} (the names prepare-data looks for), got {eod_token!r}")
    if "://" in output and not output.startswith("file://"):
        raise DataError(f"--output '{output}' must be a local directory; copy the tokenizer to a bucket afterwards if you need it there")


def _check_output(output: str, *, overwrite: bool) -> str:
    """The absolute output directory; refused when it is a file, or holds a tokenizer and not `overwrite`."""
    out = canonical_input(output)  # a local path: _check_arguments refused any other URI
    if os.path.exists(out) and not os.path.isdir(out):
        raise DataError(f"output '{output}' exists and is not a directory")
    existing = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(out, name))]
    if existing and not overwrite:
        raise DataError(
            f"output '{output}' already holds a tokenizer ({', '.join(existing)}). "
            "Choose another output, or pass --overwrite to replace it."
        )
    return out


def _import_tokenizers() -> None:
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        raise DataError(
            "train-tokenizer needs the 'tokenizers' package, which is not installed: pip install tokenizers "
            "(or pip install -e '.[tokenizers]')"
        ) from None


def _byte_layout(json_text: str, eod_token: str) -> str:
    """The trained tokenizer with the byte tokenizer's ids: byte b's token is id b, `eod_token` 256,
    the merged tokens 257 on in the trainer's order. BPE applies merges by their rank in the merge
    list, never by id, so renumbering changes no encoding."""
    data = json.loads(json_text)
    byte_ids = json.loads(byte_tokenizer_json())["model"]["vocab"]  # byte character -> byte value
    trained = data["model"]["vocab"]
    assert set(byte_ids) <= set(trained), "the trainer left out a byte character (initial_alphabet)"
    vocab = dict(byte_ids)
    vocab[eod_token] = EOD_TOKEN
    for token, _ in sorted(trained.items(), key=lambda item: item[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    data["model"]["vocab"] = vocab
    for added in data["added_tokens"]:
        added["id"] = vocab[added["content"]]
    return json.dumps(data, ensure_ascii=False)


def _train(
    listing, filesystems, *, vocab_size: int, min_frequency: int, eod_token: str, verbose: bool, text_field: str,
) -> tuple[str, dict[str, int], list[Skipped]]:
    """(tokenizer.json text in the byte layout, counts of files/documents/bytes read, skipped inputs):
    the BpeTrainer reads every listed input through a FileReader, printing progress as it goes."""
    skipped = list(listing.skipped)
    counts = {"files": 0, "documents": 0, "bytes": 0}
    progress = _Progress(len(listing.sources), enabled=verbose)

    def texts() -> Iterator[list[str]]:
        for done, source in enumerate(listing.sources, start=1):
            reader = FileReader(source.location, source.path, filesystems, text_field=text_field)
            for documents in reader.batches():
                counts["documents"] += len(documents)
                counts["bytes"] += sum(len(d) for d in documents)
                yield [d.decode("utf-8") for d in documents]
            if reader.fatal:
                raise DataError(f"input {source.uri}: {reader.fatal}")
            if reader.skip_reason:
                skipped.append(Skipped(path=source.uri, reason=reader.skip_reason))
            else:
                counts["files"] += 1
                if reader.partial_reason:
                    skipped.append(Skipped(path=source.uri, reason=reader.partial_reason, partial=True))
            progress.update(done, counts["bytes"], sum(not s.partial for s in skipped))
        progress.update(len(listing.sources), counts["bytes"], sum(not s.partial for s in skipped), force=True)
        if verbose and counts["documents"]:
            say(f"train-tokenizer: learning merges up to a vocabulary of {vocab_size:,} (no progress lines while it runs)", stderr=True)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split; no prefix space: text round-trips
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[eod_token],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(texts(), trainer)
    if not counts["documents"]:
        raise DataError(f"the inputs hold no usable text to train on.\n{summarize_skipped(skipped, listed=False)}".rstrip())
    return _byte_layout(tokenizer.to_str(), eod_token), counts, skipped


def _write(out: str, json_text: str, eod_token: str) -> TokenizerInfo:
    """Write the tokenizer files (each whole: a temporary name, then renamed) and describe them."""
    from tokenizers import Tokenizer

    trained = Tokenizer.from_str(json_text)
    info = TokenizerInfo(
        kind="hf", name=os.path.join(out, TOKENIZER_FILE), hash=hashlib.sha256(json_text.encode()).hexdigest(),
        vocab_size=trained.get_vocab_size(with_added_tokens=True), eod_id=trained.token_to_id(eod_token),
    )
    os.makedirs(out, exist_ok=True)
    for name, text in hf_tokenizer_files(TokenizerSpec(info=info, json_text=json_text), model_max_length=None).items():
        partial = os.path.join(out, f".{name}.partial")
        with open(partial, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(partial, os.path.join(out, name))
    return info


def train_tokenizer(
    *,
    inputs: list[str],
    output: str,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    min_frequency: int = DEFAULT_MIN_FREQUENCY,
    eod_token: str = BYTE_EOD_TEXT,
    storage: StorageConfig | None = None,
    overwrite: bool = False,
    verbose: bool = True,
    text_field: str = DEFAULT_TEXT_FIELD,
) -> TrainedTokenizer:
    """Train a byte-level BPE of at most `vocab_size` tokens on `inputs` and write it to `output`.

    inputs: what prepare_data takes (files, directories, globs, s3:// URIs; JSONL records' and Parquet
        rows' `text_field`, gzip/zstd; every other file one UTF-8 document); unusable files are skipped.
    output: a local directory; one that already holds a tokenizer is replaced only with `overwrite`.
    vocab_size: the vocabulary, end-of-document token included. The result is smaller when the corpus
        has fewer pairs seen `min_frequency` times than merges to learn (TrainedTokenizer.vocab_size says).
    eod_token: the end-of-document token, one of EOD_CANDIDATES (id 256).
    storage: endpoint/region for s3:// inputs (credentials from the environment).
    Every check that can fail without reading the inputs runs before any is read."""
    started, storage = time.perf_counter(), storage or StorageConfig()
    _check_arguments(inputs, output=output, vocab_size=vocab_size, min_frequency=min_frequency, eod_token=eod_token)
    out = _check_output(output, overwrite=overwrite)
    _import_tokenizers()
    listing, filesystems = list_inputs(inputs, storage, exclude=out)
    if not listing.sources:
        raise DataError(f"no input files to train on: check the --input paths.\n{summarize_skipped(listing.skipped, limit=20, listed=False)}")

    json_text, counts, skipped = _train(
        listing, filesystems, vocab_size=vocab_size, min_frequency=min_frequency, eod_token=eod_token, verbose=verbose,
        text_field=text_field,
    )
    info = _write(out, json_text, eod_token)
    result = TrainedTokenizer(
        output=out, vocab_size=info.vocab_size, asked_vocab_size=vocab_size, eod_token=eod_token, eod_id=info.eod_id,
        num_files=counts["files"], num_documents=counts["documents"], num_bytes=counts["bytes"], skipped=skipped,
        seconds=time.perf_counter() - started,
    )
    if verbose:
        _say_summary(result, min_frequency=min_frequency)
    return result


def _say_summary(result: TrainedTokenizer, *, min_frequency: int) -> None:
    short = (
        f" (asked for {result.asked_vocab_size:,}: the corpus has no more pairs seen at least {min_frequency} times; "
        "more text gives more merges)" if result.vocab_size < result.asked_vocab_size else ""
    )
    say(
        f"train-tokenizer: a byte-level BPE of {result.vocab_size:,} tokens{short} in {result.output}, from {result.num_files} "
        f"files ({result.num_documents:,} documents, {result.num_bytes:,} bytes) in {result.seconds:.1f}s; "
        f"end-of-document {result.eod_token} = id {result.eod_id}",
        stderr=True,
    )
    if result.skipped:
        say(f"train-tokenizer: {summarize_skipped(result.skipped, listed=False)}", stderr=True)
