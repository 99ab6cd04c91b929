"""The default corpus and the byte tokenizer's constants.

The default corpus is the source of the running Python's standard library: real text that every
machine has, so the first run needs no download. Byte tokens are 0-255 plus an end-of-document
token (256) after every document.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

from raytrain_fast.config.data import BYTE_VOCAB_SIZE, EOD_TOKEN  # noqa: F401 - re-exported


MANY_EPOCHS = 4.0
"""Epochs of one corpus beyond which a run is warned at start, and its report says so: the model
memorises a small corpus (an 11 KB file seen ~53 times reached loss 0.40 and learned nothing general)."""


def repetition_warning(*, sequences_per_epoch: int, steps: int, global_batch: int, share: float = 1.0) -> str | None:
    """The start-of-run warning when train.steps would go through the corpus more than MANY_EPOCHS
    times. `share`: the corpus's weight in a mixture."""
    if sequences_per_epoch <= 0:
        return None
    epochs = steps * global_batch * share / sequences_per_epoch
    if epochs <= MANY_EPOCHS:
        return None
    weight = f" x its weight {share:.0%}" if share < 1 else ""
    return (
        f"Warning: train.steps={steps:,} x train.global_batch={global_batch:,}{weight} goes through this corpus's "
        f"{sequences_per_epoch:,} sequences {epochs:,.0f} times: the model will memorise it, and a low loss "
        "will not mean it learned anything general. Use more data (data.source), fewer steps, or keep an "
        "evaluation split to watch val/loss."
    )


def stdlib_files() -> list[Path]:
    """The .py files of this interpreter's standard library, site-packages excluded, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    # os.walk that never enters site-packages: Path.rglob would walk every installed package first (~40x slower).
    for directory, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d != "site-packages"]
        files += [Path(directory, n) for n in names if n.endswith(".py") and os.path.isfile(os.path.join(directory, n))]
    return sorted(files)
