#!/usr/bin/env python3
"""Time the training worker's program on one device, on real data, optionally with a profile: what the
GPU check's engine, width, FP8 and lever stages run (tools/gpu_check.py), one process each.

    python3 tools/train_speed.py --config llama-1b --seq-len 2048 --micro-batch 4 --grad-accum 8 \\
        --steps 7 --warmup 2 --data-cache DIR --out result.json [--set model.num_layers=8 ...] \\
        [--profile-steps 1 --trace trace.json.gz] [--attention] [--compile-scope model] [--sdpa cudnn] [--fp8-emulate]

The program is the one a training worker builds (`engine.program.build_program`: the model, its
compiled blocks and float8 layers as the config says, DeepSpeed ZeRO at the config's precision, one
rank). The batches are the stdlib corpus prepared as training prepares it (`--data-cache`: the
pretrain stage's cache), read in order: runs of the same shape and seed start from the same weights
and see the same tokens, step for step. The first `--warmup` steps are untimed (the first compiles);
the rest are one window, timed as `raytrain-fast bench model` times a round: tokens over the wall
time, one device sync at each end. Each step's loss (the mean of its micro-batches) stays on the
device until the end. A refusal (engine.precision=fp8 without FP8 tensor cores) is one line on stderr,
exit status 2, and {"refused": line} in --out.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's package, as `python3 tools/train_speed.py` runs it

KERNEL_KINDS = (
    # (kind, substrings of a kernel's name), first match wins: attention before matmul, since
    # flash and cutlass attention kernels name their matmuls too.
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "scaled_mm", "matmul", "cublas", "wgmma", "::mm", "addmm", "bmm", "::linear")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl", "allreduce", "all_gather", "reduce_scatter")),
    ("memory copies", ("memcpy", "memset")),
    ("compiled elementwise (triton)", ("triton",)),
    ("other elementwise", ("elementwise", "vectorized", "reduce_kernel", "unrolled", "index", "cat", "copy")),
)
SDPA_OPS = (
    # (aten op, backend), first match wins: the CPU flash op's name holds the CUDA one's.
    ("_scaled_dot_product_flash_attention_for_cpu", "flash (CPU)"),
    ("_scaled_dot_product_cudnn_attention", "cudnn"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "efficient"),
    ("_scaled_dot_product_attention_math", "math"),
    ("flex_attention", "flex"),
)
TOP = 15
TRACE_MAX_BYTES = 15 * 2**20
"""A lent GPU machine hands back files of up to 16 MiB: a larger trace keeps only the GPU's events."""


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in lowered for m in marks)), "other")


def sdpa_backend(op_names: list[str]) -> str | None:
    """Which SDPA kernel ran, from the aten ops a profile recorded (None: no attention op seen)."""
    for op, backend in SDPA_OPS:
        if any(op in name for name in op_names):
            return backend
    return None


def where_time_goes(events: list[tuple[str, float, int]], *, wall_s: float, steps: int) -> dict[str, Any]:
    """From (name, self seconds, calls) of the profiled steps' kernels (CPU ops on a CPU): the TOP by
    time with their share of the step time, and the share of each kind of kernel."""
    ranked = sorted(events, key=lambda e: -e[1])
    kinds: dict[str, float] = {}
    for name, seconds, _ in events:
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + seconds
    busy = sum(seconds for _, seconds, _ in events)
    return {
        "wall_s": wall_s, "steps": steps, "busy_share": busy / wall_s if wall_s else None,
        "top": [{"name": name[:160], "share": seconds / wall_s, "ms_per_step": 1e3 * seconds / steps, "calls_per_step": calls / steps}
                for name, seconds, calls in ranked[:TOP]],
        "kinds": {kind: seconds / wall_s for kind, seconds in sorted(kinds.items(), key=lambda kv: -kv[1])},
    }


def profile_events(profile: Any, *, cuda: bool) -> tuple[list[tuple[str, float, int]], list[str]]:
    """(name, self seconds, calls) of every kernel (CUDA) or CPU op (CPU) the profile holds, and the
    names of the CPU ops (which SDPA backend ran is read from them)."""
    from torch.autograd import DeviceType

    rows, ops = [], []
    for event in profile.key_averages():
        if event.device_type == DeviceType.CPU:
            ops.append(event.key)
        if cuda and event.device_type == DeviceType.CUDA:
            seconds = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
            rows.append((event.key, seconds / 1e6, event.count))
        elif not cuda and event.device_type == DeviceType.CPU and not event.key.startswith("ProfilerStep"):
            rows.append((event.key, event.self_cpu_time_total / 1e6, event.count))
    return [r for r in rows if r[1] > 0], ops


