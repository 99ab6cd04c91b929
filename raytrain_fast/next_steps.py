"""The next-step commands the command line prints after `prepare-data` and `train-tokenizer`, built
to run as printed: quoted for a shell, and with every setting the data needs against the preset it
will train (model.vocab_size for a tokenizer's vocabulary, model.max_seq_len for a longer window).
tests/test_printed_commands.py runs them as printed."""

from __future__ import annotations

import shlex

from raytrain_fast.config import load_config
from raytrain_fast.config.root import DEFAULT_PRESET
from raytrain_fast.data.readers import DEFAULT_TEXT_FIELD

VOCAB_MULTIPLE = 64
"""model.vocab_size is padded to a multiple of this (the fastest output-layer shapes)."""


def model_vocab_size(tokenizer_vocab_size: int) -> int:
    """The smallest multiple of VOCAB_MULTIPLE that holds every token id."""
    return -(-tokenizer_vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def run_name_for(output: str) -> str:
    """A run name of its own for a prepared dataset (under an existing run's name the command would
    resume that run, and be refused, since its data differs)."""
    base = output.rstrip("/").rsplit("/", 1)[-1]
    name = "".join(c if c.isalnum() or c in "._-" else "-" for c in base).strip("-.") or "data"
    return f"{name}-run"


def train_command(*, data: str, seq_len: int, vocab_size: int, num_sequences: int | None = None,
                  storage: dict[str, str | None] | None = None) -> str:
    """`raytrain-fast pretrain ...` on prepared data (`data`, its `seq_len`, tokenizer vocabulary and
    training sequences): the default preset's model with what the data needs changed (a smaller micro-batch
    for fewer sequences than one per worker), under a run name of its own. `storage`: the S3 settings
    (endpoint_url, region, profile) the data was written with, for data in a bucket."""
    config = load_config(DEFAULT_PRESET)
    model, train, workers = config.model, config.train, config.resources.num_workers
    sets = [f"data.source={data}", f"data.seq_len={seq_len}"]
    per_worker = (num_sequences or 0) // workers if isinstance(workers, int) else 0
    if isinstance(train.micro_batch, int) and 0 < per_worker < train.micro_batch:
        # the largest micro-batch the corpus fills that divides the global batch (accumulation makes up the rest)
        fits = max(m for m in range(1, per_worker + 1) if train.global_batch % (m * workers) == 0)
        sets.append(f"train.micro_batch={fits}")
    if data.startswith("s3://"):
        sets += [f"storage.{key}={value}" for key, value in (storage or {}).items() if value]
    if model_vocab_size(vocab_size) > model.vocab_size:
        sets.append(f"model.vocab_size={model_vocab_size(vocab_size)}")
    if seq_len > model.max_seq_len:
        sets.append(f"model.max_seq_len={seq_len}")
    return shlex.join(["raytrain-fast", "pretrain", "--name", run_name_for(data), *(word for s in sets for word in ("--set", s))])


def prepare_command(*, inputs: list[str], output: str, tokenizer: str, text_field: str = DEFAULT_TEXT_FIELD) -> str:
    """`raytrain-fast prepare-data ...` of `inputs` with a trained tokenizer, at the default preset's window."""
    seq_len = load_config(DEFAULT_PRESET).data.seq_len
    words = ["raytrain-fast", "prepare-data", "--input", *inputs, "--output", output, "--seq-len", str(seq_len),
             "--tokenizer", tokenizer]
    if text_field != DEFAULT_TEXT_FIELD:
        words += ["--text-field", text_field]
    return shlex.join(words)
