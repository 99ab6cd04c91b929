"""Text corpora turned into packed token sequences.

The default corpus is the source of the running Python's standard library: real text that every
machine has, so the first run needs no download. Tokens are bytes (0-255) plus an end-of-document
token (256) after every file.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np

from raytrain_fast.errors import DataError

EOD_TOKEN = 256
BYTE_VOCAB_SIZE = 257


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library, site-packages excluded, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    # os.walk that never enters site-packages: Path.rglob would walk every installed package first (~40x slower).
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        files += [Path(directory, n) for n in names if n.endswith(".py") and os.path.isfile(os.path.join(directory, n))]
    return sorted(files)


def corpus_files(source: str) -> list[Path]:
    """The files behind `data.source`: 'stdlib', one file, or every file under a directory."""
    if source == "stdlib":
        files = stdlib_files()
    else:
        path = Path(source).expanduser()
        if path.is_file():
            files = [path]
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file())
        else:
            raise DataError(f"data.source '{source}' does not exist")
    if not files:
        raise DataError(f"data.source '{source}' contains no files")
    return files


def tokenize_files(files: list[Path], *, max_tokens: int = 0) -> np.ndarray:
    """Byte tokens of every file, each followed by EOD_TOKEN, as one uint16 array.

    Stops after `max_tokens` tokens when it is > 0.
    """
    parts: list[np.ndarray] = []
    total = 0
    eod = np.array([EOD_TOKEN], dtype=np.uint16)
    for path in files:
        data = path.read_bytes()
        if not data:
            continue
        parts += [np.frombuffer(data, dtype=np.uint8).astype(np.uint16), eod]
        total += len(data) + 1
        if max_tokens and total >= max_tokens:
            break
    if not parts:
        raise DataError("the corpus is empty: every file has 0 bytes")
    tokens = np.concatenate(parts)
    return tokens[:max_tokens] if max_tokens else tokens


def pack_sequences(tokens: np.ndarray, *, seq_len: int, seed: int) -> np.ndarray:
    """Cut the token stream into (N, seq_len + 1) rows (input + shifted target), rows shuffled by seed.

    The tail shorter than one row is dropped.
    """
    row = seq_len + 1
    num_rows = len(tokens) // row
    if num_rows == 0:
        raise DataError(f"the corpus has {len(tokens)} tokens, fewer than one sequence of {row}")
    rows = tokens[: num_rows * row].reshape(num_rows, row)
    order = np.random.default_rng(seed).permutation(num_rows)
    return rows[order]
