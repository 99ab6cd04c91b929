"""How long a checkpoint blocks training: `checkpoint.upload: async` against `sync`
(docs/benchmarks.md#checkpoint-stalls).

A small TorchTrainer run per mode: every worker builds the training program (engine/program.py) for a
GPT sized so that its checkpoint reaches a target size, trains (engine/step.py) between checkpoints,
and times `Checkpointer.save` on the training thread, the wait for the previous async upload
included. `step_s_async` against `step_s_sync` shows what an upload running beside the steps costs them.
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from raytrain_fast._ray_compat import worker_env_flags
from raytrain_fast.checkpoint.verify import verify_checkpoint
from raytrain_fast.model import ModelConfig
from raytrain_fast.config.storage import StorageConfig

BYTES_PER_PARAM = 16  # fp32 ZeRO-1/2 with Adam: module weights 4 + fp32 master 4 + two moments 8


def model_for_checkpoint_mb(target_mb: float, *, num_layers: int = 4, vocab_size: int = 320, seq_len: int = 32) -> ModelConfig:
    """The smallest GPT (d_model a multiple of 64) whose fp32 ZeRO checkpoint is >= target_mb."""
    d_model = 64
    while True:
        # 12 d^2 per block (qkv 3 + proj 1 + MLP 8 with mlp_ratio 4) + token and position tables.
        num_params = num_layers * 12 * d_model * d_model + (vocab_size + seq_len) * d_model
        if num_params * BYTES_PER_PARAM / 1e6 >= target_mb:
            return ModelConfig(
                vocab_size=vocab_size, max_seq_len=seq_len, num_layers=num_layers, num_heads=4, d_model=d_model,
            )
        d_model += 64


def _bench_program(model: ModelConfig, *, world_size: int, cpus_per_worker: int) -> Any:
    """This worker's program, built as training builds it (engine/program.py): fp32, ZeRO-2, one
    micro-batch per step on `world_size` workers."""
    from raytrain_fast.config import Config
    from raytrain_fast.config.engine import EngineConfig, OptimConfig
    from raytrain_fast.config.resources import ResourcesConfig
    from raytrain_fast.config.train import TrainConfig
    from raytrain_fast.engine.program import build_program, prepare_process

    device = prepare_process(threads=cpus_per_worker, seed=0)  # Ray starts actors with one thread
    config = Config(
        model=model, engine=EngineConfig(precision="fp32", zero_stage=2, compile="off"), optim=OptimConfig(warmup_steps=1),
        train=TrainConfig(steps=10_000, micro_batch=1, grad_accum=1, global_batch=world_size),
        resources=ResourcesConfig(num_workers=world_size, cpus_per_worker=cpus_per_worker, use_gpu=False),
    )
    return build_program(config, device=device)


def _bench_loop(config: dict[str, Any]) -> None:
    """Per worker: train, and time every checkpoint's `Checkpointer.save` on the training thread
    (the package's own save path: DeepSpeed files, RNG, state, manifest, report, our upload)."""
    import itertools

    import ray.train
    import torch

    from raytrain_fast.checkpoint import Checkpointer, TrainState
    from raytrain_fast.config.checkpoint import CheckpointConfig
    from raytrain_fast.engine.step import train_step

    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    model_config = ModelConfig(**config["model"])
    engine = _bench_program(model_config, world_size=world_size, cpus_per_worker=config["cpus_per_worker"]).engine
    checkpointer = Checkpointer(
        CheckpointConfig(upload=config["mode"].lower(), keep_last=1), rank=rank, world_size=world_size, run_config={},
    )
    state = TrainState(world_size=world_size, zero_stage=2, precision="fp32")
    tokens = torch.randint(0, model_config.vocab_size, (1, model_config.max_seq_len + 1))
    batches = itertools.repeat((tokens, None))
    records: list[dict[str, Any]] = []
    steps_between = 2
    for _ in range(config["num_checkpoints"]):
        step_times = []
        for _ in range(steps_between):
            start = time.perf_counter()
            train_step(engine, batches, grad_accum=1)
            step_times.append(time.perf_counter() - start)
            state.step += 1
        blocked_s = checkpointer.save(engine, state, metrics={"step": state.step})
        records.append({
            "step": state.step, "blocked_s": blocked_s, "step_s_before": statistics.median(step_times),
            "upload_s": checkpointer.take_upload_s(), **checkpointer.last_save_breakdown,
        })
        if len(records) == 1:
            # A cadence the upload can keep up with, as in real runs (checkpoints minutes apart):
            # train for seconds_between between saves. Rank 0 decides, so all ranks step alike.
            choice = [max(2, math.ceil(config["seconds_between"] / statistics.median(step_times)))]
            torch.distributed.broadcast_object_list(choice, src=0)
            steps_between = choice[0]
    start = time.perf_counter()
    checkpointer.wait_for_upload()
    records[-1]["final_wait_s"] = time.perf_counter() - start
    Path(config["results_dir"], f"rank{rank}.json").write_text(json.dumps(records))


def _run_mode(mode: str, *, storage: StorageConfig, model: ModelConfig, num_workers: int, cpus_per_worker: int,
              num_checkpoints: int, seconds_between: float, results_dir: str) -> tuple[list[list[dict[str, Any]]], bool, str, int]:
    """(per-rank records, whether the last checkpoint in storage verifies against its manifests, why not,
    its size in bytes as listed in storage)."""
    import dataclasses

    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    from raytrain_fast.storage.filesystem import resolve_filesystem

    filesystem, storage_path = resolve_filesystem(storage.uri, storage)
    trainer_name = f"bench-checkpoint-{mode.lower()}-{uuid.uuid4().hex[:6]}"
    trainer = TorchTrainer(
        _bench_loop,
        train_loop_config={
            "mode": mode, "model": dataclasses.asdict(model), "cpus_per_worker": cpus_per_worker,
            "num_checkpoints": num_checkpoints, "seconds_between": seconds_between, "results_dir": results_dir,
        },
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, resources_per_worker={"CPU": cpus_per_worker}),
        run_config=ray.train.RunConfig(
            name=trainer_name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),  # retention is the Checkpointer's
            worker_runtime_env={"env_vars": {
                "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(cpus_per_worker), **worker_env_flags(),
            }},
        ),
    )
    result = trainer.fit()
    records = [json.loads(Path(results_dir, f"rank{r}.json").read_text()) for r in range(num_workers)]
    complete, reason = verify_checkpoint(result.checkpoint.filesystem, result.checkpoint.path)
    import pyarrow.fs as pafs

    listed = result.checkpoint.filesystem.get_file_info(pafs.FileSelector(result.checkpoint.path, recursive=True))
    checkpoint_bytes = sum(info.size or 0 for info in listed if info.type == pafs.FileType.File)
    filesystem.delete_dir(f"{storage_path}/{trainer_name}")  # the bench's run is of no further use
    return records, complete, reason, checkpoint_bytes


