from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW with linear warmup, then the learning-rate schedule `schedule` (docs/models.md#learning-rate-schedules)."""

    lr: float = 1e-3
    """Peak learning rate, reached at the end of warmup."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """The learning rate after warmup. cosine: a cosine decay from `lr` to `lr * min_lr_ratio` at train.steps. wsd
    (warmup-stable-decay): `lr` until the decay (decay_steps, decay_shape), which ends at `lr * min_lr_ratio` at
    train.steps. constant: `lr` to the end. A resume may change it (and any optim.* setting): from the resumed step
    on the new schedule applies, e.g. a wsd decay branched from a stable-phase checkpoint."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of `lr`, reached at train.steps by the cosine and the wsd decay (unused by constant)."""
    decay_steps: int | None = None
    """wsd: optimizer steps of the decay, the last ones before train.steps (to decay from a checkpoint at step s:
    train.steps = s + decay_steps). null = decay_fraction of train.steps."""
    decay_fraction: float = 0.2
    """wsd: the decay's share of train.steps when decay_steps is null (rounded to whole steps, at least 1)."""
    decay_shape: Literal["linear", "cosine", "sqrt"] = "linear"
    """wsd: how the decay falls from `lr` to `lr * min_lr_ratio` as its progress p goes from 0 to 1: linear (1 - p),
    cosine ((1 + cos(pi p)) / 2) or sqrt (1 - sqrt(p))."""
    warmup_steps: int = 20
    """Optimizer steps of linear warmup to `lr` (step s uses lr * (s + 1) / warmup_steps)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 turns clipping off)."""


@dataclass(kw_only=True)
class EngineConfig:
    """DeepSpeed settings. bf16 is the single mixed-precision path (no torch.autocast around it)."""

    zero_stage: int = 2
    """ZeRO stage: 0 (plain data parallel), 1 (optimizer states sharded) or 2 (+ gradients sharded)."""
    precision: Literal["auto", "bf16", "fp32", "fp8"] = "auto"
    """bf16 (fp32 master weights kept by DeepSpeed) or fp32. auto = bf16 on GPUs, and on CPUs with
    native bf16 instructions (AVX-512 BF16 / AMX; CPUs without them run bf16 matmuls far slower), else
    fp32; a CPU whose feature flags do not say (not x86) is timed; the choice and its reason are logged.
    fp8: bf16, with the blocks' linear layers computing in float8 (torchao, tensorwise scaling; compiled):
    GPUs with FP8 tensor cores only (H100, H200, L40S, B200); checkpoints and evaluation stay bf16 (docs/configuration.md#real-model-sizes)."""
    overlap_comm: bool = True
    """Overlap gradient reduction with the backward pass (off with one worker: nothing to reduce)."""
    contiguous_gradients: bool = True
    """Copy gradients into one contiguous buffer as they are produced (less fragmentation; off with one worker)."""
    reduce_bucket_size: int = 50_000_000
    """Elements per gradient reduce bucket."""
    allgather_bucket_size: int = 50_000_000
    """Elements per parameter all-gather bucket."""
    compile: Literal["auto", "on", "off"] = "auto"
    """torch.compile each transformer block (regional compilation, as torchtitan does: one compiled
    block reused by every layer, so compile time does not grow with depth). auto = on for CUDA GPUs;
    off on CPUs, where compiled gpt-124m blocks ran within noise of eager after a 12 s first step on
    2 cores (docs/benchmarks.md#model-sizes). A compile failure (no C++ compiler, an unsupported op) falls
    back to eager with one line. The first step's time, compilation included, is logged once as
    time/compile_s and kept out of tokens/s and the slowdown baseline."""
    check_grad_overflow: bool = False
    """Check bf16 gradients for inf/nan before every optimizer step. Costs a host sync per step."""
    deepspeed_patches: Literal["auto", "off"] = "auto"
    """auto: replace the DeepSpeed ZeRO-1/2 methods that cost a host sync, fp64 copies or page faults per step
    (engine/deepspeed_compat.py), each only where DeepSpeed's method is the one it was written against (else
    DeepSpeed's own, with a warning line). off: DeepSpeed's own methods throughout, e.g. to compare. The run's
    first lines name the patches in force."""


FP8_ON_CPU = ("engine.precision=fp8 needs a GPU with FP8 tensor cores (H100, H200, L40S, B200), but this run trains "
              "on CPUs: use engine.precision=bf16 (or auto)")


def fp8_problems(engine: EngineConfig, *, use_gpu: bool | str, cluster_gpus: float | None) -> list[str]:
    """engine.precision=fp8 where it cannot run: workers on CPUs (resources.use_gpu false, or auto on a
    cluster without GPUs; a GPU's FP8 tensor cores are checked on one: engine/fp8.py), or blocks left
    uncompiled (float8's scaling then runs unfused, slower than bf16)."""
    if engine.precision != "fp8":
        return []
    problems = []
    if use_gpu is False or (use_gpu == "auto" and cluster_gpus is not None and not cluster_gpus):
        problems.append(FP8_ON_CPU)
    if engine.compile == "off":
        problems.append("engine.precision=fp8 needs compiled blocks (float8's scaling kernels are fused by the compile): "
                        "set engine.compile=auto or on")
    return problems


def wsd_decay_steps(*, optim: OptimConfig, total_steps: int) -> int:
    """Optimizer steps of the wsd decay: optim.decay_steps, or decay_fraction of the run's steps
    (rounded, at least 1)."""
    if optim.decay_steps is not None:
        return optim.decay_steps
    return max(1, round(optim.decay_fraction * total_steps))
