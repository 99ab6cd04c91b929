"""Builds the DeepSpeed config and engine from our config.

deepspeed is imported lazily inside the functions that need it: importing it is slow and has
crashed CPU-only Ray actors, and `DS_ACCELERATOR` must be set before the first import.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch

from raytrain_fast.engine.config import EngineConfig, OptimConfig, wsd_decay_steps


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


def resolve_precision(precision: str, *, use_gpu: bool) -> tuple[str, str]:
    """Turn `auto` into bf16 or fp32 on the hardware of this process (call it where the workers run:
    launch/trainer.py's `resolve_precision_on_a_worker`). Returns (precision, reason) for the log."""
    if precision != "auto":
        return precision, f"engine.precision={precision} (set explicitly)"
    if use_gpu:
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            name = torch.cuda.get_device_name()
            return "fp32", f"this GPU ({name}) has no bf16 support, so training runs in fp32"
        return "bf16", "GPU workers: bf16 with fp32 master weights"
    speedup = measure_cpu_bf16_speedup()
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
        # weights. check_grad_overflow would read a flag back to the host every optimizer step
        # (a host sync); bf16's range makes overflow rare, so it is off unless asked for.
        "bf16": {"enabled": precision == "bf16", "check_grad_overflow": engine.check_grad_overflow},
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


def fused_adamw_supported(device: torch.device | str) -> bool:
    """torch's fused AdamW (one kernel over each flat tensor) runs on CPUs and CUDA GPUs."""
    return torch.device(device).type in ("cpu", "cuda")


def build_optimizer(parameters: list[torch.nn.Parameter], *, optim: OptimConfig, device: torch.device | str) -> torch.optim.Optimizer:
    """torch's AdamW, fused where the device supports it, handed to DeepSpeed as a client optimizer
    (ZeRO then swaps in its fp32 partitions). DeepSpeed's own `torch_adam` option passes only
    `foreach`, and its FusedAdam is JIT-compiled on first use (minutes on a CPU, nvcc on a GPU box).
    Fused vs foreach on this project's 2-core CPU, one AdamW step over one flat fp32 tensor:
    0.30 vs 1.83 ms at 0.8M elements, 14 vs 105 ms at 20M (docs/benchmarks.md)."""
    fused = fused_adamw_supported(device)
    return torch.optim.AdamW(
        parameters, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay,
        **({"fused": True} if fused else {"foreach": True}),
    )


_DECAY_SHAPES = {
    "linear": lambda p: 1.0 - p,
    "cosine": lambda p: 0.5 * (1.0 + math.cos(math.pi * p)),
    "sqrt": lambda p: 1.0 - math.sqrt(p),
}
"""wsd's decay shapes: 1 at progress 0, 0 at progress 1."""


def lr_lambda(*, optim: OptimConfig, total_steps: int):
    """Multiplier of the peak LR at optimizer step s (0-based; the LR logged at step N is factor(N),
    the one the next step uses): linear warmup, then optim.schedule:

    - cosine: cosine from 1 at the end of warmup to min_lr_ratio at total_steps (the default; its
      values are those of every run made before the other schedules, which still resume);
    - wsd: 1 (stable) until the decay's first step, total_steps - decay steps (not before the end of
      warmup), then decay_shape from 1 to min_lr_ratio at total_steps;
    - constant: 1.

    Past total_steps the factor stays at its value there."""
    warmup = optim.warmup_steps
    floor = optim.min_lr_ratio

    def warming(step: int) -> float:
        return (step + 1) / warmup

    if optim.schedule == "constant":
        return lambda step: warming(step) if step < warmup else 1.0

    if optim.schedule == "wsd":
        decay_start = max(warmup, total_steps - wsd_decay_steps(optim=optim, total_steps=total_steps))
        decay_length = max(1, total_steps - decay_start)
        shape = _DECAY_SHAPES[optim.decay_shape]

        def wsd(step: int) -> float:
            if step < warmup:
                return warming(step)
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start) / decay_length)
            return floor + (1.0 - floor) * shape(progress)

        return wsd

    if optim.schedule != "cosine":
        raise ValueError(f"optim.schedule must be cosine, wsd or constant, got {optim.schedule!r}")

    def factor(step: int) -> float:
        if step < warmup:
            return warming(step)
        decay_steps = max(1, total_steps - warmup)
        progress = min(1.0, (step - warmup) / decay_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * cosine

    return factor


def apply_optim_settings(engine: Any, *, optim: OptimConfig, total_steps: int) -> None:
    """Make this run's optim.* settings the engine's, after a checkpoint was loaded into it.

    DeepSpeed's load restores the optimizer's param groups (lr, betas, eps, weight_decay), ZeRO's
    gradient clipping value and the LR scheduler's state, base_lrs (the peak LR) included, from the
    checkpoint: a resume with `--set optim.lr=...` went on with the checkpoint's LR (issue 30). The
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
    scheduler._last_lr = [group["lr"] for group in groups]
    wrapper = getattr(engine, "optimizer", None)  # ZeRO's (or the bf16) optimizer: its clip is restored too
    if wrapper is not None and hasattr(wrapper, "clip_grad"):
        wrapper.clip_grad = optim.grad_clip


def _skip_shm_comm_build() -> None:
    # DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce op on its first process group,
    # even with one rank, where it never communicates: 1-2 minutes on 2 cores on a fresh machine
    # (cached afterwards). With a single worker we mark the op unavailable so it is not built.
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _replace_zero_method(name: str, make, *, needs: tuple[str, ...] = ()) -> None:
    """Set `make(original)` as DeepSpeedZeroOptimizer.<name>, once: only where DeepSpeed has the
    method and every name in `needs` in its stage_1_and_2 module (the ones the replacement uses),
    and not over a replacement already made. The replacement keeps DeepSpeed's own as `_original`,
    which the tests compare against."""
    from deepspeed.runtime.zero import stage_1_and_2

    optimizer_cls = stage_1_and_2.DeepSpeedZeroOptimizer
    original = getattr(optimizer_cls, name, None)
    if original is None or getattr(original, "_raytrain_fast", False):
        return
    if not all(hasattr(stage_1_and_2, needed) for needed in needs):
        return
    replacement = make(original)
    replacement._raytrain_fast = True
    replacement._original = original
    setattr(optimizer_cls, name, replacement)


def _clip_without_host_sync() -> None:
    """DeepSpeed 0.19's ZeRO-1/2 `unscale_and_clip_grads` calls `is_invalid_grad_norm(norm)`, a
    `bool()` of a device tensor, on every optimizer step with gradient clipping on: a host sync
    that stops the CPU from queueing the next step while the GPU works. It only picks an infinite
    clipping norm when the norm is inf/NaN or DeepSpeed's -1 sentinel (which zeroes the update);
    this does the same arithmetic on the device with `torch.where`. Applied once, only where the
    method is the one we read (tests/test_host_reads.py catches a DeepSpeed that changed it).

    It also guards the update (`skip_nonfinite_update`): DeepSpeed calls this right before each
    optimizer step, so an invalid norm turns that step into a no-op on the device."""
    def make(original):
        def unscale_and_clip_grads(self, grad_groups_flat, total_norm):
            skip_nonfinite_update(getattr(self, "optimizer", None), total_norm)
            if self.clip_grad <= 0.0 or not isinstance(total_norm, torch.Tensor):
                return original(self, grad_groups_flat, total_norm)
            invalid = ~torch.isfinite(total_norm) | (total_norm < 0)
            clip_norm = torch.where(invalid, torch.full_like(total_norm, math.inf), total_norm)
            clip = torch.clamp(((clip_norm / self.loss_scale) + 1e-6) / self.clip_grad, min=1.0)
            combined_scale = clip * self.loss_scale
            for grad in grad_groups_flat:
                for part in grad if isinstance(grad, list) else [grad]:
                    part.data.mul_(1.0 / combined_scale)

        return unscale_and_clip_grads

    _replace_zero_method("unscale_and_clip_grads", make, needs=("is_invalid_grad_norm",))


def skip_nonfinite_update(optimizer: Any, total_norm: Any) -> None:
    """Make the next step of a fused torch optimizer a no-op when the gradient norm is inf/NaN or
    DeepSpeed's -1 sentinel, decided on the device: the fused AdamW kernel reads `found_inf` (the
    attribute torch's GradScaler sets) and then leaves the weights, both moments and the step
    count as they were. In bf16 without `engine.check_grad_overflow`, DeepSpeed 0.19's ZeRO-1/2
    never checks the norm, and a NaN gradient reached the fp32 master weights (issue 28). fp32
    runs are skipped by DeepSpeed itself before this is called (a host read per step, its own).
    An unfused optimizer takes no `found_inf`: nothing is set (the loop's health check still sees
    the norm and rolls back)."""
    if not isinstance(total_norm, torch.Tensor) or not getattr(optimizer, "defaults", {}).get("fused"):
        return
    invalid = ~torch.isfinite(total_norm) | (total_norm < 0)
    optimizer.found_inf = invalid.float().reshape(())


_NORM_ROW = 1 << 16
_NORM_CHUNK_CPU = 1 << 18  # a 1 MB fp32 copy at a time: reused from the allocator's cache, no fresh pages


def sum_of_squares(tensor: torch.Tensor) -> torch.Tensor:
    """sum(tensor**2) in fp64 without an fp64 copy of the tensor: 2-norms of rows of 65,536 elements
    in fp32 (torch accumulates an fp32 reduction in fp32, exact enough over a row), squared and
    summed in fp64. bf16/fp16 tensors are read into fp32 a chunk at a time on CPU (a whole tensor at
    a time on a GPU, where the caching allocator makes that copy cheap): a bf16 row norm would round
    to 8 bits. At 120M bf16 elements on this project's 2-core CPU: 29 ms and a relative error under
    1e-5, against 320 ms for DeepSpeed's fp64 copy; a plain fp32 norm over all of them was off by
    1.3%."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype in (torch.float32, torch.float64):
        return _rows_sum_of_squares(flat)
    chunk = flat.numel() if flat.is_cuda else _NORM_CHUNK_CPU
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), chunk):
        total = total + _rows_sum_of_squares(flat[start : start + chunk].float())
    return total


