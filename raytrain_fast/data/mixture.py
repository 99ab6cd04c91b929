"""A run's training data: its sources (data.sources, or data.source as a mixture of one of weight 1)
interleaved by weight into one global stream.

docs/data.md ("Mixtures") describes the schedule and its bound. The source of global sequence g is
`pattern[(g - start) % period]`, a fixed schedule built once from the weights ("largest deficit
first"), and it is that source's `before[s] + counts(g - start)[s]`-th sequence in its own endless
stream of hash-shuffled epochs (data/order.py). So the position is one integer, the sequences consumed
by all ranks together, valid on any worker count. A resume with other weights or sources
(checkpoint.allow_changes=data) starts a new schedule at the resume position (`start`), each source
going on from the sequences it had given (`before`): the accounting stays exact.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from raytrain_fast.config.data import data_sources, source_name
from raytrain_fast.data.manifest import Manifest, check_manifest_matches, load_manifest
from raytrain_fast.data.order import EpochOrder, locate_absolute, rank_indexes, usable_rows
from raytrain_fast.errors import ConfigError, DataError

logger = logging.getLogger("raytrain_fast")

MIXTURE_STREAM = "mixture-v1"
MAX_PERIOD = 100_000
"""Longest schedule period; weights that need a longer one are rounded to shares of this many sequences."""


class MixtureSchedule:
    """Which source each global sequence index comes from: a pure function of the index and the weights."""

    def __init__(self, weights: list[float]) -> None:
        if not weights or any(not (isinstance(w, (int, float)) and math.isfinite(w) and w > 0) for w in weights):
            raise DataError(f"mixture weights must be numbers > 0, got {weights}")
        self.counts_per_period, self.period = _integer_shares(weights)
        self.pattern, self.prefix = _largest_deficit_pattern(self.counts_per_period, self.period)
        shares = np.asarray(self.counts_per_period, dtype=np.float64) / self.period
        self.weights = shares
        """The realised weights (normalised; equal to the configured ones unless MAX_PERIOD rounded them)."""
        steps = np.arange(self.period + 1, dtype=np.float64)[:, None]
        self.max_deviation = float(np.abs(self.prefix - steps * shares[None, :]).max())
        """Largest |sequences of source s among the first g - g * w_s| over all g (< 1 in practice): any
        window of G consecutive sequences holds G * w_s +- 2 x this many sequences of source s."""

    def counts(self, g: int | np.ndarray) -> np.ndarray:
        """Sequences of each source among the first g of the stream: (S,) for an int, (n, S) for an array."""
        g = np.asarray(g, dtype=np.int64)
        whole, part = np.divmod(g, self.period)
        return whole[..., None] * np.asarray(self.counts_per_period, dtype=np.int64) + self.prefix[part]

    def locate(self, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, index in that source's own endless stream) of global indexes g."""
        g = np.asarray(g, dtype=np.int64)
        sources = self.pattern[g % self.period]
        before = self.counts(g)
        return sources, np.take_along_axis(before, sources[:, None], axis=1)[:, 0]


def _integer_shares(weights: list[float]) -> tuple[list[int], int]:
    """(counts per period, period): exact for decimal weights when the period stays <= MAX_PERIOD."""
    exact = [Fraction(str(w)) for w in weights]  # str: 0.7 is 7/10, not the binary float's 2^-53 fraction
    total = sum(exact)
    shares = [w / total for w in exact]
    period = math.lcm(*(s.denominator for s in shares))
    if period <= MAX_PERIOD:
        return [int(s * period) for s in shares], period
    quotas = [float(s) * MAX_PERIOD for s in shares]  # largest remainder
    counts = [int(q) for q in quotas]
    for i in sorted(range(len(quotas)), key=lambda i: counts[i] - quotas[i])[: MAX_PERIOD - sum(counts)]:
        counts[i] += 1
    if min(counts) == 0:
        raise DataError(f"a mixture weight is below 1/{MAX_PERIOD} of the total ({weights}); raise it or drop the source")
    return counts, MAX_PERIOD


def _largest_deficit_pattern(counts: list[int], period: int) -> tuple[np.ndarray, np.ndarray]:
    """(pattern (period,), prefix counts (period + 1, S)): each slot to the source furthest behind its
    share after that slot, ties to the first source. Integer arithmetic: deficit x period."""
    taken = [0] * len(counts)
    pattern = np.empty(period, dtype=np.int64)
    prefix = np.zeros((period + 1, len(counts)), dtype=np.int64)
    for t in range(period):
        best = max(range(len(counts)), key=lambda i: ((t + 1) * counts[i] - period * taken[i], -i))
        taken[best] += 1
        pattern[t] = best
        prefix[t + 1] = taken
    assert taken == counts, "a period must hold each source's exact count"
    return pattern, prefix


