"""The one memory statistic that memory/peak_gb, the sweep's budget check, `micro_batch: auto`'s
probes and `bench model` all use: on CUDA the caching allocator's peak reserved memory, elsewhere
the process's peak RSS, both since `reset_peak_memory` (called once setup is done)."""

from __future__ import annotations

import contextlib
import resource
import sys
from typing import Any

import torch

GB = 1e9


def _is_cuda(device: Any) -> bool:
    return getattr(device, "type", str(device).split(":", 1)[0]) == "cuda"


def host_memory_gb() -> tuple[float, float]:
    """(peak RSS since the last `reset_peak_memory`, current RSS) of this process in GB. Linux:
    VmHWM and VmRSS of /proc/self/status; elsewhere the process's lifetime peak (ru_maxrss)."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmHWM", "VmRSS")))
        peak_bytes, current_bytes = (int(fields[name].split()[0]) * 1024 for name in ("VmHWM", "VmRSS"))
    except (OSError, KeyError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_bytes = current_bytes = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    return max(peak_bytes, current_bytes) / GB, current_bytes / GB


def reset_peak_memory(device: Any = "cpu") -> None:
    """Start `peak_memory_gb` over from the memory in use now. Called once setup is done (model,
    engine, FLOP count, peak measurement, data), by the loop and by `micro_batch: auto`'s probes
    alike, so memory/peak_gb and the probes' peaks are the same statistic: training's. CUDA: the
    allocator's peak stats; Linux: the process's RSS high-water mark (/proc/self/clear_refs)."""
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # elsewhere the peak keeps setup in it
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)


def peak_memory_gb(device: Any = "cpu") -> float:
    """This process's peak memory in GB since `reset_peak_memory`: on CUDA `max_memory_reserved`
    (what the caching allocator holds, so what the next allocation competes with; allocator stats,
    no device sync), elsewhere the peak RSS of the process."""
    if _is_cuda(device):
        return torch.cuda.max_memory_reserved(device) / GB
    return host_memory_gb()[0]


def memory_in_use_gb(device: Any = "cpu") -> float:
    """The memory in use now: CUDA reserved memory, else the current RSS."""
    if _is_cuda(device):
        return torch.cuda.memory_reserved(device) / GB
    return host_memory_gb()[1]
