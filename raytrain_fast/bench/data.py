"""`raytrain-fast bench data`: is the data pipeline ever the bottleneck? (docs/benchmarks.md#data-wait)

The tiny GPT trains on three batch sources, interleaved in rounds so a busy machine slows all alike:
`ingest` (`BatchIterator`), `baseline` (a DataLoader(num_workers=0) over the same Parquet shards) and
`mixture` (the ingest over three sources, each the same corpus read as its own stream). Per step it
records the host time blocked in `next()` (data wait) and the whole step; warm-up steps are excluded.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from raytrain_fast.console import say

DEFAULT_CACHE_DIR = "~/.cache/raytrain_fast/data"
MIXTURE_WEIGHTS = {"a": 0.7, "b": 0.2, "c": 0.1}
"""The `mixture` variant's three sources and weights."""


def _parquet_loader(manifest, *, micro_batch: int, seed: int):
    """The baseline: a DataLoader over the shards (rows yielded one by one, default collate)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from raytrain_fast.data.order import shard_order
    from raytrain_fast.storage import StorageConfig, resolve_filesystem

    filesystem, root = resolve_filesystem(manifest.root, StorageConfig())
    paths = [f"{root}/{shard.path}" for shard in manifest.shards]

    class ParquetRows(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[torch.Tensor]:
            epoch = 0
            while True:
                for index in shard_order(len(paths), seed=seed, epoch=epoch):
                    table = pq.read_table(paths[index], filesystem=filesystem, columns=["tokens"])
                    rows = np.stack(table.column("tokens").to_numpy(zero_copy_only=False)).astype(np.int64)
                    for row in rows:
                        yield torch.from_numpy(row)
                epoch += 1

    return iter(torch.utils.data.DataLoader(ParquetRows(), batch_size=micro_batch, num_workers=0, drop_last=True))


class _Trainer:
    """One model + optimizer fed by one batch source, stepped by engine/step.py's `train_step` on a
    plain PyTorch engine; times every step."""

    def __init__(self, batches: Iterator, *, model_config, seed: int) -> None:
        import torch

        from raytrain_fast.engine.step import TorchEngine
        from raytrain_fast.model import GPT

        torch.manual_seed(seed)
        model = GPT(model_config)
        self.engine = TorchEngine(model, torch.optim.AdamW(model.parameters(), lr=3e-4), precision="fp32")
        self.batches = batches  # the source: closed, and a mixture's position read, by the bench
        self._pairs = (batch if isinstance(batch, tuple) else (batch, None) for batch in batches)
        self.clock = _StepClock()
        self.waits: list[float] = []
        self.steps: list[float] = []

    def run(self, num_steps: int, *, record: bool) -> None:
        from raytrain_fast.engine.step import train_step

        for _ in range(num_steps):
            train_step(self.engine, self._pairs, grad_accum=1, metrics=self.clock)
            if record:  # CPU: the step is done when the host returns (no async device)
                self.waits.append(self.clock.data_wait_s)
                self.steps.append(self.clock.step_s)

    def summary(self, tokens_per_step: int) -> dict[str, float]:
        total = sum(self.steps)
        waits_ms = sorted(w * 1000 for w in self.waits)
        return {
            "data_wait_frac": sum(self.waits) / total,
            "tokens_per_sec": tokens_per_step * len(self.steps) / total,
            "step_time_s_median": statistics.median(self.steps),
            "data_wait_ms_median": statistics.median(waits_ms),
            "data_wait_ms_p95": waits_ms[int(0.95 * (len(waits_ms) - 1))],
            "data_wait_ms_max": waits_ms[-1],
        }


class _StepClock:
    """The host clock around one step's phases (a `train_step` recorder): the wait in `next()` and the whole step."""

    def begin_step(self) -> None:
        self.started = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        if phase == "data":
            self.data_wait_s = now - self.started
        self.step_s = now - self.started

    def add_loss(self, loss: Any) -> None:
        pass

    def add_grad_norm(self, grad_norm: Any) -> None:
        pass


