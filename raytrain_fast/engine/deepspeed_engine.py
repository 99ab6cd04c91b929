"""Builds the DeepSpeed config and engine from our config.

deepspeed is imported lazily inside the functions that need it: importing it is slow and has
crashed CPU-only Ray actors, and `DS_ACCELERATOR` must be set before the first import.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from raytrain_fast.config.engine import EngineConfig, OptimConfig, wsd_decay_steps
from raytrain_fast.console import say
from raytrain_fast.engine.deepspeed_compat import set_clip_grad, set_last_lr
from raytrain_fast.errors import ConfigError


def select_accelerator() -> str:
    """Pick DeepSpeed's accelerator: cuda when a GPU is visible, else the CPU one (gloo backend).

    Must run before deepspeed is first imported: DeepSpeed reads DS_ACCELERATOR once. The user's
    own setting wins.
    """
    if "DS_ACCELERATOR" not in os.environ:
        os.environ["DS_ACCELERATOR"] = "cuda" if torch.cuda.is_available() else "cpu"
    return os.environ["DS_ACCELERATOR"]


def enable_tf32(device: torch.device) -> None:
    """fp32 matmuls and convolutions on CUDA run on TF32 tensor cores (Ampere and later: about 8x the
    fp32 rate, 10-bit mantissa inputs, fp32 accumulation), as in most training stacks. torch leaves
    it off for matmuls by default. No effect on CPUs."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def training_device() -> torch.device:
    """The device this process trains on: its Ray Train GPU inside a worker, the current GPU
    outside one (benches), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    try:
        import ray.train.torch

        return ray.train.torch.get_device()
    except Exception:  # not inside a Ray Train worker
        return torch.device("cuda", torch.cuda.current_device())


def measure_cpu_bf16_speedup(*, size: int = 512, repeats: int = 5) -> float:
    """Time a square matmul in bf16 and fp32 on this CPU; returns fp32_time / bf16_time.

    > 1 means bf16 is faster. About 50 ms in all.
    """
    times = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(size, size, dtype=dtype)
        b = torch.randn(size, size, dtype=dtype)
        a @ b  # warm-up
        start = time.perf_counter()
        for _ in range(repeats):
            a @ b
        times[dtype] = time.perf_counter() - start
    return times[torch.float32] / times[torch.bfloat16]


NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
"""x86 flags (in /proc/cpuinfo) of instructions that compute bf16 dot products natively."""


def cpu_bf16_native(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU computes bf16 matmuls natively, from its x86 feature flags (AVX-512 BF16, AMX):
    True or False where the flags say (x86 Linux), None where they do not (another architecture or OS)."""
    try:
        with open(cpuinfo) as lines:
            flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else bool(NATIVE_BF16_FLAGS & set(flags))


def resolve_precision(precision: str, *, use_gpu: bool) -> tuple[str, str]:
    """Turn `auto` into bf16 or fp32 on the hardware of this process (call it where the workers run:
    launch/trainer.py's `resolve_precision_on_a_worker`). Returns (precision, reason) for the log."""
    if precision == "fp8":  # set explicitly, and only for GPUs with FP8 tensor cores: checked here
        from raytrain_fast.engine.fp8 import RECIPE, fp8_problem

        problem = fp8_problem(use_gpu=use_gpu)
        if problem is not None:
            raise ConfigError(problem)
        return "fp8", f"engine.precision=fp8 (set explicitly): float8 matmuls in the blocks' linear layers ({RECIPE} scaling), bf16 elsewhere"
    if precision != "auto":
        return precision, f"engine.precision={precision} (set explicitly)"
    if use_gpu:
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name()
            return "fp32", f"this GPU ({name}) has no bf16 support, so training runs in fp32"
        return "bf16", "GPU workers: bf16 with fp32 master weights"
    native = cpu_bf16_native()  # the features settle it where they can: a timing swings with the machine's load
    if native is not None:
        if native:
            return "bf16", "this CPU has native bf16 instructions (AVX-512 BF16 or AMX): bf16 with fp32 master weights"
        return "fp32", (
            "this CPU has no native bf16 instructions (no AVX-512 BF16 or AMX: a bf16 matmul runs several times slower "
            "than fp32), so training runs in fp32; set engine.precision=bf16 to force bf16"
        )
    speedup = measure_cpu_bf16_speedup()  # no flags to read (another architecture): time both
    if speedup >= 1.0:
        return "bf16", f"this CPU runs bf16 matmuls {speedup:.1f}x as fast as fp32"
    return "fp32", (
        f"this CPU runs bf16 matmuls at {speedup:.2f}x the speed of fp32 (no native bf16 instructions), "
        "so training runs in fp32; set engine.precision=bf16 to force bf16"
    )


