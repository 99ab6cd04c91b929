"""Peak FLOP/s for MFU: a datasheet table keyed by device name and dtype, and a measured matmul peak.

MFU = achieved training FLOP/s / peak FLOP/s. The datasheet peak is the usual denominator, but it
exists only for the accelerators listed here (and never for CPUs): anything else gets `None`, never a
guess. The measured peak (large square matmuls in the dtype training uses) works everywhere,
CPUs included, and shows how close the loop gets to what this device really sustains.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import platform
import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TERA = 1e12
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Datasheet:
    """Dense (no 2:4 sparsity) tensor-core peaks in TFLOP/s, and the plain FP32 (non-tensor) peak."""

    bf16: float
    fp16: float
    tf32: float
    fp32: float
    source: str


# Ordered: the first pattern that matches `torch.cuda.get_device_name()` wins. Names seen in the wild:
# "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3" (SXM), "NVIDIA H100 PCIe",
# "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA L4", "NVIDIA L40S", "NVIDIA A10G".
# \b keeps "GH200" from matching H200 and "L40S" from matching L4.
# NVIDIA datasheets list tensor-core figures "with sparsity" (marked *); those are halved here, since
# training does not use 2:4 structured sparsity. The figures as printed in each datasheet are in the comments.
_TABLE: tuple[tuple[re.Pattern[str], _Datasheet | None], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), sheet)
    for pattern, sheet in (
        # H200 NVL: BF16 1,671*, TF32 835*, FP32 60
        (r"\bH200\b.*\bNVL\b", _Datasheet(835.5, 835.5, 417.5, 60.0, "NVIDIA H200 Tensor Core GPU datasheet (NVL)")),
        # H200 SXM: same compute as H100 SXM (BF16 1,979*, TF32 989*, FP32 67)
        (r"\bH200\b", _Datasheet(989.5, 989.5, 494.5, 67.0, "NVIDIA H200 Tensor Core GPU datasheet (SXM)")),
        # H100 NVL (per GPU): BF16 1,671*, TF32 835*, FP32 60
        (r"\bH100\b.*\bNVL\b", _Datasheet(835.5, 835.5, 417.5, 60.0, "NVIDIA H100 Tensor Core GPU datasheet (NVL)")),
        # H100 PCIe: BF16 1,513*, TF32 756*, FP32 51
        (r"\bH100\b.*\bPCIe\b", _Datasheet(756.5, 756.5, 378.0, 51.0, "NVIDIA H100 Tensor Core GPU datasheet (PCIe)")),
        # H100 SXM: BF16 1,979*, TF32 989*, FP32 67
        (r"\bH100\b.*(\bSXM|\bHBM3\b)",
         _Datasheet(989.5, 989.5, 494.5, 67.0, "NVIDIA H100 Tensor Core GPU datasheet (SXM)")),
        # A100 40GB/80GB, SXM and PCIe alike: BF16 312 (624*), TF32 156 (312*), FP32 19.5
        (r"\bA100\b", _Datasheet(312.0, 312.0, 156.0, 19.5, "NVIDIA A100 Tensor Core GPU datasheet")),
        # L40S: BF16 362.05 (733*), TF32 183 (366*), FP32 91.6
        (r"\bL40S\b", _Datasheet(362.05, 362.05, 183.0, 91.6, "NVIDIA L40S GPU datasheet")),
        # L40: BF16 181.05 (362.1*), TF32 90.5 (181*), FP32 90.5
        (r"\bL40\b", _Datasheet(181.05, 181.05, 90.5, 90.5, "NVIDIA L40 GPU datasheet")),
        # L4: BF16 242*, TF32 120*, FP32 30.3
        (r"\bL4\b", _Datasheet(121.0, 121.0, 60.0, 30.3, "NVIDIA L4 Tensor Core GPU datasheet")),
        # The A10G is an AWS-only variant of the A10 with different tensor-core throughput; NVIDIA
        # publishes no datasheet for it, so there is no honest figure: MFU against the measured peak only.
        (r"\bA10G\b", None),
        # A10: BF16 125 (250*), TF32 62.5 (125*), FP32 31.2
        (r"\bA10\b", _Datasheet(125.0, 125.0, 62.5, 31.2, "NVIDIA A10 Tensor Core GPU datasheet")),
    )
)

DTYPES = ("bf16", "fp16", "tf32", "fp32")


def datasheet_peak_flops(device_name: str, dtype: str) -> float | None:
    """Dense datasheet peak in FLOP/s of one device for matmuls in `dtype` (bf16, fp16, tf32, fp32).

    None for CPUs and for devices not in the table: MFU against a made-up number is worse than none.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    for pattern, sheet in _TABLE:
        if pattern.search(device_name):
            return None if sheet is None else getattr(sheet, dtype) * TERA
    return None


def matmul_dtype(precision: str) -> str:
    """The dtype the peaks are read for, for a training precision (bf16, fp16, fp32 or fp8): fp32 runs
    as tf32 when torch allows it; fp8 is measured against the bf16 peak, as is usual, so that its MFU
    and bf16's compare as their tokens/s do."""
    if precision == "fp8":
        return "bf16"
    if precision != "fp32":
        return precision
    import torch

    tf32 = torch.cuda.is_available() and torch.backends.cuda.matmul.allow_tf32
    return "tf32" if tf32 else "fp32"