def token_rows(*, seq_len: int, count: int, cache_dir: str) -> Any:
    """`count` rows of seq_len + 1 tokens of the stdlib corpus, prepared as training prepares it, in
    order (from the start again if it holds fewer)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    from raytrain_fast.data import ensure_prepared_corpus, load_manifest

    manifest = load_manifest(ensure_prepared_corpus("stdlib", seq_len=seq_len, cache_dir=cache_dir, verbose=False))
    parts, have = [], 0
    for shard in manifest.shards:
        column = pq.read_table(f"{manifest.root}/{shard.path}", columns=["tokens"]).column("tokens")
        parts.append(np.stack(column.to_numpy(zero_copy_only=False)).astype(np.int64))
        have += len(parts[-1])
        if have >= count:
            break
    rows = np.concatenate(parts)
    return torch.from_numpy(np.resize(rows, (count, seq_len + 1)))


def attention_backends(*, batch: int, heads: int, seq_len: int, head_dim: int, dtype: Any, device: Any) -> dict[str, Any]:
    """Causal SDPA at the model's shape (k, v repeated to every head, as the model does): which backend
    torch picks by itself, and forward + backward milliseconds of each one that runs here."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3))

    def once() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        once()
        sync()
    result: dict[str, Any] = {"shape": [batch, heads, seq_len, head_dim], "dtype": str(dtype).removeprefix("torch."),
                              "default": sdpa_backend([e.key for e in profile.key_averages()]), "ms": {}}
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
    repeats = 10 if device.type == "cuda" else 2
    for name, backend in backends.items():
        try:
            with sdpa_kernel([backend]):
                once()
                sync()
                started = time.perf_counter()
                for _ in range(repeats):
                    once()
                sync()
            result["ms"][name] = round(1e3 * (time.perf_counter() - started) / repeats, 3)
        except RuntimeError as error:  # not available for this shape, dtype or device
            result["ms"][name] = f"unavailable: {str(error).strip().splitlines()[0][:120]}"
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="preset or YAML file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, as pretrain's")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--micro-batch", type=int, required=True)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--steps", type=int, required=True, help="optimizer steps in all, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles)")
    parser.add_argument("--loss-window", type=int, default=4, help="the last N steps' losses make `loss_last`")
    parser.add_argument("--data-cache", required=True, help="where the stdlib corpus is (or gets) prepared")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--compile-scope", choices=("blocks", "model"), default="blocks",
                        help="blocks: as engine.compile says (per block); model: the whole model compiled instead")
    parser.add_argument("--sdpa", choices=("auto", "flash", "cudnn", "efficient", "math"), default="auto",
                        help="the attention kernel for every step (auto: torch's choice)")
    parser.add_argument("--fp8-emulate", action="store_true",
                        help="float8 casts with high-precision matmuls in the blocks' layers (a CPU rehearsal of the FP8 path)")
    parser.add_argument("--profile-steps", type=int, default=0, help="steps profiled after the timed ones")
    parser.add_argument("--trace", help="where the profile's Chrome trace goes (gzipped)")
    parser.add_argument("--attention", action="store_true", help="also time each SDPA backend at the model's attention shape")
    parser.add_argument("--out", required=True, help="the result's JSON file")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from raytrain_fast.errors import ConfigError

    try:
        result = measure(args)
    except ConfigError as refused:
        line = str(refused)
        print(f"error: {line}", file=sys.stderr, flush=True)
        Path(args.out).write_text(json.dumps({"refused": line}))
        return 2
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: result[k] for k in ("tokens_per_sec", "mfu", "step_s", "loss_last", "peak_gb")}), flush=True)
    return 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import dataclasses

    import torch

    from raytrain_fast.config import load_config
    from raytrain_fast.engine import resolve_precision
    from raytrain_fast.engine.process_group import single_process_group
    from raytrain_fast.engine.program import build_program, eager_model, one_process, prepare_process
    from raytrain_fast.metrics.memory import peak_memory_gb, reset_peak_memory
    from raytrain_fast.metrics.peak import datasheet_peak_flops, device_name, matmul_dtype, mfu

    started = time.perf_counter()
    config = load_config(args.config, [f"data.seq_len={args.seq_len}", *args.set])
    model_config = dataclasses.replace(config.model, max_seq_len=max(config.model.max_seq_len, args.seq_len))
    config = one_process(dataclasses.replace(config, model=model_config), micro_batch=args.micro_batch,
                         grad_accum=args.grad_accum, steps=args.steps)
    device = prepare_process(threads=args.threads, seed=config.train.seed)
    cuda = device.type == "cuda"
    precision, _ = resolve_precision(config.engine.precision, use_gpu=cuda)  # fp8 without FP8 tensor cores: refused here
    compile_setting = "off" if args.compile_scope == "model" else config.engine.compile
    config = dataclasses.replace(config, engine=dataclasses.replace(config.engine, precision=precision, compile=compile_setting))
    per_step = args.micro_batch * args.grad_accum
    rows = token_rows(seq_len=args.seq_len, count=args.steps * per_step, cache_dir=args.data_cache)
    batches = rows.view(args.steps, args.grad_accum, args.micro_batch, args.seq_len + 1).to(device)
    single_process_group("nccl" if cuda else "gloo")

    lines: list[str] = []
    model = eager_model(config, device=device)
    if args.fp8_emulate:
        from raytrain_fast.engine.fp8 import convert_blocks

        lines.append(f"FP8 (emulated): {len(convert_blocks(model, emulate=True))} linear layers converted")
    if args.compile_scope == "model":
        from raytrain_fast.engine.deepspeed_compat import run_eagerly_where_compile_fails

        run_eagerly_where_compile_fails()
        model.compile()  # in place, compiled on the first step: one graph for the whole forward
    program = build_program(config, device=device, model=model, say=lines.append)
    engine, model = program.engine, program.model
    # What two runs compare their losses on: the same tokens, from the same initial weights (as
    # trained: a float8 layer keeps its weights in the engine's dtype).
    data_digest = hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16]
    weights_sum = float(sum(p.detach().float().sum() for p in model.parameters()))
    setup_s = time.perf_counter() - started

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    losses = []

    def step(index: int) -> None:
        total = None
        for micro in batches[index]:
            loss = engine(micro[:, :-1], micro[:, 1:])
            engine.backward(loss)
            engine.step()  # the optimizer steps on the last micro-batch
            total = loss.detach() if total is None else total + loss.detach()
        losses.append(total / args.grad_accum)

    attention = None
    kernel = contextlib.nullcontext()
    if args.sdpa != "auto":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kernel = sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                               "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[args.sdpa]])
    warmup_s = []
    with kernel:
        for index in range(args.warmup):
            begun = time.perf_counter()
            step(index)
            sync()
            warmup_s.append(time.perf_counter() - begun)
        reset_peak_memory(device)
        sync()
        begun = time.perf_counter()
        for index in range(args.warmup, args.steps):
            step(index)
        sync()
        timed_s = time.perf_counter() - begun
        peak_gb = peak_memory_gb(device)
        profile = None
        if args.profile_steps:
            profile = profiled(args, step=step, sync=sync, cuda=cuda)
    if args.attention:
        attention = attention_backends(
            batch=args.micro_batch, heads=model.config.num_heads, seq_len=args.seq_len,
            head_dim=model.config.d_model // model.config.num_heads,
            dtype=torch.float32 if precision == "fp32" else torch.bfloat16, device=device,
        )
    timed_steps = args.steps - args.warmup
    tokens_per_sec = timed_steps * per_step * args.seq_len / timed_s if timed_steps else None
    flops = model.flops_per_token(args.seq_len)
    peak = datasheet_peak_flops(device_name(device), matmul_dtype(precision))
    step_losses = [float(x) for x in torch.stack(losses).float().cpu()]  # the one host read of the losses
    window = step_losses[args.warmup:args.steps][-args.loss_window:]
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return {
        "config": args.config, "set": args.set, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "grad_accum": args.grad_accum, "precision": "fp8 (emulated)" if args.fp8_emulate else precision,
        "compile_scope": args.compile_scope if (program.compiled or args.compile_scope == "model") else "off",
        "sdpa": args.sdpa, "device": device_name(device), "torch": torch.__version__, "torchao": _version("torchao"),
        "parameters": sum(p.numel() for p in model.parameters()), "flops_per_token": flops, "lines": lines,
        "data_digest": data_digest, "weights_sum": weights_sum,
        "setup_s": setup_s, "compile_s": warmup_s[0] if warmup_s else None, "warmup_s": warmup_s,
        "timed_steps": timed_steps, "timed_s": timed_s, "step_s": timed_s / timed_steps if timed_steps else None,
        "tokens_per_sec": tokens_per_sec, "datasheet_peak_tflops": peak / 1e12 if peak else None,
        "mfu": mfu(tokens_per_sec=tokens_per_sec, flops_per_token=flops, peak_flops=peak, num_devices=1) if tokens_per_sec else None,
        "losses": step_losses, "loss_last": sum(window) / len(window) if window else None, "peak_gb": peak_gb,
        "profile": profile, "attention": attention,
    }