def measure_checkpoint_blocking(
    *,
    storage: StorageConfig,
    checkpoint_mb: float = 200.0,
    num_workers: int = 2,
    cpus_per_worker: int = 1,
    num_checkpoints: int = 3,
    seconds_between: float = 20.0,
) -> dict[str, Any]:
    """Blocked seconds per checkpoint with ASYNC and SYNC upload to `storage` (a fresh run each).

    Blocked time per checkpoint = the slowest rank's save + report (the ranks meet again at the
    next collective); the median over checkpoints is reported. Uses the running Ray instance, or
    starts a local one (num_workers * cpus_per_worker CPUs) and shuts it down afterwards.
    Results come back through files in a local temp dir: all workers must run on this machine.
    """
    import ray

    model = model_for_checkpoint_mb(checkpoint_mb)
    started_ray = not ray.is_initialized()
    if started_ray:
        # The workers' own lines (DeepSpeed's op builds, Ray Train's notes) stay in their logs: the
        # driver's stdout is the result alone (`--json` prints one JSON object).
        ray.init(num_cpus=num_workers * cpus_per_worker, include_dashboard=False, configure_logging=False, log_to_driver=False)
    result: dict[str, Any] = {"model": {"d_model": model.d_model, "num_layers": model.num_layers}}
    try:
        for mode in ("ASYNC", "SYNC"):
            with tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-results-", ignore_cleanup_errors=True) as results_dir:
                per_rank, complete, reason, checkpoint_bytes = _run_mode(
                    mode, storage=storage, model=model, num_workers=num_workers, cpus_per_worker=cpus_per_worker,
                    num_checkpoints=num_checkpoints, seconds_between=seconds_between, results_dir=results_dir,
                )
            per_checkpoint = [max(r[i]["blocked_s"] for r in per_rank) for i in range(num_checkpoints)]
            key = mode.lower()
            # Ray merged every rank's files, manifests included: the result must verify, checksums and all.
            result[f"last_checkpoint_complete_{key}"] = complete if complete else f"NO: {reason}"
            result[f"blocked_s_{key}"] = statistics.median(per_checkpoint)
            result[f"blocked_s_{key}_all"] = per_checkpoint
            for part in ("wait_previous_s", "write_s", "report_s"):  # where the blocked time went
                result[f"{part}_{key}"] = statistics.median(max(r[i][part] for r in per_rank) for i in range(num_checkpoints))
            uploads = [u for r in per_rank for u in (c["upload_s"] for c in r) if u is not None]
            result[f"upload_s_{key}"] = statistics.median(uploads) if uploads else None
            # Step time before each checkpoint after the first: the async upload runs during these steps.
            later = [max(r[i]["step_s_before"] for r in per_rank) for i in range(1, num_checkpoints)]
            result[f"step_s_{key}"] = statistics.median(later) if later else None
            result["checkpoint_mb"] = checkpoint_bytes / 1e6
    finally:
        if started_ray:
            ray.shutdown()
    result["ratio"] = result["blocked_s_async"] / result["blocked_s_sync"]
    result["target_ratio"] = 0.25
    return result

