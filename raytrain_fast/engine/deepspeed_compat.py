"""Every change this package makes to DeepSpeed, and every private name of DeepSpeed or torch it
touches, fenced: one place, each checked before it is made.

DeepSpeed 0.19's ZeRO-1/2 optimizer costs a host sync, fp64 copies and page faults per step that the
package removes by replacing four `DeepSpeedZeroOptimizer` methods (each docstring says what it saves
and how that was measured); it JIT-builds a shared-memory op a one-rank CPU group never uses; and it
all-gathers through a torch function torch 2.13 deprecates. All of it is process-global, so each
replacement is made only where the method is the one it was written against (the same signature and
source sha256 as on `TESTED_DEEPSPEED`) and every module-level name it uses exists; else DeepSpeed's
own stays, with one warning line naming the method and why. `engine.deepspeed_patches: off` turns
them all off; `apply_patches` returns those in force, for the startup line. After the patches: the
private attributes set after a checkpoint load, DeepSpeed's names for its per-rank checkpoint files
and torch's compiler switch, each with a fallback and one warning line.
"""
from __future__ import annotations

import glob
import hashlib
import inspect
import logging
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from raytrain_fast.console import say

TESTED_DEEPSPEED = ("0.19.8",)
"""The DeepSpeed releases the patches were read against and CI runs (pyproject.toml caps the range)."""

TESTED_TORCH = ("2.13.0",)
"""The torch releases whose private names below were read (`_last_lr`, `torch._dynamo.config`)."""

PatchMode = Literal["auto", "off"]


def skip_nonfinite_update(optimizer: Any, total_norm: Any) -> None:
    """Make the next step of a fused torch optimizer a no-op when the gradient norm is inf/NaN or
    DeepSpeed's -1 sentinel, decided on the device: the fused AdamW kernel reads `found_inf` (the
    attribute torch's GradScaler sets) and then leaves the weights, both moments and the step
    count as they were. In bf16 without `engine.check_grad_overflow`, DeepSpeed 0.19's ZeRO-1/2
    never checks the norm, and a NaN gradient reached the fp32 master weights. fp32
    runs are skipped by DeepSpeed itself before this is called (a host read per step, its own).
    An unfused optimizer takes no `found_inf`: nothing is set (the loop's health check still sees
    the norm and rolls back)."""
    if not isinstance(total_norm, torch.Tensor) or not getattr(optimizer, "defaults", {}).get("fused"):
        return
    invalid = ~torch.isfinite(total_norm) | (total_norm < 0)
    optimizer.found_inf = invalid.float().reshape(())


