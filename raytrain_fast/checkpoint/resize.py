"""Resuming a checkpoint on another number of workers (docs/checkpoints.md, "Resuming on another
worker count"): the global batch is kept (`fit_batch`, on the driver before any worker starts); the
ZeRO-2 optimizer shards are converted once to DeepSpeed's universal layout and cached beside the
checkpoint as `checkpoint_<step>.universal/` (never a `checkpoint_<digits>` name, so listing and
retention never take it for a checkpoint); the data position is global: nothing to remap.

The conversion runs on rank 0 of the new worker group, inside `Checkpointer.restore_state`: the one
place that sees every resize (a resumed job and an elastic restart of the worker group alike).
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from raytrain_fast.checkpoint.layout import CONFIG_FILE, DEEPSPEED_TAG, STATE_FILE
from raytrain_fast.console import say
from raytrain_fast.errors import CheckpointError

UNIVERSAL_SUFFIX = ".universal"


def universal_cache_path(checkpoint_path: str) -> str:
    """Where the universal form of `checkpoint_path` is cached (beside it, in the run's storage)."""
    return checkpoint_path.rstrip("/") + UNIVERSAL_SUFFIX


# ------------------------------------------------------------------------------------- batch


def saved_global_batch(state: Any, *, seq_len: int, default: int) -> int:
    """The checkpoint's global batch (sequences per optimizer step): saved since resizing exists,
    else derived from tokens / (step x seq_len), else `default` (the config's)."""
    if getattr(state, "global_batch", 0):
        return int(state.global_batch)
    if state.tokens and state.step and state.tokens % (state.step * seq_len) == 0:
        return state.tokens // (state.step * seq_len)
    return default


def worker_counts_that_fit(global_batch: int, *, limit: int = 64) -> list[int]:
    """Worker counts that can keep `global_batch` (some micro_batch x grad_accum fits: the count divides it)."""
    return [n for n in range(1, min(global_batch, limit) + 1) if global_batch % n == 0]


def fit_batch(*, global_batch: int, micro_batch: int, num_workers: int, saved_workers: int, uri: str) -> tuple[int, int]:
    """(micro_batch, grad_accum) with micro_batch x grad_accum x num_workers == global_batch: the
    configured micro_batch when it fits, else the largest one below it that does. Raises a
    CheckpointError naming the worker counts that work when none does."""
    if global_batch % num_workers:
        counts = ", ".join(map(str, worker_counts_that_fit(global_batch)))
        raise CheckpointError(
            f"checkpoint {uri} was saved by {saved_workers} workers with a global batch of {global_batch} sequences; "
            f"{num_workers} workers cannot keep it ({global_batch} is not a multiple of {num_workers}). Resume with "
            f"resources.num_workers set to one of {counts}, or start a new run (another --name) from its model "
            f"weights with --set checkpoint.init_from={uri}"
        )
    per_worker = global_batch // num_workers
    fitted = max(d for d in range(1, min(micro_batch, per_worker) + 1) if per_worker % d == 0)
    return fitted, per_worker // fitted


# ------------------------------------------------------------------------------------- conversion


def convert_to_universal(checkpoint_dir: str, output_dir: str) -> float:
    """Convert a downloaded checkpoint (its `deepspeed/` ZeRO files) into a universal checkpoint in
    `output_dir` (`deepspeed/` in the universal layout, by engine/deepspeed_compat.py, plus the RNG
    states and the train state). Returns the seconds the conversion took. `checkpoint_dir` is only read."""
    from raytrain_fast.engine.deepspeed_compat import convert_to_universal as deepspeed_conversion

    start = time.perf_counter()
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    try:
        deepspeed_conversion(str(Path(checkpoint_dir, DEEPSPEED_TAG)), str(output / DEEPSPEED_TAG))
    except RuntimeError as error:
        raise CheckpointError(
            f"converting {checkpoint_dir} to a universal checkpoint failed: {error} Resume with the worker count that wrote it."
        ) from error
    for path in Path(checkpoint_dir).iterdir():
        if path.is_file() and (path.name.startswith("rng_state_rank") or path.name in (STATE_FILE, CONFIG_FILE)):
            shutil.copy2(path, output / path.name)
    return time.perf_counter() - start


def ensure_universal(
    filesystem: Any, checkpoint_path: str, *, local_checkpoint: str | Callable[[], str], step: int
) -> tuple[str, float | None]:
    """The universal form of the checkpoint at `checkpoint_path` in storage: reused from the cache
    when complete there, else converted from `local_checkpoint` (its verified download, or a function
    that downloads it: called only when there is no cache) and uploaded.
    Returns (cache path, conversion seconds or None when reused). Rank 0 only."""
    import pyarrow.fs as pafs

    from raytrain_fast.checkpoint.rank_manifest import write_rank_manifest
    from raytrain_fast.checkpoint.verify import verify_checkpoint

    cache = universal_cache_path(checkpoint_path)
    if verify_checkpoint(filesystem, cache, checksums=False)[0]:
        return cache, None
    with tempfile.TemporaryDirectory(prefix="raytrain-fast-universal-") as local:
        source = local_checkpoint() if callable(local_checkpoint) else local_checkpoint
        seconds = convert_to_universal(source, local)
        write_rank_manifest(local, rank=0, world_size=1, step=step)  # the cache verifies like a checkpoint
        with contextlib.suppress(OSError):
            filesystem.delete_dir(cache)  # a partial upload of an earlier attempt
        pafs.copy_files(local, cache, destination_filesystem=filesystem)
    return cache, seconds


def rng_seed_for_new_rank(*, step: int, rank: int) -> int:
    """The RNG seed of a rank that did not exist when the checkpoint was written: derived from (step, rank)."""
    return int.from_bytes(hashlib.blake2b(f"resize:{step}:{rank}".encode(), digest_size=8).digest(), "little") >> 1


def resize_line(*, step: int, old: int, new: int, seconds: float | None, cache: str, micro_batch: int, grad_accum: int) -> str:
    how = f"converted to a universal checkpoint in {seconds:.1f} s" if seconds is not None else "universal checkpoint reused"
    return (
        f"Resized at step {step}: {old} -> {new} workers (micro_batch {micro_batch} x grad_accum {grad_accum} per worker), "
        f"{how} ({cache})"
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m raytrain_fast.checkpoint.resize <downloaded checkpoint dir> <output dir>`: convert one
    checkpoint by hand and print the time (what a resize costs for this model)."""
    import sys

    source, output = (argv if argv is not None else sys.argv[1:])[:2]
    seconds = convert_to_universal(source, output)
    size = sum(p.stat().st_size for p in Path(output).rglob("*") if p.is_file())
    say(f"converted {source} to a universal checkpoint in {output}: {seconds:.2f} s, {size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