def build_deepspeed_config(
    *, engine: EngineConfig, optim: OptimConfig, micro_batch: int, grad_accum: int, world_size: int,
    load_universal: bool = False,
) -> dict[str, Any]:
    """The DeepSpeed JSON config. The batch sizes must already be consistent (validated earlier),
    and `engine.precision` resolved to bf16 or fp32 (see `resolve_precision`). `load_universal`: the
    checkpoint to load is in DeepSpeed's universal layout (a resume on another worker count)."""
    precision = engine.precision
    if precision == "auto":
        raise ValueError("engine.precision must be resolved with resolve_precision() before building DeepSpeed")
    return {
        "train_batch_size": micro_batch * grad_accum * world_size,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "gradient_clipping": optim.grad_clip,
        # bf16 is the one mixed-precision path: DeepSpeed casts the model and keeps fp32 master
        # weights (fp8 too: only the blocks' matmuls run in float8, engine/fp8.py). check_grad_overflow would read a flag back to the host every optimizer step
        # (a host sync); bf16's range makes overflow rare, so it is off unless asked for.
        "bf16": {"enabled": precision in ("bf16", "fp8"), "check_grad_overflow": engine.check_grad_overflow},
        "zero_optimization": {
            "stage": engine.zero_stage,
            # With one worker there is nothing to reduce: overlapping the reduction and copying
            # gradients into a contiguous buffer for it only cost time (~5% of a tiny-model step
            # on CPU, measured), so both are off whatever the config says.
            "overlap_comm": engine.overlap_comm and world_size > 1,
            "contiguous_gradients": engine.contiguous_gradients and world_size > 1,
            "reduce_bucket_size": engine.reduce_bucket_size,
            "allgather_bucket_size": engine.allgather_bucket_size,
        },
        # Both of these synchronize the device with the host on every step when on; our own
        # metrics measure throughput without that, so DeepSpeed's timers stay off.
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "steps_per_print": 2**31 - 1,  # DeepSpeed's own per-step logging: never
        **({"checkpoint": {"load_universal": True}} if load_universal else {}),
    }


def build_optimizer(parameters: list[torch.nn.Parameter], *, optim: OptimConfig, device: torch.device | str) -> torch.optim.Optimizer:
    """torch's AdamW, fused where the device supports it, handed to DeepSpeed as a client optimizer
    (ZeRO then swaps in its fp32 partitions). DeepSpeed's own `torch_adam` option passes only
    `foreach`, and its FusedAdam is JIT-compiled on first use (minutes on a CPU, nvcc on a GPU box).
    Fused vs foreach on this project's 2-core CPU, one AdamW step over one flat fp32 tensor:
    0.30 vs 1.83 ms at 0.8M elements, 14 vs 105 ms at 20M."""
    fused = torch.device(device).type in ("cpu", "cuda")  # where torch's fused AdamW (one kernel per flat tensor) runs
    return torch.optim.AdamW(
        parameters, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay,
        **({"fused": True} if fused else {"foreach": True}),
    )


_DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}
"""The decay shapes (cosine's, and wsd's decay_shape): 1 at progress 0, 0 at progress 1."""


