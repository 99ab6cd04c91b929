from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

AUTO_STEPS = 20
"""watchdog.hang_timeout_s=auto waits this many measured step times (median) ..."""
AUTO_MAX_S = 600.0
"""... and at most this long (Ray's own worker health check gives up after 600 s too)."""
PROCESS_GROUP_MARGIN_S = 120.0
"""The process group's timeout is the watchdog's longest timeout plus this: the watchdog takes the stacks first."""
PROCESS_GROUP_MIN_S = 300.0
"""Never below this: collectives during setup (DeepSpeed's first CPU comm op builds for ~75 s) are not watched."""


@dataclass(kw_only=True)
class WatchdogConfig:
    """The hang watchdog: every rank's step counter reaches the run's coordinator actor; when no rank completes a step for a timeout, it takes every worker's stack and restarts the group."""

    hang_timeout_s: float | Literal["auto"] = "auto"
    """Seconds without any rank completing a step before the run counts as hung. auto = 20 x the measured median step time, at least min_timeout_s, at most 600 s; 0 = no watchdog. The first step after a start or resume (compile, restore) and checkpoint saves are not watched."""
    min_timeout_s: float = 60.0
    """The floor of hang_timeout_s=auto (a log step, an evaluation or a slow sink may take several step times)."""

    @property
    def enabled(self) -> bool:
        return self.hang_timeout_s == "auto" or float(self.hang_timeout_s) > 0

    def beat_interval_s(self) -> float:
        """How often each rank beats: often enough to tell a silent rank from a waiting one well within the timeout."""
        if self.hang_timeout_s == "auto":
            return 2.0
        return max(0.2, min(2.0, float(self.hang_timeout_s) / 10))

    def process_group_timeout_s(self) -> int:
        """TorchConfig(timeout_s=...): gloo/NCCL give up just after the watchdog's longest wait would
        have acted, never 30 minutes later (Ray's default, 1800 s); with the watchdog off, Ray's default."""
        if not self.enabled:
            return 1800
        longest = AUTO_MAX_S if self.hang_timeout_s == "auto" else float(self.hang_timeout_s)
        return int(max(longest + PROCESS_GROUP_MARGIN_S, PROCESS_GROUP_MIN_S))


def watchdog_config_problems(config: WatchdogConfig) -> list[str]:
    """Every problem with `config`, naming the field and the fix (empty when valid)."""
    problems: list[str] = []
    timeout = config.hang_timeout_s
    if timeout != "auto" and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
        problems.append(f"watchdog.hang_timeout_s must be auto, 0 (off) or seconds > 0, got {timeout!r}")
    if config.min_timeout_s <= 0:
        problems.append(f"watchdog.min_timeout_s must be > 0 seconds, got {config.min_timeout_s}")
    return problems
