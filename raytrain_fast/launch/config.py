from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class ResourcesConfig:
    """Workers and what each one gets."""

    num_workers: int = 1
    """Training workers (one process each; one GPU each when use_gpu is on)."""
    use_gpu: bool | Literal["auto"] = "auto"
    """Train on GPUs. auto = yes when the Ray cluster has GPUs."""
    cpus_per_worker: int = 0
    """CPUs reserved per worker, also torch's thread count on CPU. 0 = split the machine's CPUs evenly (CPU runs) or 4 (GPU runs)."""
    max_failures: int = 3
    """Worker-group restarts from the latest checkpoint before the run fails (-1 = unlimited)."""
    memory_budget_gb: float | None = None
    """Memory one worker may use, in GB. CPU runs: what train.micro_batch=auto must fit in (measured
    peak RSS of the process), the denominator of memory/peak_frac, and the limit a sweep trial fails
    at. GPU runs: null = the device's memory minus 10%; set it to leave room for something else."""
