"""`checkpoint.init_from`: a new run's starting weights (only the weights) from a checkpoint directory
or a Hugging Face Llama-family directory. Its own module: it reads exported and consolidated weights
(export.py), which itself reads the names saving writes (layout.py), so nothing here ties saving to
exporting.

In bf16, DeepSpeed casts the module to bf16 and makes the fp32 master weights from that copy, so an
fp32 checkpoint's values would be rounded to bf16 for good (2.2e-3 in the logits of a small llama
after 5 steps at LR 1e-12). `fp32_values` keeps a host copy of those the cast rounds, and
engine/program.py puts them into the engine's master weights once it exists."""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

import torch

from raytrain_fast.checkpoint.download import download_checkpoint
from raytrain_fast.errors import CheckpointError


def load_initial_weights(model: torch.nn.Module, uri: str, *, storage: Any, rank: int = 0, world_size: int = 1) -> str:
    """checkpoint.init_from: copy model weights (only) from a checkpoint directory, or a Hugging Face
    Llama-family directory (checkpoint/hf_import.py), into `model`.

    Read once per job: rank 0 downloads and consolidates the checkpoint, then every parameter and
    buffer goes to the other ranks through torch.distributed (a broadcast per tensor, over the
    group Ray Train set up), so storage serves the checkpoint once, not once per rank."""
    if world_size == 1:
        return _read_initial_weights(model, uri, storage=storage)
    import torch.distributed as dist
    from ray.train.collective import broadcast_from_rank_zero

    outcome: tuple[str, str] | None = None
    if rank == 0:
        try:
            outcome = ("ok", _read_initial_weights(model, uri, storage=storage))
        except CheckpointError as error:
            outcome = ("error", str(error))
    outcome = broadcast_from_rank_zero(outcome)
    if outcome[0] == "error":  # every rank stops with rank 0's reason
        raise CheckpointError(outcome[1])
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=0)
    return outcome[1]


def _read_initial_weights(model: torch.nn.Module, uri: str, *, storage: Any) -> str:
    from raytrain_fast.checkpoint.export import consolidated_state_dict
    from raytrain_fast.storage import resolve_filesystem

    filesystem, path = resolve_filesystem(uri, storage)
    from raytrain_fast.checkpoint.hf_import import read_hf_config, read_hf_weights

    if read_hf_config(filesystem, path) is not None:  # a Hugging Face directory (checked on the driver)
        model.load_state_dict(read_hf_weights(filesystem, path, model.config), strict=True)
        return "Hugging Face weights"
    local_dir = tempfile.mkdtemp(prefix="raytrain-fast-init-")
    try:
        download_checkpoint(filesystem, path, local_dir)
        state_dict, source = consolidated_state_dict(local_dir)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        missing = [k for k in missing if k != "lm_head.weight"]  # tied to token_emb.weight
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint.init_from={uri} does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                "use the same model section as the run that saved it"
            )
        return source
    finally:
        shutil.rmtree(local_dir, ignore_errors=True)


def fp32_values(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(parameter, a host copy of its value) for each parameter of `model` that a bf16 cast would
    round: none for a bf16 checkpoint, every one of an fp32 checkpoint (host memory: its fp32 size)."""
    with torch.no_grad():
        return [(p, p.detach().to("cpu", copy=True)) for p in model.parameters() if not torch.equal(p, p.bfloat16().float())]
