"""A node of the run is being drained (spot reclaim, autoscaler scale-down): save a checkpoint at
the next log step, then train on until Ray Train restarts the run without the node.

Ray Train's preemption watcher polls Ray Core's drain state (every RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S,
5 s by default) and hands the notice to every worker. `ray.train.get_preemption_info()` reads it
through a barrier across workers (a round trip to Ray Train's synchronization actor). The loop needs
no such barrier: each rank reads its own copy of the notice on log steps and raises a bit in the
flags word of the log step's all-gather (TrainMetrics.log), so every rank agrees on the same step
at no extra cost. Where the per-worker copy cannot be read (another Ray version), every rank
calls the public API on log steps instead: a barrier, but only every log_every steps.

The restart that follows counts against FailureConfig.max_preemption_failures (resources.max_preemption_failures),
not max_failures.
"""

from __future__ import annotations

import time
from typing import Any, Callable


def _public_reader() -> Callable[[], Any] | None:
    try:
        import ray.train

        ray.train.get_context()  # raises outside a Ray Train worker
        return ray.train.get_preemption_info  # a barrier: every rank calls it on the same log steps
    except Exception:  # noqa: BLE001 - Ray without preemption support, or not in a worker
        return None


class PreemptionNotice:
    """Per worker: whether Ray has announced that a node of the run is being drained.

    On log steps the loop calls `flag()` (this rank's view, one attribute read) and passes it in the
    drain's flags word; once the ranks agree, `save_due()` is true exactly once per notice, and
    `saved(...)` measures the time from the notice to the complete checkpoint.
    """

    def __init__(self, reader: Callable[[], Any] | None = None) -> None:
        from raytrain_fast._ray_compat import preemption_info_reader  # this worker's copy, without a barrier

        self._read = reader or preemption_info_reader() or _public_reader()
        self.info: Any = None
        """Ray's PreemptionInfo (deadline_ms, preempted_node_to_ranks) once noticed."""
        self.noticed_at: float | None = None
        """time.time() of the log step at which this rank first saw the notice."""
        self._handled = False

    def flag(self) -> bool:
        """This rank's view, on log steps only (with the public API this is a barrier)."""
        if self._read is None:
            return False
        info = self._read()
        if info is not None and self.info is None:
            self.info, self.noticed_at = info, time.time()
        return info is not None

    def save_due(self, agreed: bool) -> bool:
        """The ranks agreed that a notice came (some rank saw it): save once, on this log step."""
        if not agreed or self._handled:
            return False
        self._handled = True
        if self.noticed_at is None:  # another rank saw it first
            self.noticed_at = time.time()
        return True

    def saved(self) -> dict[str, float]:
        """Call once the notice's checkpoint is complete (uploaded). Returns the metrics to log (and to
        `message`)."""
        now = time.time()
        metrics = {"preemption/notice_to_checkpoint_s": now - (self.noticed_at or now)}
        deadline_ms = getattr(self.info, "deadline_ms", None)
        if deadline_ms:
            metrics["preemption/deadline_margin_s"] = deadline_ms / 1000 - now
        return metrics

    def message(self, *, step: int, metrics: dict[str, float]) -> str:
        nodes = ", ".join(node[:12] for node in getattr(self.info, "preempted_node_ids", []) or []) or "a node"
        ranks = getattr(self.info, "preempted_ranks", None)
        margin = metrics.get("preemption/deadline_margin_s")
        return (
            f"Preemption notice (node {nodes}, ranks {ranks}): checkpoint at step {step} complete "
            f"{metrics['preemption/notice_to_checkpoint_s']:.1f} s after the notice"
            + (f", {margin:.0f} s before the node's deadline" if margin is not None else "")
            + ". Training goes on until Ray restarts the run without the node."
        )
