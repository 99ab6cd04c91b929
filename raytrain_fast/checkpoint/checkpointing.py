"""Saving and restoring the whole training state through Ray Train checkpoints.

One checkpoint = one directory `checkpoint_<step>` in the run's storage, holding:
- `deepspeed/`: DeepSpeed's own files: model states (rank 0) and one optimizer shard per rank
  (`bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt`, distinct names, so Ray's merge of every
  rank's files into one directory never collides), LR scheduler state included;
- `train_state.json` (rank 0): step, tokens seen, world size, ZeRO stage, precision.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raytrain_fast.errors import CheckpointError

DEEPSPEED_TAG = "deepspeed"
STATE_FILE = "train_state.json"


@dataclass(kw_only=True)
class TrainState:
    """What the loop needs besides the engine to continue exactly where it stopped."""

    step: int = 0
    """Optimizer steps completed."""
    tokens: int = 0
    """Tokens consumed across all workers."""
    world_size: int = 1
    zero_stage: int = 2
    precision: str = "bf16"


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def save_checkpoint(engine: Any, state: TrainState, *, metrics: dict[str, Any], rank: int) -> None:
    """Every rank writes its DeepSpeed files to a local dir; ray.train.report merges and uploads them.

    Must be called by every rank at the same step (DeepSpeed's save and Ray's report are collectives).
    """
    import ray.train

    local_dir = tempfile.mkdtemp(prefix="raytrain-fast-ckpt-")
    try:
        engine.save_checkpoint(local_dir, tag=DEEPSPEED_TAG)
        if rank == 0:
            Path(local_dir, STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(local_dir),
            checkpoint_dir_name=checkpoint_dir_name(state.step),
        )
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def restore_checkpoint(engine: Any, *, world_size: int) -> TrainState | None:
    """Load the run's latest checkpoint into `engine`; None when the run has none yet."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as directory:
        state_path = Path(directory, STATE_FILE)
        if not state_path.exists():
            raise CheckpointError(f"checkpoint {checkpoint.path} has no {STATE_FILE}: it was not written by raytrain_fast")
        state = TrainState(**json.loads(state_path.read_text()))
        if state.world_size != world_size:
            raise CheckpointError(
                f"checkpoint {checkpoint.path} was saved by {state.world_size} workers, this run has {world_size}. "
                f"ZeRO optimizer shards are per worker: resume with resources.num_workers={state.world_size}, "
                "or start a new run under another name."
            )
        load_path, _ = engine.load_checkpoint(
            directory, tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if load_path is None:
            raise CheckpointError(f"DeepSpeed found no loadable state in {checkpoint.path}")
    return state
