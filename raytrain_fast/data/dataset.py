"""The training dataset handed to TorchTrainer, and the per-worker batch iterator."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from raytrain_fast.data.config import DataConfig
from raytrain_fast.data.corpus import corpus_files, pack_sequences, tokenize_files

_NUM_BLOCKS = 32  # enough blocks for streaming_split to balance workers


def build_dataset(data: DataConfig):
    """Tokenize and pack the corpus on the driver and put it in Ray's object store.

    Each row is one sequence: column `data`, seq_len + 1 uint16 values. Returns (dataset, rows).
    """
    import ray.data

    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # per-operator bars flood the terminal of every worker
    context.print_on_execution_start = False
    sequences = pack_sequences(
        tokenize_files(corpus_files(data.source), max_tokens=data.max_tokens),
        seq_len=data.seq_len,
        seed=data.shuffle_seed,
    )
    blocks = np.array_split(sequences, min(_NUM_BLOCKS, len(sequences)))
    return ray.data.from_numpy(blocks), len(sequences)


def batches(shard, *, micro_batch: int, prefetch_batches: int, device: torch.device) -> Iterator[torch.Tensor]:
    """(micro_batch, seq_len + 1) int64 token batches from this worker's shard, epoch after epoch.

    Ray Data prepares `prefetch_batches` batches ahead while the step runs; the partial last batch
    of an epoch is dropped so every step has the same shape.
    """
    while True:
        for batch in shard.iter_torch_batches(
            batch_size=micro_batch,
            prefetch_batches=prefetch_batches,
            dtypes=torch.int64,
            device=device,
            drop_last=True,
        ):
            yield batch["data"]