def _rows_sum_of_squares(flat: torch.Tensor) -> torch.Tensor:
    whole = flat.numel() // _NORM_ROW * _NORM_ROW
    total = flat[whole:].double().square().sum()
    if whole:
        total = total + torch.linalg.vector_norm(flat[:whole].view(-1, _NORM_ROW), dim=1).double().square().sum()
    return total


def _grad_norm_without_fp64_copies() -> None:
    """DeepSpeed 0.19's ZeRO-1/2 `get_grad_norm_direct` computes the 2-norm of every gradient from
    an fp64 copy of it (`get_norm_dtype()`): 1 GB of fresh memory per optimizer step at 124M
    parameters, about half of the optimizer step's time on CPU (profiled: 0.45 s of 0.75 s) and 8
    bytes written per parameter on a GPU. This computes the same norm with `sum_of_squares`, the
    total's dtype, reduction and NaN/inf masking as DeepSpeed's. Only the 2-norm without model or
    pipeline parallelism is replaced; anything else goes to DeepSpeed's own."""
    from deepspeed.runtime.zero import stage_1_and_2

    def make(original):
        def get_grad_norm_direct(self, gradients, params, norm_type=2):
            if float(norm_type) != 2.0 or self.model_parallel_rank != 0 or stage_1_and_2.pg_utils.is_parallel(self.model_parallel_group):
                return original(self, gradients, params, norm_type)
            pairs = zip((g for g in gradients if not getattr(g, "_zero_padding", False)), params)
            squares = [sum_of_squares(g) for g, p in pairs if not getattr(p, stage_1_and_2.PIPE_REPLICATED, False)]
            if squares:
                total = torch.stack(squares).sum().float()
            else:
                total = torch.tensor(0.0, dtype=torch.float32).to(self.device)
            stage_1_and_2.dist.all_reduce(total, op=stage_1_and_2.dist.ReduceOp.SUM, group=self.dp_process_group)
            total = total.pow(0.5)
            stage_1_and_2.mask_nan_or_inf_with_val_inplace(total, device=self.device)
            return total

        return get_grad_norm_direct

    _replace_zero_method("get_grad_norm_direct", make, needs=("mask_nan_or_inf_with_val_inplace", "PIPE_REPLICATED"))