def _run_rounds(trainers: dict[str, _Trainer], *, steps: int, warmup_steps: int, rounds: int, verbose: bool) -> int:
    """Warm every trainer up, then run them in turns (order reversed every other round) so that a
    busy machine slows each alike. Returns the steps measured per trainer and round."""
    for trainer in trainers.values():
        trainer.run(warmup_steps, record=False)  # first batches (worker start-up), allocator warm-up
    per_round = max(1, steps // rounds)
    for index in range(rounds):
        order = list(trainers) if index % 2 == 0 else list(reversed(trainers))
        for name in order:
            trainers[name].run(per_round, record=True)
        if verbose:
            say(f"bench data: round {index + 1}/{rounds} done", stderr=True)
    return per_round


def bench_data(
    *,
    steps: int = 300,
    warmup_steps: int = 20,
    rounds: int = 3,
    micro_batch: int = 16,
    seq_len: int = 128,
    prefetch_batches: int = 2,
    seed: int = 0,
    cache_dir: str = DEFAULT_CACHE_DIR,
    source: str = "stdlib",
    verbose: bool = True,
) -> dict[str, Any]:
    """Data wait and tokens/s of the ingest path against a plain DataLoader (see the module docstring).

    Prepares `source` (default: the stdlib corpus) into `cache_dir` on first use (timed as
    `prepare_s`). Uses the running Ray instance, else starts a local one for the duration.
    """
    import ray
    import torch

    from raytrain_fast.data import ensure_prepared_corpus, load_manifest

    threads = min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    started = time.perf_counter()
    uri = ensure_prepared_corpus(source, seq_len=seq_len, cache_dir=cache_dir, verbose=verbose)
    prepare_s = time.perf_counter() - started
    manifest = load_manifest(uri)

    own_ray = not ray.is_initialized()
    if own_ray:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, configure_logging=False, log_to_driver=False)
    trainers = _trainers(manifest, micro_batch=micro_batch, seq_len=seq_len, seed=seed, prefetch_batches=prefetch_batches)
    try:
        per_round = _run_rounds(trainers, steps=steps, warmup_steps=warmup_steps, rounds=rounds, verbose=verbose)
    finally:
        for trainer in trainers.values():
            getattr(trainer.batches, "close", lambda: None)()  # the ingest paths' producer threads and pipelines
        if own_ray:
            from raytrain_fast._ray_compat import wait_for_ray_data_iterators

            wait_for_ray_data_iterators()  # `bench data` from a shell exited 1 with no output without it
            ray.shutdown()

    tokens_per_step = micro_batch * seq_len
    summaries = {name: trainer.summary(tokens_per_step) for name, trainer in trainers.items()}
    summaries["mixture"].update(weights=MIXTURE_WEIGHTS, realised=_realised_shares(trainers["mixture"].batches))
    setup = {
        "steps_measured": per_round * rounds, "warmup_steps": warmup_steps, "rounds": rounds, "micro_batch": micro_batch,
        "seq_len": seq_len, "prefetch_batches": prefetch_batches, "precision": "fp32", "torch_threads": threads,
        "corpus": {"source": source, "uri": uri, "num_sequences": manifest.num_sequences, "num_shards": len(manifest.shards)},
        "prepare_s": prepare_s,
    }
    return _result(summaries, setup)


def _trainers(manifest, *, micro_batch: int, seq_len: int, seed: int, prefetch_batches: int) -> dict[str, _Trainer]:
    """The three paths, each feeding its own copy of the tiny model (same seed, same weights)."""
    from raytrain_fast.data import BatchIterator
    from raytrain_fast.data.mixture import Source
    from raytrain_fast.model import ModelConfig

    model_config = ModelConfig(max_seq_len=max(seq_len, ModelConfig().max_seq_len))
    sources = [Source(name=name, weight=weight, manifest=manifest) for name, weight in MIXTURE_WEIGHTS.items()]
    batches = {
        "ingest": BatchIterator([Source(name="corpus", weight=1.0, manifest=manifest)], rank=0, world_size=1,
                                micro_batch=micro_batch, seed=seed, prefetch_batches=prefetch_batches),
        "baseline": _parquet_loader(manifest, micro_batch=micro_batch, seed=seed),
        "mixture": BatchIterator(sources, rank=0, world_size=1, micro_batch=micro_batch, seed=seed, prefetch_batches=prefetch_batches),
    }
    return {name: _Trainer(batch_source, model_config=model_config, seed=seed) for name, batch_source in batches.items()}


def _result(summaries: dict[str, dict[str, Any]], setup: dict[str, Any]) -> dict[str, Any]:
    """The report: each path's headline figures, the target, every path's summary and the setup."""
    ours, baseline, mixed = summaries["ingest"], summaries["baseline"], summaries["mixture"]
    return {
        "data_wait_frac": ours["data_wait_frac"],
        "data_wait_frac_baseline": baseline["data_wait_frac"],
        "data_wait_frac_mixture": mixed["data_wait_frac"],
        "tokens_per_sec": ours["tokens_per_sec"],
        "tokens_per_sec_baseline": baseline["tokens_per_sec"],
        "tokens_per_sec_mixture": mixed["tokens_per_sec"],
        "target_data_wait_frac": 0.02,
        "meets_target": ours["data_wait_frac"] <= 0.02,
        "mixture_meets_target": mixed["data_wait_frac"] <= 0.02,
        **summaries,
        **setup,
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "note": "timings share the machine with everything else running; compare the paths, not runs",
    }


def _realised_shares(mixture) -> dict[str, float]:
    """Each source's share of the sequences the mixture variant read (from its position)."""
    counts = mixture.schedule.counts(mixture.position.consumed)
    return {name: float(c) / max(1, int(counts.sum())) for name, c in zip(mixture.names, counts.tolist())}
