from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

_RANGE = re.compile(r"^\s*(\d+)\s*-\s*(\d+)\s*$")
"""resources.num_workers as an elastic range "MIN-MAX"."""


@dataclass(kw_only=True)
class ResourcesConfig:
    """Workers and what each one gets."""

    num_workers: int | str = 1
    """Training workers (one process each; one GPU each when use_gpu is on). A range "MIN-MAX" (e.g. "1-4", quoted in YAML, `--set resources.num_workers=1-4`) makes the run elastic: it starts with as many as the cluster has room for, up to MAX, and Ray Train restarts it at a new size from the latest checkpoint when nodes go or come back."""
    min_workers: int | None = None
    """Set from num_workers "MIN-MAX": the fewest workers an elastic run goes on with. null = a fixed size."""
    elastic_resize_interval_s: float = 60.0
    """Elastic runs: how often Ray Train checks whether more workers fit than the run has (ScalingConfig's elastic_resize_monitor_interval_s). Each resize is a restart from the latest checkpoint."""
    use_gpu: bool | Literal["auto"] = "auto"
    """Train on GPUs. auto = yes when the Ray cluster has GPUs."""
    cpus_per_worker: int = 0
    """CPUs reserved per worker, also torch's thread count on CPU. 0 = split the machine's CPUs evenly (CPU runs) or 4 (GPU runs)."""
    max_failures: int = 3
    """Worker-group restarts from the latest checkpoint before the run fails (-1 = unlimited). Preemptions do not count here."""
    max_preemption_failures: int = -1
    """Restarts after a node of the run was preempted (drained by Ray: spot reclaim, autoscaler) before the run fails; -1 = unlimited, 0 = none. Counted apart from max_failures."""
    preemption_grace_s: float = 0.0
    """How long Ray Train lets the workers run past a drained node's deadline before restarting (time for the checkpoint saved on the notice to finish uploading)."""
    memory_budget_gb: float | None = None
    """Memory one worker may use, in GB. CPU runs: what train.micro_batch=auto must fit in (measured
    peak RSS of the process), the denominator of memory/peak_frac, and the limit a sweep trial fails
    at. GPU runs: null = the device's memory minus 10%; set it to leave room for something else."""

    def __post_init__(self) -> None:
        # "MIN-MAX" becomes num_workers=MAX (what every batch and resource check counts with: the
        # size the run starts at when the cluster has room) and min_workers=MIN. A malformed value
        # stays as given for `validate` to report.
        if isinstance(self.num_workers, str) and (match := _RANGE.match(self.num_workers)):
            self.min_workers, self.num_workers = int(match[1]), int(match[2])
            if self.min_workers == self.num_workers:
                self.min_workers = None

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, int) and self.min_workers is not None and self.min_workers < self.num_workers

    @property
    def fewest_workers(self) -> int:
        """What the cluster must hold for the run to start: min_workers for an elastic run."""
        return self.min_workers if self.elastic else self.num_workers  # type: ignore[return-value]

    def scaling_workers(self) -> int | tuple[int, int]:
        """ScalingConfig(num_workers=...): an int, or (min, max) for an elastic run."""
        return (self.min_workers, self.num_workers) if self.elastic else self.num_workers