def lr_lambda(*, optim: OptimConfig, total_steps: int):
    """Multiplier of the peak LR at optimizer step s (0-based; the LR logged at step N is factor(N),
    the one the next step uses): linear warmup, then optim.schedule:

    - cosine: cosine from 1 at the end of warmup to min_lr_ratio at total_steps (the default; its
      values are those of every run made before the other schedules, which still resume);
    - wsd: 1 (stable) until the decay's first step, total_steps - decay steps (not before the end of
      warmup), then decay_shape from 1 to min_lr_ratio at total_steps;
    - constant: 1.

    Past total_steps the factor stays at its value there."""
    warmup, floor = optim.warmup_steps, optim.min_lr_ratio
    if optim.schedule == "cosine":
        decay_start, shape = warmup, _DECAY_SHAPES["cosine"]
    elif optim.schedule == "wsd":
        decay_start = max(warmup, total_steps - wsd_decay_steps(optim=optim, total_steps=total_steps))
        shape = _DECAY_SHAPES[optim.decay_shape]
    elif optim.schedule == "constant":
        decay_start, shape = math.inf, _DECAY_SHAPES["linear"]  # no decay: the shape is never used
    else:
        raise ValueError(f"optim.schedule must be cosine, wsd or constant, got {optim.schedule!r}")
    decay_length = max(1, total_steps - decay_start)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if step < decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_length)
        return floor + (1.0 - floor) * shape(progress)

    return factor


def apply_optim_settings(engine: Any, *, optim: OptimConfig, total_steps: int) -> None:
    """Make this run's optim.* settings the engine's, after a checkpoint was loaded into it.

    DeepSpeed's load restores the optimizer's param groups (lr, betas, eps, weight_decay), ZeRO's
    gradient clipping value and the LR scheduler's state, base_lrs (the peak LR) included, from the
    checkpoint: a resume with `--set optim.lr=...` went on with the checkpoint's LR. The
    scheduler's step count stays the checkpoint's; its multiplier is this run's `lr_lambda` (a
    function is not part of a scheduler's saved state). With unchanged settings every value set
    here is the one already there, bit for bit (LambdaLR computes the LR as base_lr * factor(step))."""
    scheduler = engine.lr_scheduler
    optimizer = scheduler.optimizer  # the torch AdamW (DeepSpeed built the scheduler on the client optimizer)
    factor = lr_lambda(optim=optim, total_steps=total_steps)
    groups = optimizer.param_groups
    scheduler.base_lrs = [optim.lr for _ in groups]
    scheduler.lr_lambdas = [factor for _ in groups]
    for group in groups:
        group["initial_lr"] = optim.lr
        group["lr"] = optim.lr * factor(scheduler.last_epoch)
        group["betas"] = (optim.beta1, optim.beta2)
        group["eps"] = optim.eps
        group["weight_decay"] = optim.weight_decay
    set_last_lr(scheduler, [group["lr"] for group in groups])
    set_clip_grad(getattr(engine, "optimizer", None), optim.grad_clip)  # ZeRO's (or the bf16) optimizer restores it too


def apply_deepspeed_patches(mode: str, *, world_size: int, warn=say) -> str:
    """Make (auto) or undo (off) the DeepSpeed patches before an engine is built; the startup line."""
    from raytrain_fast.engine import deepspeed_compat

    deepspeed_compat.clear_stale_build_locks(warn=warn)
    shm_skipped = mode != "off" and select_accelerator() == "cpu" and world_size == 1 and deepspeed_compat.skip_shm_comm_build()
    active = deepspeed_compat.apply_patches(mode, warn=warn)
    return deepspeed_compat.patches_line(active, mode=mode, shm_skipped=shm_skipped)


def build_engine(
    model: torch.nn.Module,
    *,
    engine: EngineConfig,
    optim: OptimConfig,
    micro_batch: int,
    grad_accum: int,
    world_size: int,
    total_steps: int,
    load_universal: bool = False,
    say_line: Callable[[str], None] | None = None,
):
    """deepspeed.initialize on an already-initialised process group (TorchTrainer made it), with the
    package's DeepSpeed patches made or undone as `engine.deepspeed_patches` says (deepspeed_compat).
    `say_line`: where the patches' startup line (and a patch's warning) goes; None: not said (a
    patch's warning is still printed)."""
    line = apply_deepspeed_patches(engine.deepspeed_patches, world_size=world_size, warn=say_line or say)
    if say_line is not None:
        say_line(line)
    import deepspeed

    ds_config = build_deepspeed_config(
        engine=engine, optim=optim, micro_batch=micro_batch, grad_accum=grad_accum, world_size=world_size,
        load_universal=load_universal,
    )

    def scheduler(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim=optim, total_steps=total_steps))

    device = next(model.parameters()).device
    ds_engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=build_optimizer([p for p in model.parameters() if p.requires_grad], optim=optim, device=device),
        config=ds_config,
        lr_scheduler=scheduler,
    )
    return ds_engine