def _clip_without_host_sync(original: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed 0.19's ZeRO-1/2 `unscale_and_clip_grads` calls `is_invalid_grad_norm(norm)`, a
    `bool()` of a device tensor, on every optimizer step with gradient clipping on: a host sync
    that stops the CPU from queueing the next step while the GPU works. It only picks an infinite
    clipping norm when the norm is inf/NaN or DeepSpeed's -1 sentinel (which zeroes the update);
    this does the same arithmetic on the device with `torch.where`. Applied only where the
    method is the one we read (its source hash); tests/test_host_reads.py counts the reads.

    It also guards the update (`skip_nonfinite_update`): DeepSpeed calls this right before each
    optimizer step, so an invalid norm turns that step into a no-op on the device."""
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


def _grad_norm_without_fp64_copies(original: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed 0.19's ZeRO-1/2 `get_grad_norm_direct` computes the 2-norm of every gradient from
    an fp64 copy of it (`get_norm_dtype()`): 1 GB of fresh memory per optimizer step at 124M
    parameters, about half of the optimizer step's time on CPU (profiled: 0.45 s of 0.75 s) and 8
    bytes written per parameter on a GPU. This computes the same norm with `sum_of_squares`, the
    total's dtype, reduction and NaN/inf masking as DeepSpeed's. Only the 2-norm without model or
    pipeline parallelism is replaced; anything else goes to DeepSpeed's own."""
    from deepspeed.runtime.zero import stage_1_and_2

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


def _fp32_grads_in_a_kept_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _no_all_reduce_over_one_rank(original: Callable[..., Any]) -> Callable[..., Any]:
    """With one worker, DeepSpeed 0.19's ZeRO-2 still "reduces" the gradients after each backward
    (`allreduce_and_copy`, without contiguous gradients): it flattens every gradient into a new
    buffer, divides it by a world size of 1, all-reduces it over one rank and copies it back. The
    result is the gradients it started from, bit for bit, and on CPU the new buffer costs a page
    fault per 4 KB (the rest of the faults `_fp32_grads_in_a_kept_buffer` describes). This skips the
    call exactly when it is that identity: a one-rank group, no sequence parallelism, no output
    buffers to add into, and a communication dtype that holds every gradient's exactly."""
    from deepspeed.runtime.zero import stage_1_and_2

    def allreduce_and_copy(self, small_bucket, communication_data_type, rank=None, log=None, divide=True,
                           process_group=None, output_bucket=None):
        group = self.dp_process_group if process_group is None else process_group
        if (
            stage_1_and_2.dist.get_world_size(group=group) == 1
            and getattr(self, "sequence_parallel_size", 1) == 1
            and not getattr(stage_1_and_2, "pg_correctness_test", True)
            and (output_bucket is None or all(output is None for output in output_bucket))
            and all(torch.promote_types(t.dtype, communication_data_type) == communication_data_type
                    for t in small_bucket)
        ):
            return None
        return original(self, small_bucket, communication_data_type, rank=rank, log=log, divide=divide,
                        process_group=process_group, output_bucket=output_bucket)

    return allreduce_and_copy


def _gather_with_the_current_api(original: Callable[..., Any]) -> Callable[..., Any]:
    """DeepSpeed 0.19's `TorchBackend.get_all_gather_function` picks `torch.distributed.all_gather_into_tensor`,
    which torch 2.13 deprecates for `all_gather_single` (the same arguments): every rank of a multi-worker
    run printed a FutureWarning on its first ZeRO all-gather. The chooser returns `all_gather_single`
    instead (backends made after this use it); only where torch has it."""
    import torch.distributed

    def get_all_gather_function(cls):
        return torch.distributed.all_gather_single

    return get_all_gather_function


@dataclass(frozen=True, kw_only=True)
class ZeroPatch:
    """One replacement of a DeepSpeed method (a `DeepSpeedZeroOptimizer`'s unless `owner` says another
    class), and what must hold for it to be made."""

    name: str
    """What the startup line calls it."""
    method: str
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    signature: str
    """`str(inspect.signature(original))` of DeepSpeed's method on the tested versions."""
    source_sha256: frozenset[str]
    """sha256 of `inspect.getsource(original)` on the tested versions: any change to the method, not
    only to its signature, keeps DeepSpeed's own."""
    needs: tuple[str, ...] = ()
    """Module-level names of the owner's module the replacement uses."""
    owner: str = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
    """`module:class` whose attribute `method` is replaced."""
    applies: Callable[[], bool] = lambda: True
    """False where the patch has nothing to do (nothing is replaced and nothing is warned)."""


PATCHES: tuple[ZeroPatch, ...] = (
    ZeroPatch(
        name="clip-without-host-sync", method="unscale_and_clip_grads", make=_clip_without_host_sync,
        signature="(self, grad_groups_flat, total_norm)",
        source_sha256=frozenset({"6bf2ce6f97eafcc24c08a0355e7c180992c8e86da5b7f02026eef6fbd68efa74"}),
    ),
    ZeroPatch(
        name="grad-norm-without-fp64-copies", method="get_grad_norm_direct", make=_grad_norm_without_fp64_copies,
        signature="(self, gradients, params, norm_type=2)",
        source_sha256=frozenset({"72af0993ad8cde2c5bc83a38b1040c7b90e84f07bd5ce72399c144a07ec4ba9a"}),
        needs=("pg_utils", "dist", "PIPE_REPLICATED", "mask_nan_or_inf_with_val_inplace"),
    ),
    ZeroPatch(
        name="kept-fp32-grad-buffer", method="_get_preflattened_grad_partition", make=_fp32_grads_in_a_kept_buffer,
        signature="(self, group_idx)",
        source_sha256=frozenset({"5efe338fec797de25d79d5409bd3b0ec140f943ee9ae830e83398ebb43a7b6f5"}),
        needs=("dist",),
    ),
    ZeroPatch(
        name="no-all-reduce-over-one-rank", method="allreduce_and_copy", make=_no_all_reduce_over_one_rank,
        signature=("(self, small_bucket, communication_data_type: torch.dtype, rank=None, log=None, divide=True, "
                   "process_group=None, output_bucket=None)"),
        source_sha256=frozenset({"1db38d57186c09f402d1907a50a545961d1a4d8ba4cc0a18fdb5f5c5b03e0d4e"}),
        needs=("dist",),
    ),
    ZeroPatch(
        name="current-all-gather-api", method="get_all_gather_function", make=_gather_with_the_current_api,
        owner="deepspeed.comm.torch:TorchBackend", signature="()",
        applies=lambda: hasattr(torch.distributed, "all_gather_single"),  # older torch: nothing deprecated to avoid
        source_sha256=frozenset({"8db96204e5d658bdf9a8d4b2aca4aa6e9b38ec3f57114ab8472d46fdeefa4942"}),
    ),
)
GATHER_PATCH = "current-all-gather-api"


def _owner(patch: ZeroPatch) -> tuple[Any, Any]:
    """The patched class's module and the class."""
    import importlib

    module_name, class_name = patch.owner.split(":")
    module = importlib.import_module(module_name)
    return module, getattr(module, class_name)


def _deepspeed_version() -> str:
    """From DeepSpeed's package metadata: importing it costs seconds and must follow DS_ACCELERATOR."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("deepspeed")
    except PackageNotFoundError:
        return "unknown"


def patch_problem(patch: ZeroPatch, original: Any, module: Any) -> str | None:
    """Why `patch` must not replace `original` (DeepSpeed's method), or None where it may."""
    if original is None:
        return "the method does not exist"
    try:
        signature, source = str(inspect.signature(original)), inspect.getsource(original)
    except (TypeError, ValueError, OSError) as exc:
        return f"its source cannot be read ({exc})"
    if signature != patch.signature:
        return f"its signature is {signature}, not {patch.signature}"
    missing = [name for name in patch.needs if not hasattr(module, name)]
    if missing:
        return f"{module.__name__.rsplit('.', 1)[-1]} has no {', '.join(missing)}"
    if hashlib.sha256(source.encode()).hexdigest() not in patch.source_sha256:
        return "its source differs from the one the replacement was written against"
    return None


def install(patch: ZeroPatch, *, warn: Callable[[str], None] = say) -> bool:
    """Replace the method, once (never over our own replacement), when `patch_problem` finds
    nothing; else keep DeepSpeed's own and warn once with the reason. True when ours is in force.
    A classmethod is replaced by a classmethod of the replacement."""
    module, cls = _owner(patch)
    raw = inspect.getattr_static(cls, patch.method, None)
    if getattr(raw, "_raytrain_fast", False):
        return True
    if not patch.applies():
        return False
    problem = patch_problem(patch, getattr(cls, patch.method, None), module)
    if problem is not None:
        if patch.name not in _WARNED:
            _WARNED.add(patch.name)
            warn(f"DeepSpeed {_deepspeed_version()}: not patching {cls.__name__}.{patch.method} ({patch.name}): "
                 f"{problem}; DeepSpeed's own runs (tested on {', '.join(TESTED_DEEPSPEED)}).")
        return False
    if isinstance(raw, classmethod):
        replacement = classmethod(patch.make(raw.__func__))
    else:
        replacement = patch.make(raw)
    replacement._raytrain_fast = True
    replacement._original = raw
    setattr(cls, patch.method, replacement)
    return True


_WARNED: set[str] = set()


def uninstall(patch: ZeroPatch) -> None:
    """Put DeepSpeed's own method back (engine.deepspeed_patches: off after a run that patched)."""
    _, cls = _owner(patch)
    raw = inspect.getattr_static(cls, patch.method, None)
    if getattr(raw, "_raytrain_fast", False):
        setattr(cls, patch.method, raw._original)


def skip_shm_comm_build() -> bool:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory allreduce op on its first process group,
    even with one rank, where it never communicates: 1-2 minutes on 2 cores on a fresh machine
    (cached afterwards). Marking the op unavailable in `deepspeed.ops.__compatible_ops__` keeps it
    from being built; only for a one-rank CPU group, and only where that table has the op."""
    import deepspeed.ops

    table = getattr(deepspeed.ops, "__compatible_ops__", None)
    if not isinstance(table, dict) or "deepspeed_shm_comm" not in table:
        return False
    table["deepspeed_shm_comm"] = False
    return True


def _held_open(paths: set[str]) -> set[str] | None:
    """Which of `paths` some process on this machine holds open (from /proc/<pid>/fd); None where
    that can't be told (no /proc, or a process whose descriptors this user can't read)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    held: set[str] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        except PermissionError:
            return None
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target in paths:
                held.add(target)
    return held


def clear_stale_build_locks(*, warn: Callable[[str], None] = say, unknown_after_s: float = 900.0) -> list[str]:
    """Remove the lock files of torch JIT extension builds (DeepSpeed's ops) whose builder is gone.

    torch's `FileBaton` creates `<TORCH_EXTENSIONS_DIR>/<python>_<device>/<op>/lock` and holds it open
    while the op compiles; every other process that loads the op waits, with no time limit and no
    output, until the file is removed. A build killed part-way (Ctrl-C, a worker lost, a machine
    stopped) leaves the file behind, and every later run on the machine then hangs before its first
    step. A lock no process on this machine holds open is stale and removed, with one line naming it;
    where open files can't be read (no /proc, another user's processes), only a lock older than
    `unknown_after_s` is. The removed paths."""
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    seen = {}  # each lock as found, so one made anew meanwhile (its builder just started) is kept
    for pattern in ("*/lock", "*/*/lock"):
        for path in glob.glob(os.path.join(root, pattern)):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            seen[os.path.realpath(path)] = (st.st_ino, st.st_mtime_ns)
    if not seen:
        return []
    held = _held_open(set(seen))
    removed = []
    for lock, identity in sorted(seen.items()):
        try:
            st = os.stat(lock)
        except FileNotFoundError:
            continue
        age = time.time() - st.st_mtime
        if (st.st_ino, st.st_mtime_ns) != identity or (held is not None and lock in held) or (held is None and age < unknown_after_s):
            continue
        try:
            os.remove(lock)
        except FileNotFoundError:
            continue
        removed.append(lock)
        warn(f"Removed a stale build lock no process holds ({lock}, {age / 60:.0f} min old): a killed JIT build of "
             f"{os.path.basename(os.path.dirname(lock))} left it, and every run would wait on it forever.")
    return removed


def apply_patches(mode: PatchMode = "auto", *, warn: Callable[[str], None] = say) -> list[str]:
    """Make (auto) or undo (off) every replacement; the names of those in force."""
    if mode == "off":
        for patch in PATCHES:
            uninstall(patch)
        return []
    return [patch.name for patch in PATCHES if install(patch, warn=warn)]


def active_patches() -> list[str]:
    """The replacements in force in this process."""
    return [p.name for p in PATCHES if getattr(inspect.getattr_static(_owner(p)[1], p.method, None), "_raytrain_fast", False)]


def patches_line(active: list[str], *, mode: PatchMode, shm_skipped: bool = False) -> str:
    """The one startup line: DeepSpeed's version and the patches in force."""
    version = _deepspeed_version()
    if mode == "off":
        return f"DeepSpeed {version}: no patches (engine.deepspeed_patches=off)."
    names = active + (["no-shm-comm-build"] if shm_skipped else [])
    tested = "" if version in TESTED_DEEPSPEED else f"; tested on {', '.join(TESTED_DEEPSPEED)}"
    return (f"DeepSpeed {version}: {len(names)} patch(es) in force: {', '.join(names) or 'none'} "
            f"(engine.deepspeed_patches=auto, docs/architecture.md#deepspeed-patches{tested}).")


def write_checkpoints_in_background(engine: Any, writer: Any, *, warn: Callable[[str], None] = say) -> bool:
    """Route a DeepSpeed engine's checkpoint file writes through `writer` (checkpoint/snapshot.py:
    a snapshot in memory, serialized by a background thread) instead of its inline `torch.save`.

    DeepSpeed 0.19's engine writes every checkpoint file through `engine.checkpoint_engine.save(state_dict,
    path)`, a `TorchCheckpointEngine` unless its config asks for another; loading goes through the
    same object. Only that default engine is replaced, by a subclass that keeps its loading and
    hands `save` to the writer. Anything else (another DeepSpeed release without the attribute, a
    configured Nebula or fast engine) keeps DeepSpeed's own, with one warning line, and the save
    blocks as before. Returns whether the writer is in use."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    current = getattr(engine, "checkpoint_engine", None)
    if type(current) is not TorchCheckpointEngine:
        warn(f"Checkpoint files are written inline (training waits for the disk): DeepSpeed's checkpoint engine "
             f"is {type(current).__name__}, not the TorchCheckpointEngine this package writes in the background for")
        return False

    class BackgroundCheckpointEngine(TorchCheckpointEngine):
        def __init__(self) -> None:  # noqa: D107 - the loading half is TorchCheckpointEngine's, as configured
            self.__dict__.update(current.__dict__)

        def save(self, state_dict, path: str) -> None:
            writer.save(state_dict, path)

    engine.checkpoint_engine = BackgroundCheckpointEngine()
    return True


# --- private attributes and names, outside the method patches -----------------------------------

_logger = logging.getLogger("raytrain_fast.compat")


def _fallback(key: str, message: str) -> None:
    """One warning line per process for a fallback taken (`key` names it)."""
    if key not in _WARNED:
        _WARNED.add(key)
        _logger.warning("%s (read on DeepSpeed %s, torch %s).", message, ", ".join(TESTED_DEEPSPEED), ", ".join(TESTED_TORCH))


def set_last_lr(scheduler: Any, values: list[float]) -> bool:
    """Make a torch LR scheduler's record of its last LR (`_last_lr`, what `get_last_lr()` returns)
    the LRs just set by hand. A torch without it: nothing set, one warning line."""
    if not hasattr(scheduler, "_last_lr"):
        _fallback("last-lr", f"{type(scheduler).__name__} has no _last_lr: get_last_lr() keeps the checkpoint's LR until the next step")
        return False
    scheduler._last_lr = list(values)
    return True


def set_clip_grad(optimizer: Any, value: float) -> bool:
    """Set the clipping value of DeepSpeed's ZeRO or bf16 optimizer (`clip_grad`, which its checkpoint
    load restores); None is nothing to set. Without the attribute: left as loaded, one warning line."""
    if optimizer is None:
        return False
    if not hasattr(optimizer, "clip_grad"):
        _fallback("clip-grad", f"DeepSpeed's {type(optimizer).__name__} has no clip_grad: a resumed run clips gradients at "
                  "its checkpoint's value, not optim.grad_clip")
        return False
    optimizer.clip_grad = value
    return True


def run_eagerly_where_compile_fails() -> bool:
    """torch.compile: an op the compiler cannot take runs eagerly instead of raising
    (`torch._dynamo.config.suppress_errors`). Without the switch: it raises, one warning line."""
    import torch._dynamo

    config = getattr(torch._dynamo, "config", None)
    if not hasattr(config, "suppress_errors"):
        _fallback("suppress-errors", "torch has no torch._dynamo.config.suppress_errors: an op the compiler cannot take "
                  "fails the run instead of running eagerly (engine.compile=off avoids it)")
        return False
    config.suppress_errors = True
    return True


# --- DeepSpeed's checkpoint files: their names, the consolidation of a save, the universal form -------

ZERO_SHARD_FILE = re.compile(r"(?:^|/)(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$")
"""A data-parallel rank's own checkpoint file: its optimizer shard (under ZeRO-3 also its part of the
model states), as DeepSpeed 0.19.8's private `DeepSpeedEngine._get_rank_zero_ckpt_name` names it
(tests/test_compat_fallbacks.py checks). A rank resuming at the same world size opens only its own
(`_get_all_zero_checkpoint_state_dicts` without elastic_checkpoint; the others' names are only
tested with os.path.exists, which tolerates their absence)."""
MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
"""Rank 0's module weights (under the key "module") in a save without model or pipeline
parallelism, as DeepSpeed 0.19.8's `_get_ckpt_name` names it."""
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
"""Parameter-name prefixes of the wrappers around a saved model: DeepSpeed's and DDP's `module`, and
the `_orig_mod` of torch.compile's OptimizedModule (read on torch 2.13; the package compiles blocks in
place, so only a model compiled whole by other code has it). Another wrapper's prefix fails the strict load."""


