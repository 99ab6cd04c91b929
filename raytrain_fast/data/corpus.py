"""The default corpus and the byte tokenizer's constants.

The default corpus is the source of the running Python's standard library: real text that every
machine has, so the first run needs no download. Byte tokens are 0-255 plus an end-of-document
token (256) after every document.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from raytrain_fast.data.config import BYTE_VOCAB_SIZE, EOD_TOKEN  # noqa: F401 - re-exported


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library, site-packages excluded, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    # os.walk that never enters site-packages: Path.rglob would walk every installed package first (~40x slower).
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        files += [Path(directory, n) for n in names if n.endswith(".py") and os.path.isfile(os.path.join(directory, n))]
    return sorted(files)
