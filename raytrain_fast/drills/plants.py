"""How each drill plants its problem (the typed drills in drills/kinds.py use these), and the
parsers of the spec forms `raytrain-fast pretrain --drill NAME=SPEC` takes: docs/development.md#drills
and docs/report.md#drills list each form."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from raytrain_fast.loop.hooks import StepHooks

T = TypeVar("T")


def sleep_for(seconds: float, from_step: int, step: int) -> None:
    if step >= from_step:
        time.sleep(seconds)


def slow_data(batches: Iterator[T], seconds: float, from_step: int, *, current_step: Callable[[], int]) -> Iterator[T]:
    """An iterator that sleeps before each batch of `batches` is fetched, from step `from_step` on."""
    while True:
        sleep_for(seconds, from_step, current_step())  # inside the loop's next(data): measured as data wait
        try:
            batch = next(batches)
        except StopIteration:
            return
        yield batch


def hang_spec(text: str) -> tuple[int, str, int, float | None]:
    """(step, marker file, rank, seconds or None for SIGSTOP) of a "<step>:<marker>[:<rank>[:<seconds>]]" spec."""
    step, marker, *rest = text.split(":")
    rank = int(rest[0]) if rest and rest[0] else 0
    seconds = float(rest[1]) if len(rest) > 1 and rest[1] else None
    if int(step) < 1 or not marker:
        raise ValueError(text)
    return int(step), marker, rank, seconds


def hang_data(batches: Iterator[T], spec: tuple[int, str, int, float | None], *, current_step: Callable[[], int]) -> Iterator[T]:
    """An iterator that freezes this process inside step `spec[0]` (at its first batch: mid-step,
    where the other ranks go on to wait for it in the next collective), once: the marker file
    records that it happened, so the restarted run goes through. SIGSTOP stops every thread (the
    heartbeat too), as a wedged driver or a stuck kernel does; with seconds, only this thread sleeps."""
    step, marker, _, seconds = spec
    for batch in batches:
        if current_step() + 1 == step and not os.path.exists(marker):
            with open(marker, "w") as out:
                out.write(f"{time.time()}\n")  # when it froze: the test measures the watchdog from here
            if seconds is None:
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                time.sleep(seconds)
        yield batch


class _SlowSink:
    def __init__(self, sink: Any, seconds: float) -> None:
        self._sink, self._seconds = sink, seconds

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        time.sleep(self._seconds)
        self._sink.log(metrics, step)

    def flush(self) -> None:
        if hasattr(self._sink, "flush"):
            self._sink.flush()

    def close(self) -> None:
        self._sink.close()


def slow_sinks(sinks: Sequence[Any], seconds: float) -> list[Any]:
    """`sinks`, each wrapped to sleep `seconds` before every record (unchanged when 0)."""
    if not seconds:
        return list(sinks)
    return [_SlowSink(sink, seconds) for sink in sinks]


# A busy loop at niceness 0 that also ends by itself: when its parent (the worker) is gone, or after
# a time limit, so a worker that dies mid-drill leaves nothing burning.
_BURN = """
import os, time
os.setpriority(os.PRIO_PROCESS, 0, 0)
parent, end = os.getppid(), time.monotonic() + {limit_s}
while os.getppid() == parent and time.monotonic() < end:
    for _ in range(200000):
        pass
"""


def cpu_burn_range(text: str) -> tuple[int, int, int]:
    """(from_step, to_step, processes) of a "<from_step>:<to_step>[:<processes>]" spec."""
    start, end, *rest = text.split(":")
    processes = int(rest[0]) if rest else 2
    if int(end) <= int(start) or processes <= 0:
        raise ValueError(text)
    return int(start), int(end), processes


class CpuBurner(StepHooks):
    """Starts and stops the cpu_burn drill's processes at their steps."""

    def __init__(self, start_step: int, end_step: int, processes: int, *, limit_s: float = 600.0) -> None:
        self.start_step, self.end_step, self.processes = start_step, end_step, processes
        self._limit_s = limit_s
        self._procs: list[subprocess.Popen] = []

    def after_step(self, step: int) -> None:
        if step == self.start_step and not self._procs:
            code = _BURN.format(limit_s=self._limit_s)
            self._procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(self.processes)]
        elif step >= self.end_step:
            self.close()

    def close(self) -> None:
        for proc in self._procs:
            proc.kill()
        for proc in self._procs:
            proc.wait()
        self._procs = []


def hold_memory_spec(text: str) -> tuple[float, int]:
    """(GB, from_step) of a "<GB>:<from_step>" spec."""
    gb, _, start = text.partition(":")
    if float(gb) <= 0:
        raise ValueError(text)
    return float(gb), int(start or 0)


class MemoryHolder(StepHooks):
    """Allocates and touches the hold_memory drill's buffer at its step and keeps it. A thread does
    the allocation (a second or two per GB), so the drill plants memory, not a stall."""

    def __init__(self, gb: float, start_step: int) -> None:
        self.gb, self.start_step = gb, start_step
        self._buffer: list[Any] | None = None  # held, never read: the memory the drill plants
        self._thread: threading.Thread | None = None

    def after_step(self, step: int) -> None:
        if step >= self.start_step and self._thread is None:
            self._thread = threading.Thread(target=self._allocate, name="drill-hold-memory", daemon=True)
            self._thread.start()

    def _allocate(self) -> None:
        # torch fills without the GIL (a bytearray fill holds it, and the training thread stalled a
        # whole window), in 64 MB chunks.
        import torch

        chunk, chunks = 64 * 2**20, []
        for _ in range(max(1, int(self.gb * 1e9) // chunk)):
            chunks.append(torch.ones(chunk, dtype=torch.uint8))  # written, so resident
            time.sleep(0.005)
        self._buffer = chunks


def nonfinite_spec(text: str, *, kind: str = "") -> tuple[int, int, str]:
    """(step, rank, kind) of a "<step>[:<rank>[:loss|grad]]" spec (or, with `kind` given, "<step>[:<rank>]")."""
    step, *rest = text.split(":")
    rank = int(rest[0]) if rest and rest[0] else 0
    kind = kind or (rest[1] if len(rest) > 1 else "loss")
    if int(step) < 1 or kind not in ("loss", "grad", "spike") or (kind == "spike" and len(rest) > 1):
        raise ValueError(text)
    return int(step), rank, kind


SPIKE_FACTOR = 1000.0
"""The spike drill multiplies the step's loss (and so its gradient) by this."""


class NonfinitePlanter(StepHooks):
    """Makes the loss (kind loss) or only its gradient (kind grad) NaN, or multiplies the loss by
    SPIKE_FACTOR (kind spike), in every micro-batch of one step, once per worker process: the step
    a rollback goes back over is healthy the second time, as a bad batch skipped would be."""

    def __init__(self, step: int, kind: str) -> None:
        self.step, self.kind = step, kind
        self._completed = 0
        self._done = False

    def on_loss(self, loss: Any) -> Any:
        if self._done or self._completed + 1 != self.step:
            return loss
        if self.kind == "grad":
            loss.register_hook(lambda grad: grad * float("nan"))  # the loss stays finite, every gradient is NaN
            return loss
        return loss * (SPIKE_FACTOR if self.kind == "spike" else float("nan"))

    def after_step(self, step: int) -> None:
        self._done = self._done or step == self.step
        self._completed = step