def _fp32_grads_in_a_kept_buffer() -> None:
    """On CPU, DeepSpeed 0.19's ZeRO-1/2 `step` flattens the bf16 gradients of the rank's partition
    into a new buffer (`flatten`) and converts that into a second, fp32 one (`.to(fp32)`): 6 bytes
    per parameter of fresh memory on every optimizer step. glibc returns blocks that large (over
    32 MB, or 64 MB in a thread's arena) to the kernel when they are freed, so each step pays a
    page fault for every 4 KB written: measured with `perf record -e page-faults` in a training
    worker (25.4M parameters, bf16), 85% of its 35,000 faults a second came from those two copies,
    and 5-7% of the worker's CPU time was kernel time.

    DeepSpeed's step takes a pre-flattened gradient partition where `_get_preflattened_grad_partition`
    returns one (a hook for DeepCompile). On CPU this returns the partition's gradients copied into a
    buffer in the fp32 master weights' dtype that is kept between steps: `.to(fp32)` is then a no-op,
    one copy is made instead of two, into pages already mapped. The cost is that buffer, 4 bytes per
    parameter of the partition, held for the run. On a GPU (the caching allocator keeps its blocks)
    and wherever DeepSpeed already has a pre-flattened partition, nothing changes."""
    from deepspeed.runtime.zero import stage_1_and_2

    def make(original):
        def _get_preflattened_grad_partition(self, group_idx):
            found = original(self, group_idx)
            grads = self.averaged_gradients[group_idx]
            if found is not None or self.cpu_offload or not isinstance(grads, list) or not grads:
                return found
            if grads[0].device.type != "cpu":
                return None
            size = int(self.partition_size[group_idx])
            dtype = self.single_partition_of_fp32_groups[group_idx].dtype
            kept = self.__dict__.setdefault("_raytrain_fast_grad_buffers", {})
            buffer = kept.get(group_idx)
            if buffer is None or buffer.numel() != size or buffer.dtype != dtype:
                buffer = kept[group_idx] = torch.empty(size, dtype=dtype, device=grads[0].device)
            offset = 0
            for grad in grads:
                count = grad.numel()
                if offset + count > size:
                    return None  # not a partition: DeepSpeed's own flatten (and its assertion)
                buffer.narrow(0, offset, count).view_as(grad).copy_(grad)
                offset += count
            group = self.real_dp_process_group[group_idx]
            last = stage_1_and_2.dist.get_rank(group=group) == stage_1_and_2.dist.get_world_size(group=group) - 1
            if offset < size:
                if not last:
                    return None  # only the last partition is padded (flatten_dense_tensors_aligned)
                buffer.narrow(0, offset, size - offset).zero_()
            return buffer

        return _get_preflattened_grad_partition

    _replace_zero_method("_get_preflattened_grad_partition", make)


