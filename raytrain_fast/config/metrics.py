from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class MetricsConfig:
    """What the step loop measures and where rank 0 sends it. The log cadence is train.log_every."""

    profile_every: int = 50
    """Time the forward, backward and optimizer phases on every this many steps (CUDA events on GPU, read back at the next log step: no extra sync). 0 = never."""
    jsonl_flush_every_s: float = 10.0
    """Write buffered metrics to `<run>/metrics/*.jsonl` in the run's storage at most this often (always on; S3 objects are rewritten, not appended)."""
    wandb: bool = False
    """Send metrics to Weights & Biases from rank 0 (system-stats sampling off, run id derived from the run name so a resumed run continues its curves)."""
    wandb_project: str = "raytrain-fast"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (team or user); null = your default entity."""
    wandb_mode: Literal["auto", "online", "offline"] = "auto"
    """auto = online when WANDB_API_KEY is set, else offline (files under the run's local dir, `wandb sync` them later)."""
    tensorboard: bool = False
    """Write TensorBoard event files from rank 0 (needs the `tensorboard` package)."""
    tensorboard_flush_every_s: float = 30.0
    """Flush TensorBoard event files at most this often."""
    queue_size: int = 1000
    """Log records buffered for the sink thread. When full, the oldest record is dropped and counted in sink/dropped: training never waits for a sink."""
    slowdown_threshold: float = 0.10
    """Raise alert/slowdown when the rolling median step time exceeds the run's own baseline by more than this fraction."""
    slowdown_windows: int = 3
    """Log windows in the rolling median (and in the baseline taken right after warm-up)."""
    slowdown_warmup_steps: int = 50
    """Steps left out of the baseline (allocator and data pipeline warm-up); the stall alert starts after them too."""
    stall_factor: float = 2.5
    """Raise alert/stall for a log window whose step time is more than this many times the median of the 5 windows before it (a stall, which a rolling median never shows). 2.5 sits above what noise does to a window on a busy 2-core machine (up to 1.7x measured) and below a fair share against 4 other busy processes."""
    gc_every: int = 200
    """After setup, freeze the heap, turn off Python's automatic full collections and run one timed full collection every this many steps. 0 = leave Python's GC alone."""
    peak_measure_s: float = 3.0
    """Seconds of large matrix products that measure the achievable matmul peak (median of 5 samples; cached per host, device, threads and dtype in ~/.cache/raytrain_fast and reused) for throughput/mfu_measured_peak. 0 = skip."""
    coordinator_timeout_s: float = 600.0
    """How long a rank waits for a value another rank measures (FLOPs per token, peak) before failing with an error."""


_BOUNDS = {
    **dict.fromkeys(("profile_every", "gc_every", "slowdown_warmup_steps"), ">= 0 (0 = off)"),
    **dict.fromkeys(("queue_size", "slowdown_windows", "coordinator_timeout_s"), "> 0"),
    **dict.fromkeys(("jsonl_flush_every_s", "tensorboard_flush_every_s", "peak_measure_s"), ">= 0"),
}
"""The fields with a lower bound, and the bound as a problem names it."""


def metrics_config_problems(config: MetricsConfig) -> list[str]:
    """Every problem with `config`, as messages naming the field and the fix (empty when valid)."""
    problems: list[str] = []
    for name, bound in _BOUNDS.items():
        value = getattr(config, name)
        if value < 0 or (value == 0 and bound == "> 0"):
            problems.append(f"metrics.{name} must be {bound}, got {value}")
    if config.stall_factor <= 1:
        problems.append(f"metrics.stall_factor must be > 1 (a window this many times slower than the ones before it), got {config.stall_factor}")
    if config.slowdown_threshold <= 0:
        problems.append(f"metrics.slowdown_threshold must be > 0 (e.g. 0.1 = 10% slower), got {config.slowdown_threshold}")
    if config.wandb and not config.wandb_project.strip():
        problems.append("metrics.wandb_project must not be empty when metrics.wandb is true")
    return problems
