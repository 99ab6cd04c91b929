from __future__ import annotations

from dataclasses import dataclass

EOD_TOKEN = 256
BYTE_VOCAB_SIZE = 257
"""The byte tokenizer's vocabulary: 256 byte values and the end-of-document token (here, with the
data section, so that validating a config needs nothing else of the data package)."""


@dataclass(kw_only=True)
class DataConfig:
    """Where training sequences come from and how they are fed."""

    source: str = "stdlib"
    """`stdlib` (this Python's standard library source: on every machine, no download), a text file,
    directory or glob (prepared once into cache_dir), or a dataset made by `prepare-data` (a local
    directory or s3:// URI holding manifest.json)."""
    seq_len: int = 128
    """Tokens per training sequence (the model sees seq_len inputs and predicts seq_len targets)."""
    tokenizer: str = "byte"
    """`byte` (256 byte values + end-of-document, vocab 257), a path to a HuggingFace tokenizer.json or a
    directory holding one, e.g. train-tokenizer's output (needs `pip install tokenizers`); used when source
    is prepared on the fly."""
    cache_dir: str | None = None
    """Where sources are prepared on the fly; null = `<storage.uri>/_prepared`. Must be readable by every node."""
    val_fraction: float | None = None
    """Share of documents held out for validation when source is prepared on the fly, in (0, 0.5]
    (prepare-data's --val-fraction); null = 0.005, capped at ~8M tokens."""
    val_input: str | None = None
    """A separate validation corpus (file, directory or glob) for a source prepared on the fly,
    instead of val_fraction (prepare-data's --val-input)."""
    max_tokens: int = 0
    """Use at most this many tokens of the prepared data (0 = all of it). Handy for quick runs."""
    prefetch_batches: int = 2
    """Batches Ray Data prepares ahead of the step loop."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shard order (and so of which sequences each worker sees)."""
