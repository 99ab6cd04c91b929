"""`raytrain-fast bench overhead`: tokens/s of the package's loop against two references, on the
same model, batch, precision and machine, in one process tree.

- `bare`: the plain single-process PyTorch loop someone writes for speed on one device: batches
  already in memory, AdamW (fused on GPU, foreach on CPU), gradient clipping, autocast only when the
  precision is bf16, the same number of threads, no logging. The ceiling.
- `typical_ray_train`: a TorchTrainer with one worker running the loop people usually write:
  `loss.item()` and `ray.train.report` every step, FLOPs re-counted with FlopCounterMode every 50
  steps, six scalars to a W&B (offline) run every step.
- `raytrain_fast`: passed in by the caller (the package's own loop), as a function returning tokens/s.

`compare` runs the variants interleaved (round-robin, the order rotated every round so none always
runs first or last), several times each, and reports medians and spread; `overhead_report` adds the
ratios `ratio_vs_bare` and `ratio_vs_typical`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from raytrain_fast.model.config import ModelConfig


@dataclass(kw_only=True)
class OverheadSetup:
    """What every variant trains, and for how long."""

    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch: int = 16
    """Sequences per step."""
    warmup_steps: int = 10
    """Steps run before the clock starts (allocator, kernel selection, W&B start-up)."""
    steps: int = 50
    """Steps timed after warm-up."""
    precision: str = "auto"
    """bf16 or fp32; auto = what the package's engine picks on this machine (fp32 on CPUs without fast bf16)."""
    threads: int = 0
    """torch threads on CPU (the same in every variant); 0 = this process's torch.get_num_threads()."""
    lr: float = 1e-3
    """AdamW learning rate."""
    grad_clip: float = 1.0
    """Gradient-norm clipping."""
    flops_every: int = 50
    """typical_ray_train only: re-count FLOPs with FlopCounterMode every this many steps."""
    seed: int = 0
    """Seed of the model init and the in-memory token batches."""

    def resolved(self) -> OverheadSetup:
        """Concrete precision and thread count (so every variant, in every process, uses the same)."""
        import torch

        from raytrain_fast.engine import resolve_precision

        precision = self.precision
        if precision == "auto":
            precision, _ = resolve_precision("auto", use_gpu=torch.cuda.is_available())
        threads = self.threads or torch.get_num_threads()
        return dataclasses.replace(self, precision=precision, threads=threads)


def _model_config(setup: OverheadSetup) -> ModelConfig:
    return ModelConfig(max_seq_len=max(ModelConfig().max_seq_len, setup.seq_len))


def _build(setup: OverheadSetup, device: Any):
    """Model, AdamW, in-memory batches (8 distinct, cycled) and the autocast context for `setup`."""
    import torch

    from raytrain_fast.model import GPT

    torch.manual_seed(setup.seed)
    config = _model_config(setup)
    model = GPT(config).to(device)
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.1,
        **({"fused": True} if cuda else {"foreach": True}),
    )
    generator = torch.Generator().manual_seed(setup.seed)
    batches = torch.randint(0, 257, (8, setup.micro_batch, setup.seq_len + 1), generator=generator).to(device)
    if setup.precision == "bf16":
        autocast: Callable[[], Any] = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    return model, optimizer, batches, autocast


def bare(setup: OverheadSetup) -> float:
    """Tokens/s of the plain single-process loop, in this process."""
    import torch

    from raytrain_fast.engine import training_device

    setup = setup.resolved()
    device = training_device()
    if device.type == "cpu":
        torch.set_num_threads(setup.threads)
    model, optimizer, batches, autocast = _build(setup, device)
    num_batches = batches.shape[0]

    def step(i: int) -> torch.Tensor:
        tokens = batches[i % num_batches]
        with autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for i in range(setup.warmup_steps):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i in range(setup.steps):
        loss = step(setup.warmup_steps + i)
    loss.item()  # one host sync at the end: the clock stops when the device is done
    elapsed = time.perf_counter() - start
    return setup.steps * setup.micro_batch * setup.seq_len / elapsed


