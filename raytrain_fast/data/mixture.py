"""Mixtures: several prepared datasets interleaved by weight into one global stream (data.sources).

docs/data.md ("Mixtures") describes the schedule and its bound. The source of global sequence g is
`pattern[g % period]`, a fixed schedule built once from the weights ("largest deficit first"), and it
is that source's `counts(g)[s]`-th sequence in its own endless stream of hash-shuffled epochs. So the
position is one integer, the sequences consumed by all ranks together, valid on any worker count.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from raytrain_fast.data.ingest import BatchIterator
from raytrain_fast.data.manifest import Manifest, shard_locations
from raytrain_fast.data.order import EpochOrder, locate_absolute, rank_indexes, usable_rows, window_rows
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig

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


@dataclass(kw_only=True)
class MixturePosition:
    """Where a mixture's global stream stands: `consumed` sequences taken by all ranks together."""

    consumed: int = 0
    sources: list[dict[str, Any]]
    """[{name, weight}] of the mixture the position belongs to (a resume must use the same)."""

    def to_dict(self) -> dict[str, Any]:
        return {"stream": MIXTURE_STREAM, "consumed": self.consumed, "sources": self.sources}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, sources: list[dict[str, Any]]) -> MixturePosition:
        """A saved position, checked against this run's mixture `sources` ([{name, weight}])."""
        if data.get("stream") != MIXTURE_STREAM:
            raise DataError(
                f"the checkpoint's data position {json.dumps(data)} belongs to a single data.source, but this run sets "
                "data.sources (a mixture): resume with the run's data.source, or start a new run (another --name)"
            )
        consumed = data.get("consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise DataError(f"mixture position must hold a non-negative integer 'consumed': {data}")
        if data.get("sources") != sources:
            raise DataError(
                f"the checkpoint was trained on the mixture {data.get('sources')} and this run sets {sources}: the "
                "mixture's position only continues the same sources and weights. Restore data.sources, or start a new run"
            )
        return cls(consumed=consumed, sources=sources)


@dataclass(kw_only=True)
class Source:
    """One source of a mixture as the ingest reads it."""

    name: str
    weight: float
    manifest: Manifest


def tokens_per_source(schedule: MixtureSchedule, *, consumed: int, seq_len: int, names: list[str]) -> dict[str, float]:
    """{'data/tokens/<name>': tokens of each source trained on so far} at a global position: plain
    arithmetic on the position and the weights (host-side, no device work), for the metrics record."""
    counts = schedule.counts(consumed)
    return {f"data/tokens/{name}": float(count * seq_len) for name, count in zip(names, counts.tolist())}


def mixture_rank_stream(
    source_rows: list[list[int]], schedule: MixtureSchedule, *, seed: int, consumed: int, rank: int, world_size: int,
    micro_batch: int, batches: int, first_batch: int = 0, orders: list[dict[int, EpochOrder]] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sources, shards, rows) of rank `rank`'s micro-batches first_batch .. first_batch + batches - 1
    after global position `consumed`, sliced as a single source's stream (order.rank_indexes). Pure: the
    ingest's plan, and what tests check. `source_rows`: usable rows of each shard, per source; `orders`:
    per-source EpochOrder caches."""
    orders = [{} for _ in source_rows] if orders is None else orders
    g = rank_indexes(
        consumed, rank=rank, world_size=world_size, micro_batch=micro_batch, batches=batches, first_batch=first_batch
    )
    sources, local = schedule.locate(g)
    shards, rows = np.empty_like(g), np.empty_like(g)
    for s in np.unique(sources).tolist():
        mask = sources == s
        _, _, shards[mask], rows[mask] = locate_absolute(source_rows[s], local[mask], seed=seed, orders=orders[s])
    return sources, shards, rows


class MixtureIterator(BatchIterator):
    """BatchIterator over a mixture: the same micro-batches, ranks, prefetch and checks, with global
    index g drawn from source `schedule.locate(g)`. seq_ids are each source's own.

    `position`: a MixturePosition (or its dict) of the same sources and weights, or None (the start).
    """

    def __init__(
        self, sources: list[Source], *, rank: int, world_size: int, micro_batch: int, seed: int = 0,
        prefetch_batches: int = 2, device: Any = "cpu", position: MixturePosition | dict[str, Any] | None = None,
        storage: StorageConfig | None = None,
    ) -> None:
        self._setup(rank, world_size, micro_batch, seed, prefetch_batches, device)
        problems = mixture_problems(sources)
        if problems:
            raise DataError("; ".join(problems))
        self.sources = sources
        self.schedule = MixtureSchedule([s.weight for s in sources])
        self.names = [s.name for s in sources]
        self.source_rows = [usable_rows(s.manifest) for s in sources]
        self.source_sizes = [sum(rows) for rows in self.source_rows]
        self.sequences_per_epoch = sum(self.source_sizes)
        """Sequences of all sources together (a mixture's positions carry no epoch: health arithmetic only)."""
        identity = [{"name": s.name, "weight": s.weight} for s in sources]  # what a saved position must match
        if isinstance(position, dict):
            position = MixturePosition.from_dict(position, sources=identity)
        self._start = position or MixturePosition(sources=identity)
        self._position = self._start
        self._filesystems, self._paths, self._first_seq_id = shard_locations([s.manifest for s in sources], storage)
        self._first_shard = np.cumsum([0] + [len(s.manifest.shards) for s in sources])[:-1]
        """Index into `_paths` of each source's first shard."""
        self._piece_batches = max(1, int(max(map(window_rows, self.source_rows))) // (micro_batch * world_size))
        self._batches_per_chunk = 2 * self._piece_batches
        self._orders: list[dict[int, EpochOrder]] = [{} for _ in sources]
        self._start_pipeline()

    @property
    def position(self) -> MixturePosition:
        return MixturePosition(consumed=self._position.consumed, sources=self._position.sources)

    @property
    def source_epochs(self) -> np.ndarray:
        """Epochs each source has gone through so far (1.5 = one whole pass and half of the next)."""
        return self.schedule.counts(self._position.consumed) / np.asarray(self.source_sizes, dtype=np.float64)

    @property
    def epochs(self) -> float:
        """The most-repeated source's epochs (what repetition warnings care about)."""
        return float(self.source_epochs.max())

    def source_metrics(self, *, seq_len: int) -> dict[str, float]:
        """Tokens and epochs per source at the current position: arithmetic on the position, no device work."""
        values = tokens_per_source(self.schedule, consumed=self._position.consumed, seq_len=seq_len, names=self.names)
        values.update({f"data/epochs/{name}": float(e) for name, e in zip(self.names, self.source_epochs.tolist())})
        return values

    def _position_after(self, batches: int) -> MixturePosition:
        consumed = self._start.consumed + batches * self.world_size * self.micro_batch
        return MixturePosition(consumed=consumed, sources=self._start.sources)

    def _plan(self, first_batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(shard index into `_paths`, row) of this rank's next micro-batches, cut into pieces of
        `_piece_batches` micro-batches each."""
        sources, shards, rows = mixture_rank_stream(
            self.source_rows, self.schedule, seed=self.seed, consumed=self._start.consumed, rank=self.rank,
            world_size=self.world_size, micro_batch=self.micro_batch, first_batch=first_batch,
            batches=self._batches_per_chunk, orders=self._orders,
        )
        per_piece = self._piece_batches * self.micro_batch
        return self._first_shard[sources] + shards, rows, np.arange(per_piece, len(rows), per_piece)


def load_sources(data: Any, storage: StorageConfig, *, prepared: list[str] | None = None) -> tuple[list[Source], list[str]]:
    """(the sources of `data.sources` whose manifests load, problems): a source missing from storage is
    a problem naming it. `prepared`: the manifest URIs `prepare_sources` returned (default: the sources as given)."""
    from raytrain_fast.config.data import source_name
    from raytrain_fast.data.ingest import load_manifest

    sources, problems = [], []
    for i, item in enumerate(data.sources):
        uri = prepared[i] if prepared else item.source
        try:
            manifest = load_manifest(uri, storage)
        except DataError as error:
            problems.append(
                f"data.sources[{i}] '{item.source}': {error} Fix the path (or bucket), or remove the source from data.sources"
            )
            continue
        sources.append(Source(name=source_name(item), weight=float(item.weight), manifest=manifest))
    return sources, problems


def prepare_sources(data: Any, storage: StorageConfig, *, cache_dir: str, verbose: bool = True) -> list[str]:
    """The manifest URI of every source (absolute for a local one), as data.source's: a prepared dataset
    as it is, anything else (text, JSONL, Parquet, compressed or not, `stdlib`) prepared once into cache_dir."""
    from raytrain_fast.data.cache import ensure_prepared_corpus

    return [
        ensure_prepared_corpus(
            item.source, seq_len=data.seq_len, cache_dir=cache_dir, tokenizer=data.tokenizer, storage=storage,
            verbose=verbose, val_fraction=data.val_fraction, val_input=data.val_input, text_field=data.text_field,
        )
        for item in data.sources
    ]


def check_mixture(config: Any, *, prepared: list[str] | None = None) -> list[Source]:
    """Every problem of a config's data.sources against storage and the model, raised as one
    ConfigError before any worker starts; returns the loaded sources.
    `prepared`: manifest URIs from prepare_sources (without it, text sources not yet prepared are skipped)."""
    from raytrain_fast.data.cache import STDLIB, is_prepared, text_problem
    from raytrain_fast.data.ingest import check_manifest_matches
    from raytrain_fast.errors import ConfigError

    data, storage = config.data, config.storage
    if prepared is None:  # before preparation: what is prepared already, and what is missing altogether
        items = [i for i in data.sources if i.source == STDLIB or not is_prepared(i.source, storage)]
        problems = [p for i in items if (p := text_problem(i.source, storage, setting="data.sources", remedy=", or remove it from data.sources"))]
        view = dataclasses.replace(data, sources=[i for i in data.sources if i not in items])
        sources, load_problems = load_sources(view, storage)
        if items and not problems:  # what they will be tokenized with, against the model and the prepared ones
            problems += _on_the_fly_problems(config, sources)
    else:
        problems, (sources, load_problems) = [], load_sources(data, storage, prepared=prepared)
    problems += load_problems + (mixture_problems(sources, seq_len=data.seq_len) if sources else [])
    for source in sources:  # the vocabulary; no micro-batch check: a source smaller than a batch just cycles
        problems += [
            f"data.sources '{source.name}': {p}"
            for p in check_manifest_matches(source.manifest, seq_len=source.manifest.seq_len, vocab_size=config.model.vocab_size)
        ]
    if problems:
        raise ConfigError(problems)
    return sources


def open_mixture(
    config: Any, uris: list[str], *, rank: int, world_size: int, device: Any, position: dict[str, Any] | None,
) -> MixtureIterator:
    """The step loop's reader for data.sources (what `build_data` returns for a mixture): `uris` are
    prepare_sources' manifest URIs, `position` the checkpoint's saved data position (None: the start)."""
    sources, problems = load_sources(config.data, config.storage, prepared=uris)
    if problems:
        raise DataError("; ".join(problems))
    return MixtureIterator(
        sources, rank=rank, world_size=world_size, micro_batch=int(config.train.micro_batch), seed=config.data.shuffle_seed,
        prefetch_batches=config.data.prefetch_batches, device=device, position=position, storage=config.storage,
    )


def _on_the_fly_problems(config: Any, prepared: list[Source]) -> list[str]:
    """The sources prepared on the fly are tokenized with data.tokenizer: its vocabulary against
    model.vocab_size, and against the tokenizer of the sources already prepared."""
    from raytrain_fast.data.tokenizer import load_tokenizer

    info = load_tokenizer(config.data.tokenizer, config.storage).info
    problems = []
    if info.vocab_size > config.model.vocab_size:
        problems.append(
            f"model.vocab_size ({config.model.vocab_size}) is smaller than data.tokenizer's vocabulary ({info.vocab_size} "
            f"tokens), which prepares the text sources of data.sources; set model.vocab_size >= {info.vocab_size} "
            f"(a multiple of 64 is fastest: {-(-info.vocab_size // 64) * 64})"
        )
    different = [s for s in prepared if s.manifest.tokenizer.identity() != info.identity()]
    if different:
        problems.append(
            f"data.sources '{different[0].name}' was tokenized with {different[0].manifest.tokenizer.name}, but the text "
            f"sources would be tokenized with data.tokenizer={config.data.tokenizer}: a mixture needs one tokenizer; set "
            f"data.tokenizer={different[0].manifest.tokenizer.name}, or prepare every source with the same --tokenizer"
        )
    return problems


def mixture_problems(sources: list[Source], *, seq_len: int | None = None) -> list[str]:
    """Problems that make these prepared sources unusable together (empty list = fine): an empty
    source, another tokenizer or seq_len than the first source's."""
    problems = []
    if not sources:
        return ["data.sources is empty"]
    first = sources[0]
    for source in sources:
        manifest, where = source.manifest, f"data.sources '{source.name}' ({source.manifest.root})"
        if sum(usable_rows(manifest)) == 0:
            problems.append(f"{where} holds no training sequences: prepare it from a non-empty input, or remove it from data.sources")
        if manifest.tokenizer.identity() != first.manifest.tokenizer.identity():
            problems.append(
                f"{where} was tokenized with {manifest.tokenizer.name} but '{first.name}' with {first.manifest.tokenizer.name}: "
                "a mixture needs one tokenizer; prepare every source with the same --tokenizer"
            )
        if seq_len is not None and manifest.seq_len != seq_len:
            problems.append(
                f"{where} was prepared with seq_len {manifest.seq_len} but data.seq_len is {seq_len}: prepare every "
                f"source with --seq-len {seq_len} (or set data.seq_len to match all of them)"
            )
        elif manifest.seq_len != first.manifest.seq_len:
            problems.append(
                f"{where} was prepared with seq_len {manifest.seq_len} but '{first.name}' with {first.manifest.seq_len}: "
                "prepare every source with the same --seq-len"
            )
    return problems