_WIDER_OR_SAME = {
    torch.bfloat16: (torch.bfloat16, torch.float32, torch.float64),
    torch.float16: (torch.float16, torch.float32, torch.float64),
    torch.float32: (torch.float32, torch.float64),
}


def _no_all_reduce_over_one_rank() -> None:
    """With one worker, DeepSpeed 0.19's ZeRO-2 still "reduces" the gradients after each backward
    (`allreduce_and_copy`, without contiguous gradients): it flattens every gradient into a new
    buffer, divides it by a world size of 1, all-reduces it over one rank and copies it back. The
    result is the gradients it started from, bit for bit, and on CPU the new buffer costs a page
    fault per 4 KB (the rest of the faults `_fp32_grads_in_a_kept_buffer` describes). This skips the
    call exactly when it is that identity: a one-rank group, no sequence parallelism, no output
    buffers to add into, and a communication dtype that holds every gradient's exactly."""
    from deepspeed.runtime.zero import stage_1_and_2

    def make(original):
        def allreduce_and_copy(self, small_bucket, communication_data_type, rank=None, log=None, divide=True,
                               process_group=None, output_bucket=None):
            group = self.dp_process_group if process_group is None else process_group
            if (
                stage_1_and_2.dist.get_world_size(group=group) == 1
                and getattr(self, "sequence_parallel_size", 1) == 1
                and not getattr(stage_1_and_2, "pg_correctness_test", True)
                and (output_bucket is None or all(output is None for output in output_bucket))
                and all(communication_data_type in _WIDER_OR_SAME.get(t.dtype, ()) for t in small_bucket)
            ):
                return None
            return original(self, small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                            process_group=process_group, output_bucket=output_bucket)

        return allreduce_and_copy

    _replace_zero_method("allreduce_and_copy", make)


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
):
    """deepspeed.initialize on an already-initialised process group (TorchTrainer made it)."""
    if select_accelerator() == "cpu" and world_size == 1:
        _skip_shm_comm_build()
    import deepspeed

    _clip_without_host_sync()
    _grad_norm_without_fp64_copies()
    _fp32_grads_in_a_kept_buffer()
    _no_all_reduce_over_one_rank()
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