def _names_read_on_another_deepspeed(what: str) -> None:
    version = _deepspeed_version()
    if version not in TESTED_DEEPSPEED:
        _fallback("file-names", f"DeepSpeed {version}: {what} by the names DeepSpeed {TESTED_DEEPSPEED[-1]} gives its files")


def zero_shard_rank(relative: str) -> int | None:
    """The rank whose DeepSpeed shard `relative` is, or None for a file every rank loads. On an
    untested DeepSpeed, one warning line: a shard named otherwise is downloaded by every rank."""
    _names_read_on_another_deepspeed("checkpoint shards are told apart (one named otherwise is downloaded by every rank)")
    match = ZERO_SHARD_FILE.search(relative)
    return int(match.group(1)) if match else None


def saved_weights(checkpoint_dir: str, *, tag: str) -> tuple[dict[str, Any], str] | None:
    """(the model's fp32 weights, where they came from) from a downloaded DeepSpeed save under
    `checkpoint_dir/tag`: the master weights consolidated from the ZeRO optimizer shards (DeepSpeed's
    `zero_to_fp32`, which prints and draws progress bars: redirect them), else rank 0's module weights;
    names without wrapper prefixes. None where the save holds neither."""
    from pathlib import Path

    _names_read_on_another_deepspeed("a save's weights are found")
    saved = Path(checkpoint_dir, tag)
    if any(ZERO_SHARD_FILE.search(path.name) and "_optim_" in path.name for path in saved.iterdir()):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
        source = "fp32 master weights from the ZeRO optimizer shards"
    elif (saved / MODEL_STATES_FILE).exists():
        # weights_only=False: DeepSpeed pickles its own objects in here; the file comes from a verified checkpoint.
        state = torch.load(saved / MODEL_STATES_FILE, map_location="cpu", weights_only=False)["module"]
        state = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
        source = f"module weights from {MODEL_STATES_FILE}"
    else:
        return None
    return {_unwrapped(key): value for key, value in state.items()}, source


