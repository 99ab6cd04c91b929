from __future__ import annotations

import math
from dataclasses import dataclass, field

EOD_TOKEN = 256
BYTE_VOCAB_SIZE = 257
"""The byte tokenizer's vocabulary: 256 byte values and the end-of-document token (here, with the
data section, so that validating a config needs nothing else of the data package)."""


@dataclass(kw_only=True)
class SourceConfig:
    """One source of a mixture (an item of data.sources)."""

    source: str = ""
    """Anything data.source takes: a prepared dataset (directory or s3:// URI holding manifest.json), or
    text, JSONL or Parquet (gzip/zstd too: file, directory, glob, `stdlib`) prepared on the fly like data.source."""
    weight: float = 1.0
    """This source's share of the training stream, relative to the others' (> 0; normalised to sum 1)."""
    name: str | None = None
    """Name in metrics (data/tokens/<name>, val/loss/<name>) and the report; null = the source's last path part."""


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
    text_field: str = "text"
    """The JSONL field or Parquet column that holds the text, for a source prepared on the fly
    (prepare-data's --text-field); several names, comma-separated (content,text), take the first each
    record or file has."""
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
    """Groups of 8 micro-batches ready ahead of the step loop (each group is one Ray Data batch, handed over at once)."""
    shuffle_seed: int = 0
    """Seed of the per-epoch shard order (and so of which sequences each worker sees)."""
    document_masking: bool = False
    """on (true): attention stays inside each document of a packed row (block-causal), positions restart
    at each document's start, and the loss after an end-of-document id follows `mask_loss_after_eod`.
    off (false): rows attend across document boundaries, as packed. Costs little on the CPU and is off by
    default: docs/data.md#document-masking has the measured cost and what each device runs."""
    mask_loss_after_eod: bool = True
    """With document_masking on: no loss on the target after an end-of-document id (the next document's
    first token, which the masked model cannot see coming: Megatron's --eod-mask-loss). false keeps it."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A mixture instead of data.source: a list of {source, weight, name}, e.g. web 0.7, code 0.2, papers 0.1.
    A source is anything data.source takes (prepared, or prepared on the fly). Every source must share the
    tokenizer and seq_len; the stream interleaves them by weight (docs/data.md#mixtures)."""


def data_sources(d: DataConfig) -> list[SourceConfig]:
    """The run's sources: data.sources, or data.source as a mixture of one (weight 1)."""
    return d.sources or [SourceConfig(source=d.source)]


def source_name(item: SourceConfig) -> str:
    """A source's name: its own, or the last part of its path (`stdlib` for the standard library)."""
    return item.name or item.source.rstrip("/").rsplit("/", 1)[-1] or item.source


def data_sources_problems(d: DataConfig) -> list[str]:
    """data.sources' own problems (no storage read): weights, empty entries, names, keys that do not apply."""
    problems = []
    for i, item in enumerate(d.sources):
        weight = item.weight
        if isinstance(weight, (int, float)) and not isinstance(weight, bool) and not (math.isfinite(weight) and weight > 0):
            problems.append(
                f"data.sources[{i}].weight must be a number > 0, got {weight}: give every source a positive share "
                "(weights are relative: 0.7, 0.2, 0.1 or 7, 2, 1), or remove the source"
            )
        if not item.source:
            problems.append(f"data.sources[{i}].source is empty: give a prepared dataset (directory or s3:// URI) or text to prepare")
    names = [source_name(item) for item in d.sources]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"data.sources: {names.count(name)} sources are named '{name}'; give each a distinct `name`")
    if d.sources and d.max_tokens:
        problems.append("data.max_tokens applies to a single data.source; with data.sources set it to 0 (weights set each source's share)")
    return problems


def document_masking_problems(d: DataConfig, *, dropout: float, use_gpu: bool | str, cluster_gpus: float | None) -> list[str]:
    """data.document_masking on a device whose kernel cannot do it (on a GPU it runs flex attention,
    which has no dropout; the CPU's SDPA path has), or its loss rule without it. `use_gpu` auto counts
    as a GPU when the cluster has one."""
    gpu = use_gpu is True or (use_gpu == "auto" and bool(cluster_gpus))
    if d.document_masking and gpu and dropout > 0:
        return [
            f"data.document_masking on a GPU uses flex attention, which has no dropout, but model.dropout is {dropout}; "
            "set model.dropout=0 (pretraining's usual value) or data.document_masking=false"
        ]
    if not d.document_masking and not d.mask_loss_after_eod:
        return ["data.mask_loss_after_eod applies only with data.document_masking on; set data.document_masking=true or leave it out"]
    return []