@dataclass(frozen=True, kw_only=True)
class MixturePosition:
    """Where the global stream stands: `consumed` sequences taken by all ranks together."""

    consumed: int = 0
    sources: list[dict[str, Any]]
    """[{name, weight}] of the mixture from `start` on."""
    start: int = 0
    """The global index from which these sources and weights hold (0: from the run's start)."""
    before: dict[str, int] = field(default_factory=dict)
    """Sequences each source had given before `start` (sources no longer in the mixture too)."""

    def to_dict(self) -> dict[str, Any]:
        changed = {"start": self.start, "before": self.before} if self.start else {}
        return {"stream": MIXTURE_STREAM, "consumed": self.consumed, "sources": self.sources, **changed}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, first: dict[str, Any], first_rows: int) -> MixturePosition:
        """A saved position. A single-source one ({epoch, consumed}: `_single_source_index`) is a place
        in the stream of `first` ({name, weight}: this run's first source, of `first_rows` sequences per
        epoch), which that stream was."""
        if data.get("stream") != MIXTURE_STREAM:
            return cls(consumed=_single_source_index(data, first_rows), sources=[{"name": first["name"], "weight": 1.0}])
        consumed, start, before = data.get("consumed"), data.get("start", 0), data.get("before", {})
        if not (isinstance(consumed, int) and isinstance(start, int) and 0 <= start <= consumed and isinstance(before, dict)):
            raise DataError(f"mixture position must hold integers 0 <= start <= consumed: {data}")
        return cls(consumed=consumed, sources=list(data["sources"]), start=start, before=dict(before))

    def continued(self, sources: list[dict[str, Any]]) -> MixturePosition:
        """This position in a mixture of `sources` ([{name, weight}]): itself for the same ones, else a
        new schedule from here on, each source going on from the sequences it gave so far."""
        if sources == self.sources:
            return self
        given = dict(self.before)
        schedule = MixtureSchedule([item["weight"] for item in self.sources])
        for item, count in zip(self.sources, schedule.counts(self.consumed - self.start).tolist()):
            given[item["name"]] = given.get(item["name"], 0) + count
        return MixturePosition(consumed=self.consumed, sources=sources, start=self.consumed, before=given)


def _single_source_index(data: dict[str, Any], rows: int) -> int:
    """The global index of a single-source position, as checkpoints without a mixture position hold
    it: {epoch, consumed, stream: sequence-shuffle-v1}, or, of the per-rank shard stream, {epoch,
    consumed per rank, world_size}, whose epoch goes on at the same share in a new order (sequences may
    repeat or be skipped until the next epoch)."""
    epoch, consumed, stream = data.get("epoch", 0), data.get("consumed", 0), data.get("stream")
    valid = isinstance(epoch, int) and isinstance(consumed, int) and min(epoch, consumed) >= 0
    if not valid or set(data) - {"epoch", "consumed", "world_size", "stream"} or stream not in (None, "sequence-shuffle-v1"):
        raise DataError(f"not a data position this version reads (a mixture's, or a single source's): {data}")
    if stream is None:
        consumed *= int(data.get("world_size") or 1)
        logger.warning("this checkpoint's data position is of the per-rank shard stream: epoch %d goes on at "
                       "the same share, in a new order (later epochs are exact)", epoch)
    return epoch * rows + min(consumed, rows)


@dataclass(kw_only=True)
class Source:
    """One source of the run's data as the ingest reads it."""

    name: str
    weight: float
    manifest: Manifest
    max_sequences: int | None = None
    """Sequences of it to use at most (data.max_tokens); None: all."""

    @property
    def num_sequences(self) -> int:
        """Its training sequences that are used: one pass of its stream."""
        return sum(usable_rows(self.manifest, self.max_sequences))


def identity(sources: list[Source]) -> list[dict[str, Any]]:
    """[{name, weight}]: what a saved position records of the mixture it belongs to."""
    return [{"name": s.name, "weight": s.weight} for s in sources]


