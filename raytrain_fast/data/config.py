from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class DataConfig:
    """Where training sequences come from and how they are fed."""

    source: str = "stdlib"
    """`stdlib` = the source files of the running Python's standard library (on every machine, no
    download), or a directory of text files / a single text file."""
    seq_len: int = 128
    """Tokens per training sequence (the model sees seq_len inputs and predicts seq_len targets)."""
    max_tokens: int = 0
    """Use at most this many tokens of the corpus (0 = all of it). Handy for quick runs."""
    prefetch_batches: int = 2
    """Batches Ray Data prepares ahead of the step loop."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shuffle of sequences."""
