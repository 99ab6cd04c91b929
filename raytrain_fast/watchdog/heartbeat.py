"""Each worker's side of the hang watchdog: a daemon thread that reads the step counter the loop
already keeps and sends it to the run's coordinator actor every `interval_s`. Nothing runs on the
training thread (no call, no host sync); a frozen process stops beating, which the watchdog uses."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from raytrain_fast.watchdog.hang import WATCHED_PHASE

logger = logging.getLogger("raytrain_fast.watchdog")


class Heartbeat:
    """Sends (rank, step, phase) to the run's coordinator (coordinator.py's `Coordinator`) from a daemon thread."""

    def __init__(
        self, coordinator: Any, *, rank: int, world_size: int, read_step: Callable[[], int], last_step: int, interval_s: float
    ) -> None:
        import ray

        self._coordinator = coordinator
        self._rank, self._world_size = rank, world_size
        self._read_step, self._last_step = read_step, last_step
        self._start_step = read_step()  # the step it starts (or resumes) at: the first step after it compiles, not watched
        self._paused_at: int | None = None
        self.interval_s = interval_s
        self._phase = WATCHED_PHASE
        self._node_id = ray.get_runtime_context().get_node_id()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raytrain-fast-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def pause(self, phase: str) -> None:
        """Not watched until the next step completes (a checkpoint save, and after the last one the
        wait for its upload: their time depends on the storage). No call: one attribute set."""
        self._paused_at = self._read_step()
        self._phase = phase

    def _current_phase(self, step: int) -> str:
        if self._phase != WATCHED_PHASE and step != self._paused_at:
            self._phase = WATCHED_PHASE
        return self._phase

    def _run(self) -> None:
        pid = os.getpid()
        wait_s = 0.0  # the first beat at once: a rank that froze before its first beat would never be watched
        while not self._stop.wait(wait_s):
            wait_s = self.interval_s
            step = self._read_step()
            if step >= self._last_step:  # the run's last step is done: what follows (the final upload) is not watched
                break
            try:
                self._coordinator.beat(
                    rank=self._rank, world_size=self._world_size, pid=pid, node_id=self._node_id,
                    step=step, start_step=self._start_step, phase=self._current_phase(step), timeout_s=max(10.0, 5 * self.interval_s),
                )
            except Exception as error:  # noqa: BLE001 - the driver (and its actor) is gone: Ray ends us anyway
                if not self._stop.is_set():
                    logger.warning("hang watchdog: heartbeat to the coordinator failed, no longer beating: %s", error)
                return
        self._end()

    def _end(self) -> None:
        try:
            self._coordinator.beat_end(rank=self._rank, pid=os.getpid())
        except Exception:  # noqa: BLE001 - nothing left to watch either way
            pass

    def close(self) -> None:
        """Stop beating and tell the watchdog this rank left the loop (a finished run is no hang)."""
        self._stop.set()
        self._thread.join(timeout=10)
        self._end()


class NoHeartbeat:
    """The watchdog is off (watchdog.hang_timeout_s=0)."""

    def pause(self, phase: str) -> None:
        pass

    def close(self) -> None:
        pass


def set_new_group_timeout(seconds: float) -> bool:
    """Make the process groups created from now on (DeepSpeed's clone of the world group, which its
    ZeRO all-reduces use) time out after `seconds`, as the world group does (TorchConfig.timeout_s).

    `torch.distributed.new_group(ranks)` without a timeout takes torch's module default (30 minutes
    for gloo, 10 for NCCL), not the world group's: DeepSpeed passes none. Tested on torch 2.13;
    where the module default is missing, one warning and the groups keep torch's default.
    """
    from datetime import timedelta

    from torch.distributed import distributed_c10d

    if not isinstance(getattr(distributed_c10d, "default_pg_timeout", None), timedelta):
        logger.warning(
            "hang watchdog: this torch has no distributed_c10d.default_pg_timeout; DeepSpeed's process groups keep "
            "torch's default timeout (30 min gloo, 10 min NCCL)"
        )
        return False
    distributed_c10d.default_pg_timeout = timedelta(seconds=seconds)
    if isinstance(getattr(distributed_c10d, "default_pg_nccl_timeout", None), timedelta):  # None without NCCL
        distributed_c10d.default_pg_nccl_timeout = timedelta(seconds=seconds)
    return True