def profiled(args: argparse.Namespace, *, step: Any, sync: Any, cuda: bool) -> dict[str, Any]:
    """`args.profile_steps` steps under torch's profiler: the Chrome trace (gzipped) and where the time went."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync()
    begun = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profile:
        for index in range(args.profile_steps):
            step(args.steps - args.profile_steps + index)  # steps already timed: the same shapes, nothing new to compile
        sync()
    wall_s = time.perf_counter() - begun
    events, ops = profile_events(profile, cuda=cuda)
    result = where_time_goes(events, wall_s=wall_s, steps=args.profile_steps)
    result["measured"] = "kernels" if cuda else "CPU ops (no kernels on a CPU)"
    result["sdpa_backend"] = sdpa_backend(ops)
    if args.trace:
        raw = f"{args.trace}.json"
        profile.export_chrome_trace(raw)
        with open(raw, "rb") as source, gzip.open(args.trace, "wb", compresslevel=6) as target:
            shutil.copyfileobj(source, target)
        if cuda and os.path.getsize(args.trace) > TRACE_MAX_BYTES:  # the GPU's kernels alone, then
            trace = json.loads(Path(raw).read_text())
            trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") or e.get("ph") == "M"]
            with gzip.open(args.trace, "wt", compresslevel=6) as target:
                json.dump(trace, target)
            result["trace_kernels_only"] = True
        os.unlink(raw)
        result["trace"] = args.trace
        result["trace_mb"] = round(os.path.getsize(args.trace) / 2**20, 2)
    return result


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    sys.exit(main())