@functools.lru_cache(maxsize=1)
def cpu_model_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def device_name(device: torch.device | str) -> str:
    """The name the datasheet table is keyed by: the CUDA device name, or `cpu:<model name>`."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type}:{cpu_model_name()}"


def device_key(device: torch.device | str) -> str:
    """Identifies one kind of device for the measured peak. On CPUs the peak depends on the threads
    torch uses, so they are part of the key."""
    import torch

    name = device_name(device)
    if torch.device(device).type == "cpu":
        return f"{name}:{torch.get_num_threads()}t"
    return name


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "tf32": "float32"}


PEAK_SAMPLES = 5
"""Samples per measured peak: their median is the figure (one sample swung 366-927 GFLOP/s between runs)."""


def measure_matmul_peak(
    *, device: torch.device | str, dtype: str, seconds: float = 3.0, size: int | None = None
) -> float:
    """Achievable dense matmul FLOP/s of one device in `dtype`: the median of PEAK_SAMPLES short samples
    over about `seconds` in all, each sample the best of a few timed bursts of square (size x size)
    products.

    Best-of within a sample drops a burst that lost the cores for a moment; the median across samples
    drops a whole sample taken while a neighbour held them. Measure in the dtype training uses: on
    CPUs without native bf16, bf16 matmuls run ~50x slower than fp32. `tf32` means fp32 tensors with
    TF32 allowed (the caller's torch settings decide).
    """
    import torch

    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_TORCH_DTYPES)}, got {dtype!r}")
    device = torch.device(device)
    torch_dtype = getattr(torch, _TORCH_DTYPES[dtype])
    is_cuda = device.type == "cuda"
    if size is None:
        size = 8192 if is_cuda else 1024
    a = torch.randn(size, size, device=device, dtype=torch_dtype)
    b = torch.randn(size, size, device=device, dtype=torch_dtype)
    flops_per_product = 2.0 * size**3

    def sync() -> None:
        if is_cuda:
            torch.cuda.synchronize(device)  # measurement only, never in the step loop

    def burst(count: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(count):
            torch.mm(a, b)
        sync()
        return max(time.perf_counter() - start, 1e-9)

    burst(1)  # warm-up: kernel selection, first-touch allocation
    one = burst(1)
    per_sample = max(0.0, seconds - 2 * one) / PEAK_SAMPLES
    count = max(1, int(per_sample / 3 / one))  # ~3 bursts per sample
    results = []
    for _ in range(PEAK_SAMPLES):
        deadline = time.perf_counter() + per_sample
        best = count * flops_per_product / burst(count)
        while time.perf_counter() < deadline:
            best = max(best, count * flops_per_product / burst(count))
        results.append(best)
    return statistics.median(results)


@dataclass(frozen=True, kw_only=True)
class PeakFigure:
    """A measured matmul peak and where it came from."""

    flops: float
    cached: bool
    """True when read from the per-host cache instead of measured by this call."""
    measured_at: str
    """When it was measured (UTC, ISO 8601)."""
    seconds: float
    cache_path: str


def peak_cache_path() -> str:
    """The per-user cache of measured peaks: $RAYTRAIN_FAST_CACHE_DIR, else $XDG_CACHE_HOME/raytrain_fast,
    else ~/.cache/raytrain_fast; the file is matmul_peak.json."""
    root = os.environ.get("RAYTRAIN_FAST_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "raytrain_fast"
    )
    return os.path.join(root, "matmul_peak.json")


def peak_cache_key(device: torch.device | str, dtype: str) -> str:
    """Host, device kind (with the thread count on CPUs) and dtype: what the peak depends on."""
    return f"{socket.gethostname()}|{device_key(device)}|{dtype}"


def _read_cache(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file)
    except (OSError, ValueError):  # absent or damaged: measure, and write it anew
        return {}
    return entries if isinstance(entries, dict) else {}


def cached_matmul_peak(
    *, device: torch.device | str, dtype: str, seconds: float, cache_path: str | None = None,
    measure: Callable[[], float] | None = None,
) -> PeakFigure:
    """The measured peak for this host, device kind, thread count and dtype: from the cache when it
    holds one measured for at least `seconds`, else measured now (`measure`, default
    `measure_matmul_peak`) and cached, so runs on one machine share one denominator for MFU."""
    path = cache_path or peak_cache_path()
    key = peak_cache_key(device, dtype)
    entries = _read_cache(path)
    entry = entries.get(key)
    if isinstance(entry, dict) and float(entry.get("seconds", 0)) >= seconds and float(entry.get("flops", 0)) > 0:
        return PeakFigure(flops=float(entry["flops"]), cached=True, measured_at=str(entry.get("measured_at", "?")),
                          seconds=float(entry["seconds"]), cache_path=path)
    flops = float(measure() if measure is not None else measure_matmul_peak(device=device, dtype=dtype, seconds=seconds))
    measured_at = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    entries[key] = {"flops": flops, "seconds": seconds, "samples": PEAK_SAMPLES, "measured_at": measured_at}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temp = f"{path}.{os.getpid()}.tmp"
        with open(temp, "w", encoding="utf-8") as file:
            json.dump(entries, file, indent=1, sort_keys=True)
        os.replace(temp, path)  # atomic: two runs starting together never see half a file
    except OSError as error:  # a read-only home must not stop training; the next run measures again
        logger.warning("could not cache the measured peak in %s (%s); the next run measures it again", path, error)
    return PeakFigure(flops=flops, cached=False, measured_at=measured_at, seconds=seconds, cache_path=path)


def mfu(*, tokens_per_sec: float, flops_per_token: float | None, peak_flops: float | None, num_devices: int) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the peak of all devices; None when unknown."""
    if not flops_per_token or not peak_flops or num_devices <= 0:
        return None
    return tokens_per_sec * flops_per_token / (peak_flops * num_devices)