def mixture_rank_stream(
    source_rows: list[list[int]], schedule: MixtureSchedule, *, seed: int, position: MixturePosition, rank: int,
    world_size: int, micro_batch: int, batches: int, first_batch: int = 0, orders: list[dict[int, EpochOrder]] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(sources, shards, rows, windows) of rank `rank`'s micro-batches first_batch .. first_batch + batches - 1
    after `position` (its sources are `schedule`'s), sliced as order.rank_indexes slices one stream. Pure: the
    ingest's plan, and what tests check. `source_rows`: usable rows of each shard, per source; `orders`:
    per-source EpochOrder caches. `windows`: each sequence's (epoch, shuffle window) of its source, as one number."""
    orders = [{} for _ in source_rows] if orders is None else orders
    g = rank_indexes(
        position.consumed, rank=rank, world_size=world_size, micro_batch=micro_batch, batches=batches, first_batch=first_batch
    )
    sources, local = schedule.locate(g - position.start)
    local += np.asarray([position.before.get(item["name"], 0) for item in position.sources], dtype=np.int64)[sources]
    shards, rows, windows = np.empty_like(g), np.empty_like(g), np.empty_like(g)
    for s in np.unique(sources).tolist():
        mask = sources == s
        epochs, window, shards[mask], rows[mask] = locate_absolute(source_rows[s], local[mask], seed=seed, orders=orders[s])
        windows[mask] = epochs * (1 << 32) + window
    return sources, shards, rows, windows


def window_cuts(sources: np.ndarray, windows: np.ndarray) -> np.ndarray:
    """Where to cut a plan into read pieces: wherever a source moves on to its next shuffle window, so
    that a piece reads each window's shards once (a single source's pieces are its windows)."""
    by_source = np.argsort(sources, kind="stable")
    moved = (np.diff(windows[by_source]) != 0) & (np.diff(sources[by_source]) == 0)
    return np.unique(by_source[1:][moved])


def prepare_sources(config: Any, *, cache_dir: str, verbose: bool = True) -> list[str]:
    """The manifest URI of every source of the run (absolute for a local one): a prepared dataset as it is,
    anything else (text, JSONL, Parquet, compressed or not, `stdlib`) prepared once into cache_dir."""
    from raytrain_fast.data.cache import ensure_prepared_corpus

    data = config.data
    return [
        ensure_prepared_corpus(
            item.source, seq_len=data.seq_len, cache_dir=cache_dir, tokenizer=data.tokenizer, storage=config.storage,
            verbose=verbose, val_fraction=data.val_fraction, val_input=data.val_input, text_field=data.text_field,
        )
        for item in data_sources(data)
    ]


def load_sources(
    config: Any, uris: list[str], *, skip: Sequence[int] = (), loaded: Sequence[Source] = ()
) -> tuple[list[Source], list[str]]:
    """(the run's sources whose manifests load, problems): `uris` are their manifests', in order; the
    indexes in `skip` are left out, and a manifest in `loaded` is not read again."""
    data, known = config.data, {s.manifest.root: s.manifest for s in loaded}
    max_sequences = max(1, data.max_tokens // (data.seq_len + 1)) if data.max_tokens > 0 else None
    sources, problems = [], []
    for i, (item, uri) in enumerate(zip(data_sources(data), uris)):
        if i in skip:
            continue
        try:
            manifest = known.get(uri.rstrip("/")) or load_manifest(uri, config.storage)
        except DataError as error:
            key, remove = _named(config)
            problems.append(f"{key} '{item.source}': {error} Fix the path (or bucket){remove}")
            continue
        sources.append(Source(name=source_name(item), weight=float(item.weight), manifest=manifest, max_sequences=max_sequences))
    return sources, problems


def _named(config: Any) -> tuple[str, str]:
    """How a message names a source (the key the user set: data.source, or data.sources of a mixture),
    and the other fix a mixture has."""
    return ("data.sources", ", or remove it from data.sources") if config.data.sources else ("data.source", "")


def check_sources(config: Any, *, prepared: list[str] | None = None, loaded: Sequence[Source] = ()) -> list[Source]:
    """Every problem of the run's sources against storage and the model, raised as one ConfigError
    before any worker starts; returns the sources whose manifests loaded. Without `prepared` (before
    preparation), a source still to prepare is checked as text: it exists and holds some, and the
    tokenizer that will prepare it suits the model and the other sources. `prepared`: the manifest
    URIs of prepare_sources (then every source loads); `loaded`: sources whose manifests were read."""
    from raytrain_fast.data.cache import STDLIB, is_prepared, text_problem

    data, storage = config.data, config.storage
    items = data_sources(data)
    pending = [] if prepared else [i for i, item in enumerate(items) if item.source == STDLIB or not is_prepared(item.source, storage)]
    setting, remove = _named(config)
    problems = [problem for i in pending if (problem := text_problem(items[i].source, storage, setting=setting, remedy=remove))]
    sources, load_problems = load_sources(config, prepared or [item.source for item in items], skip=pending, loaded=loaded)
    if pending and not problems:
        problems += _on_the_fly_problems(config, sources)
    elif prepared is None and sources and not problems:  # every source prepared: their manifests name the tokenizer
        others = " (and the other sources)" if len(sources) > 1 else ""
        problems += init_from_tokenizer_problems(config, sources[0].manifest.tokenizer, fix=(
            f"prepare {sources[0].manifest.root}{others} again with `raytrain-fast prepare-data --tokenizer {config.checkpoint.init_from}`"))
    if prepared is None and not pending:
        problems += [
            f"data.{key} applies to a source prepared on the fly, but every source is prepared already: run "
            f"`raytrain-fast prepare-data` again with --{key.replace('_', '-')}, or leave data.{key} unset"
            for key in ("val_fraction", "val_input") if getattr(data, key) is not None
        ]
    problems += load_problems + mixture_problems(sources)
    for source in sources:
        problems += check_manifest_matches(source.manifest, seq_len=data.seq_len, vocab_size=config.model.vocab_size)
    if problems:
        raise ConfigError(problems)
    return sources


def _on_the_fly_problems(config: Any, prepared: list[Source]) -> list[str]:
    """A source prepared on the fly is tokenized with data.tokenizer: its vocabulary against
    model.vocab_size, against the tokenizer of the sources already prepared, and against a Hugging
    Face checkpoint.init_from's own tokenizer."""
    from raytrain_fast.data.tokenizer import load_tokenizer

    info = load_tokenizer(config.data.tokenizer, config.storage).info
    problems = []
    if info.vocab_size > config.model.vocab_size:
        problems.append(
            f"model.vocab_size ({config.model.vocab_size}) is smaller than data.tokenizer's vocabulary ({info.vocab_size} "
            f"tokens); set model.vocab_size >= {info.vocab_size} (a multiple of 64 is fastest: {-(-info.vocab_size // 64) * 64})"
        )
    different = [s for s in prepared if s.manifest.tokenizer.identity() != info.identity()]
    if different:
        problems.append(
            f"data source '{different[0].name}' was tokenized with {different[0].manifest.tokenizer.name}, but the text "
            f"sources would be tokenized with data.tokenizer={config.data.tokenizer}: a mixture needs one tokenizer; set "
            f"data.tokenizer={different[0].manifest.tokenizer.name}, or prepare every source with the same --tokenizer"
        )
    return problems + init_from_tokenizer_problems(config, info, fix=f"set data.tokenizer={config.checkpoint.init_from}")


def init_from_tokenizer_problems(config: Any, ours: Any, *, fix: str) -> list[str]:
    """The run's data tokenizer (`ours`, a TokenizerInfo: the one its prepared sources were made with,
    or data.tokenizer for text prepared on the fly, as check_sources settles it)
    against the tokenizer.json of a Hugging Face checkpoint.init_from: the model's ids mean that
    tokenizer's text. [] when they are the same, or when init_from holds no tokenizer.json (weights
    only: the run's tokenizer is the user's choice). `fix` ends the message."""
    from raytrain_fast.data.tokenizer import TOKENIZER_FILE
    from raytrain_fast.storage import resolve_filesystem

    uri = config.checkpoint.init_from
    if not uri:
        return []
    filesystem, path = resolve_filesystem(uri, config.storage)
    try:
        with filesystem.open_input_stream(f"{path.rstrip('/')}/{TOKENIZER_FILE}") as stream:
            theirs = hashlib.sha256(stream.read()).hexdigest()
    except (FileNotFoundError, OSError):
        return []
    if ours.hash == theirs:
        return []
    return [f"checkpoint.init_from={uri} comes with its own tokenizer ({TOKENIZER_FILE}), but this run's data is tokenized "
            f"with {ours.name}, whose ids mean other text to the model: {fix}"]


def mixture_problems(sources: list[Source]) -> list[str]:
    """Problems that make these prepared sources unusable together (empty list = fine): an empty
    source, another tokenizer than the first source's."""
    problems = []
    for source in sources:
        manifest, where = source.manifest, f"data source '{source.name}' ({source.manifest.root})"
        if source.num_sequences == 0:
            problems.append(f"{where} holds no training sequences: prepare it from a non-empty input")
        if manifest.tokenizer.identity() != (first := sources[0]).manifest.tokenizer.identity():
            problems.append(
                f"{where} was tokenized with {manifest.tokenizer.name} but '{first.name}' with {first.manifest.tokenizer.name}: "
                "a mixture needs one tokenizer; prepare every source with the same --tokenizer"
            )
    return problems