def _typical_loop(config: dict[str, Any]) -> None:
    """The loop people usually write on Ray Train (runs in the TorchTrainer worker)."""
    import ray.train
    import torch
    import wandb
    from ray.train.torch import prepare_model
    from torch.utils.flop_counter import FlopCounterMode

    from raytrain_fast.engine import training_device

    setup = OverheadSetup(**config["setup"])
    device = training_device()
    if device.type == "cpu":
        # Set like in `bare`, so the comparison is about the loop, not about Ray's OMP_NUM_THREADS=1.
        torch.set_num_threads(setup.threads)
    model, optimizer, batches, autocast = _build(setup, device)
    model = prepare_model(model)
    run = wandb.init(project="raytrain-fast-bench", mode="offline", dir=config["wandb_dir"], reinit="create_new")
    tokens_per_step = setup.micro_batch * setup.seq_len
    flops_per_step = 0.0
    start = None
    last = time.perf_counter()
    for i in range(setup.warmup_steps + setup.steps):
        if i == setup.warmup_steps:
            start = time.perf_counter()
        tokens = batches[i % batches.shape[0]]
        if i % setup.flops_every == 0:
            with FlopCounterMode(display=False) as counter:
                with autocast():
                    loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
            flops_per_step = counter.get_total_flops()
        else:
            with autocast():
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        now = time.perf_counter()
        step_s, last = now - last, now
        run.log(
            {
                "loss": loss_value,
                "lr": optimizer.param_groups[0]["lr"],
                "grad_norm": grad_norm.item(),
                "tokens_per_sec": tokens_per_step / step_s,
                "step_time": step_s,
                "tflops": flops_per_step / step_s / 1e12,
            },
            step=i,
        )
        ray.train.report({"loss": loss_value, "step": i})
    assert start is not None
    tokens_per_sec = setup.steps * tokens_per_step / (time.perf_counter() - start)
    run.finish()
    # Metrics reported without a checkpoint are not kept in Result.metrics: attach a tiny one.
    result_dir = tempfile.mkdtemp(prefix="raytrain-fast-bench-")
    with open(os.path.join(result_dir, "result.json"), "w") as out:
        json.dump({"tokens_per_sec": tokens_per_sec}, out)
    ray.train.report({"bench/tokens_per_sec": tokens_per_sec}, checkpoint=ray.train.Checkpoint.from_directory(result_dir))


def typical_ray_train(setup: OverheadSetup, *, storage_path: str | None = None, num_workers: int = 1) -> float:
    """Tokens/s of the typical hand-written Ray Train loop, on a TorchTrainer with one worker.

    num_workers=0 is Ray Train's local mode (the loop runs in this process): for tests only.
    """
    import uuid

    import ray
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        ray.init(configure_logging=False)
    setup = setup.resolved()
    use_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-") as scratch:
        trainer = TorchTrainer(
            _typical_loop,
            train_loop_config={"setup": dataclasses.asdict(setup), "wandb_dir": scratch},
            scaling_config=ray.train.ScalingConfig(
                num_workers=num_workers, use_gpu=use_gpu, resources_per_worker={"CPU": 1 if use_gpu else setup.threads}
            ),
            run_config=ray.train.RunConfig(
                name=f"bench-typical-{uuid.uuid4().hex[:8]}",
                storage_path=storage_path or os.path.join(scratch, "storage"),
                worker_runtime_env={"env_vars": {"WANDB_SILENT": "true", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}},
            ),
        )
        result = trainer.fit()
        if result.metrics and "bench/tokens_per_sec" in result.metrics:
            return float(result.metrics["bench/tokens_per_sec"])
        assert result.checkpoint is not None, "the typical loop reported no result"
        with result.checkpoint.as_directory() as directory:
            with open(os.path.join(directory, "result.json")) as stream:
                return float(json.load(stream)["tokens_per_sec"])


def _summary(values: list[float]) -> dict[str, Any]:
    median = statistics.median(values)
    return {
        "tokens_per_sec": values,
        "median": median,
        "min": min(values),
        "max": max(values),
        "spread": (max(values) - min(values)) / median if median else 0.0,
    }


def compare(variants: Mapping[str, Callable[[], float]], *, repeats: int = 3) -> dict[str, Any]:
    """Run every variant `repeats` times, interleaved, the order rotated each round.

    Returns {"repeats", "order": [[names of round 1], ...], "variants": {name: {tokens_per_sec: [...],
    median, min, max, spread}}}, spread = (max - min) / median.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(variants)
    runs: dict[str, list[float]] = {name: [] for name in names}
    order = []
    for round_index in range(repeats):
        shift = round_index % len(names)
        this_round = names[shift:] + names[:shift]
        order.append(this_round)
        for name in this_round:
            runs[name].append(float(variants[name]()))
    return {"repeats": repeats, "order": order, "variants": {name: _summary(values) for name, values in runs.items()}}


def overhead_report(
    *,
    setup: OverheadSetup | None = None,
    raytrain_fast: Callable[[], float] | None = None,
    repeats: int = 3,
    include_typical: bool = True,
) -> dict[str, Any]:
    """The JSON of `raytrain-fast bench overhead --json` (minus the package's own variant, which the
    caller passes as `raytrain_fast`: a function returning tokens/s after warm-up)."""
    setup = (setup or OverheadSetup()).resolved()
    variants: dict[str, Callable[[], float]] = {"bare": lambda: bare(setup)}
    if include_typical:
        variants["typical_ray_train"] = lambda: typical_ray_train(setup)
    if raytrain_fast is not None:
        variants["raytrain_fast"] = raytrain_fast
    report = compare(variants, repeats=repeats)
    report["setup"] = dataclasses.asdict(setup)
    medians = {name: summary["median"] for name, summary in report["variants"].items()}
    ratios: dict[str, float] = {}
    if "typical_ray_train" in medians:
        ratios["typical_vs_bare"] = medians["typical_ray_train"] / medians["bare"]
    if "raytrain_fast" in medians:
        ratios["ratio_vs_bare"] = medians["raytrain_fast"] / medians["bare"]
        if "typical_ray_train" in medians:
            ratios["ratio_vs_typical"] = medians["raytrain_fast"] / medians["typical_ray_train"]
    report["ratios"] = ratios
    return report


__all__ = ["OverheadSetup", "bare", "compare", "overhead_report", "typical_ray_train"]