def _unwrapped(key: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        key = key.removeprefix(prefix)
    return key


UNIVERSAL_FLAGS = ("--num_extract_workers", "1", "--num_merge_workers", "1", "--inject_missing_state")
"""ds_to_universal's command-line flags (DeepSpeed's universal checkpointing tutorial runs it as a
script): one worker each (no process pool inside a Ray worker); the model carries no
universal_checkpoint_info (plain data parallelism), so the missing state is injected."""


def convert_to_universal(input_folder: str, output_folder: str) -> None:
    """DeepSpeed's `ds_to_universal` from the save in `input_folder` into `output_folder`, in this
    process: its flags parsed by its own `parse_arguments` (a release that adds one gets its
    default), then its `main`, as its script does (read on DeepSpeed 0.19.8). Where either is
    missing: its script in a subprocess, with one warning line. Its `latest_universal` marker beside
    `output_folder` is removed. Raises RuntimeError with what it printed when it fails."""
    import contextlib
    import io
    import subprocess
    import sys
    from pathlib import Path

    from deepspeed.checkpoint import ds_to_universal

    flags = ["--input_folder", input_folder, "--output_folder", output_folder, *UNIVERSAL_FLAGS]
    parse, main = getattr(ds_to_universal, "parse_arguments", None), getattr(ds_to_universal, "main", None)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            if parse is None or main is None:
                _fallback("ds-to-universal", "DeepSpeed's ds_to_universal has no parse_arguments/main: it runs as a script")
                done = subprocess.run([sys.executable, "-m", ds_to_universal.__name__, *flags], capture_output=True, text=True)
                log.write(done.stdout + done.stderr)
                if done.returncode:
                    raise RuntimeError(f"ds_to_universal exited with {done.returncode}")
            else:
                argv, sys.argv = sys.argv, ["ds_to_universal", *flags]  # its parser reads sys.argv only
                try:
                    args = parse()
                finally:
                    sys.argv = argv
                main(args)
    except (Exception, SystemExit) as error:  # SystemExit: its parser refused the flags
        raise RuntimeError(f"{error!r}. DeepSpeed said: {log.getvalue()[-800:]}") from error
    (Path(output_folder).parent / "latest_universal").unlink(missing_ok=True)
