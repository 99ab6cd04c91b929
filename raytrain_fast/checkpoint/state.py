"""What a checkpoint holds besides DeepSpeed's files: the training state (`train_state.json`), each
rank's RNG states, the directory name, and the two collectives save and restore agree through."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(kw_only=True)
class TrainState:
    """What the loop needs besides the engine to continue exactly where it stopped."""

    step: int = 0
    """Optimizer steps completed."""
    tokens: int = 0
    """Tokens consumed across all workers."""
    world_size: int = 1
    """Workers of the run that wrote it."""
    global_batch: int = 0
    """Sequences per optimizer step (kept when resuming on another worker count; 0: from before it was saved)."""
    zero_stage: int = 2
    precision: str = "bf16"
    data_position: dict[str, Any] | None = None
    """The global data position (sequences of the epoch consumed by all ranks), see data/ingest.py."""
    coordinator: dict[str, Any] | None = None
    """Values measured once per run (FLOPs per token, peaks), so a resumed job does not measure again."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Metrics at save time (keep_best reads these)."""
    health: dict[str, Any] = field(default_factory=dict)
    """The saved state's health (loop/health.py): `finite`, the last window's `loss` and `grad_norm`,
    and the run's `rollbacks` so far, each with the data it skipped. Resume, retention and export
    use only checkpoints whose state was healthy (checkpoint/verify.py `state_health`)."""

    @classmethod
    def from_json(cls, text: str) -> TrainState:
        data = json.loads(text)
        return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})


def rng_states(device: Any) -> dict[str, torch.Tensor]:
    """This rank's random number generator states: the CPU's, and its GPU's on CUDA (dropout and
    any sampling on the device draw from the latter)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, torch.Tensor] | torch.Tensor, device: Any) -> None:
    """Restore `rng_states`; a bare tensor is the CPU state of a checkpoint written before the GPU's was kept."""
    if isinstance(states, torch.Tensor):
        states = {"cpu": states}
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:08d}"


def barrier(world_size: int) -> None:
    """Every rank waits here for the others (the gloo/NCCL group Ray Train set up); a no-op alone."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_gather_ints(values: list[int], world_size: int) -> list[list[int]]:
    """Every rank's `values` (same length on every rank), in rank order; one collective."""
    import torch.distributed as dist

    if world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return [list(values)]
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        from raytrain_fast.engine.deepspeed_engine import training_device

        device = training_device()
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    return [t.tolist() for t in every]
