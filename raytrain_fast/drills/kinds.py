"""The drills as typed objects: each plants one problem in a real run (drills/plants.py does the
planting), so that tests and people learning what a problem looks like can check that the metrics,
the health checks, the hang watchdog and `raytrain-fast report` name it. A drill is a `StepHooks`
(loop/hooks.py): the loop calls it through its rank's `RankHooks` and never imports this package.
Each is a small frozen dataclass, pickled into the loop config; per-rank state is made by
`for_rank` on the worker."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from raytrain_fast.drills import plants
from raytrain_fast.loop.hooks import StepHooks

T = TypeVar("T")


class _OnItsRank(StepHooks):
    """A drill of the rank in its `rank` field only (None: every rank)."""

    def for_rank(self, rank: int) -> StepHooks | None:
        return self if self.rank is None or self.rank == rank else None  # type: ignore[attr-defined]


@dataclass(frozen=True)
class FailOnce(_OnItsRank):
    """Rank `rank` raises (or, with `kill`, dies by SIGKILL as on a lost node) when it completes
    `step`, once: the marker file records that it happened, so the restarted run goes through."""

    step: int
    marker: str
    rank: int = 0
    kill: bool = False

    def after_step(self, step: int) -> None:
        if step == self.step and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"injected failure at step {step} on rank {self.rank} (drill fail_once_at)")


@dataclass(frozen=True)
class RecordSequences(StepHooks):
    """Every rank appends the sequence ids of each step to `<directory>/rank<r>.jsonl` (tests that
    prove a resumed run sees exactly the same data). First among the hooks: a step's ids are written
    before a drill after it can end the process."""

    directory: str
    order = 0

    def for_rank(self, rank: int) -> StepHooks:
        return _SequenceRecorder(os.path.join(self.directory, f"rank{rank}.jsonl"))


class _SequenceRecorder(StepHooks):
    def __init__(self, path: str) -> None:
        self.path, self._ids = path, []

    def on_batch(self, seq_ids: Any) -> None:
        self._ids.extend(seq_ids.tolist())  # a host read: only when recording is on (tests)

    def after_step(self, step: int) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({"step": step, "ids": self._ids}) + "\n")
        self._ids = []


@dataclass(frozen=True)
class SlowData(_OnItsRank):
    """Sleep `seconds` before each micro-batch is fetched, from optimizer step `from_step` on, on
    `rank` only (None: every rank). The loop counts it as data wait: a data-bound run."""

    seconds: float
    from_step: int = 0
    rank: int | None = None

    def batches(self, data: Iterator[T], *, current_step: Callable[[], int]) -> Iterator[T]:
        return plants.slow_data(data, self.seconds, self.from_step, current_step=current_step)


@dataclass(frozen=True)
class SlowStep(_OnItsRank):
    """Sleep `seconds` after each optimizer step from `from_step` on, outside the data wait: on one
    rank a straggler, on every rank from a step on a progressive slowdown."""

    seconds: float
    from_step: int = 0
    rank: int | None = None

    def after_step(self, step: int) -> None:
        plants.sleep_for(self.seconds, self.from_step, step)


@dataclass(frozen=True)
class SlowSink(StepHooks):
    """Rank 0's metric sinks sleep `seconds` before each record (a slow W&B or bucket)."""

    seconds: float

    def sinks(self, sinks: Sequence[Any]) -> list[Any]:
        return plants.slow_sinks(sinks, self.seconds)


@dataclass(frozen=True)
class SlowUpload(_OnItsRank):
    """Each checkpoint upload of `rank` (None: every rank) starts `seconds` late."""

    seconds: float
    rank: int | None = None

    def before_upload(self) -> None:
        time.sleep(self.seconds)


@dataclass(frozen=True)
class CpuBurn(StepHooks):
    """Rank 0 starts `processes` busy-loop processes at normal priority when it completes `from_step`
    and stops them at `to_step`: other work on the node taking the CPU."""

    from_step: int
    to_step: int
    processes: int = 2

    def for_rank(self, rank: int) -> StepHooks | None:
        return plants.CpuBurner(self.from_step, self.to_step, self.processes) if rank == 0 else None


@dataclass(frozen=True)
class HoldMemory(StepHooks):
    """Rank 0 allocates and touches `gb` of host memory at `from_step` and holds it to the end."""

    gb: float
    from_step: int = 0

    def for_rank(self, rank: int) -> StepHooks | None:
        return plants.MemoryHolder(self.gb, self.from_step) if rank == 0 else None


@dataclass(frozen=True)
class Hang(_OnItsRank):
    """Rank `rank` freezes inside `step`, once (the marker file records it): SIGSTOP of its own
    process, or with `seconds` a sleep of its training thread (the hang watchdog, watchdog/)."""

    step: int
    marker: str
    rank: int = 0
    seconds: float | None = None

    def batches(self, data: Iterator[T], *, current_step: Callable[[], int]) -> Iterator[T]:
        return plants.hang_data(data, (self.step, self.marker, self.rank, self.seconds), current_step=current_step)


@dataclass(frozen=True)
class Nonfinite(StepHooks):
    """Rank `rank` makes its loss (`what="loss"`) or only its gradient (`"grad"`) NaN in `step`, or
    (`"spike"`) multiplies its loss by plants.SPIKE_FACTOR, once per worker process (divergence and
    spikes, loop/health.py)."""

    step: int
    rank: int = 0
    what: str = "loss"

    def for_rank(self, rank: int) -> StepHooks | None:
        return plants.NonfinitePlanter(self.step, self.what) if rank == self.rank else None


def Spike(step: int, rank: int = 0) -> Nonfinite:  # noqa: N802 - a drill's name, as the others
    """Rank `rank` multiplies its loss by plants.SPIKE_FACTOR in `step` (a loss and gradient-norm spike)."""
    return Nonfinite(step, rank, "spike")
