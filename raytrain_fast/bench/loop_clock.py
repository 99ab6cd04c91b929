"""Loop hooks the overhead bench passes to the package's own loop (`launch.trainer.run(config, hooks=...)`).

The loop takes side concerns as `StepHooks` objects (loop/hooks.py); this one adds two things
through the `batches` hook, the one place every step passes through before it starts:

- a clock: rank 0 notes `time.perf_counter()` when the loop asks for the first micro-batch of step
  `start_step + 1` (the end of the warm-up: step `start_step` is done, its log, checkpoint and
  sinks included) and of step `end_step + 1` (the end of the last timed step, everything the loop
  did for it included), and writes both to `timing_file`. The run must have at least
  `end_step + 1` steps. Nothing is added to a step: one integer comparison per micro-batch, no
  device sync.
- in-memory batches (`memory_batches`): the Ray Data pipeline is closed once the loop starts its
  steps and the loop trains on 8 random token batches, cycled (what the bare loop trains on), so
  a variant can measure the loop without ingest.

The loop never imports this module: the object arrives pickled in the loop config.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from raytrain_fast.loop.hooks import StepHooks


@dataclass(frozen=True, kw_only=True)
class ClockHooks(StepHooks):
    """The bench's clock and in-memory batches: a `StepHooks` the bench passes in `LoopHooks(...)`.
    First among the hooks (its batches replace the run's data); a drill passed beside it wraps its
    batches and still applies."""

    order = -1

    timing_file: str = ""
    """Where rank 0 writes {"start_step", "end_step", "seconds", ...} once step end_step is done."""
    start_step: int = 0
    """The clock starts when this many steps are done (the warm-up)."""
    end_step: int = 0
    """The clock stops when this many steps are done."""
    memory_batches: tuple[int, int, int] | None = None
    """(micro_batch, seq_len, seed): train on in-memory random batches instead of the run's data."""

    rank: int = field(default=0, repr=False)
    """The worker this copy runs on (set by `for_rank`; not in the run's notice of its hooks): only rank 0
    keeps the clock."""

    def for_rank(self, rank: int) -> StepHooks:
        return replace(self, rank=rank)

    def batches(self, data: Iterator[Any], *, current_step: Callable[[], int]) -> Iterator[Any]:
        source: Iterator[Any] = data
        if self.memory_batches is not None:
            micro_batch, seq_len, seed = self.memory_batches
            source = in_memory_batches(micro_batch=micro_batch, seq_len=seq_len, seed=seed, device=getattr(data, "device", "cpu"))
            getattr(data, "close", lambda: None)()  # the Ray Data pipeline stops: nothing of it runs during the steps
        if self.rank != 0 or not self.timing_file:
            return source
        return _clocked(source, current_step, self)


def in_memory_batches(*, micro_batch: int, seq_len: int, seed: int, device: Any = "cpu") -> Iterator[tuple[Any, Any]]:
    """(tokens, seq_ids) forever: the bare loops' `token_batches`, cycled."""
    import torch

    from raytrain_fast.bench.overhead_setup import token_batches

    seq_ids = torch.arange(micro_batch, dtype=torch.int64)
    for tokens in itertools.cycle(token_batches(micro_batch, seq_len, seed, device)):
        yield tokens, seq_ids


def _clocked(source: Iterator[Any], current_step: Callable[[], int], clock: ClockHooks) -> Iterator[Any]:
    import torch

    from raytrain_fast.bench import proc_counters

    seen = -1
    start: tuple[float, float, int] | None = None
    # /proc is read one step early: it takes milliseconds, which must fall outside the run's timed
    # log windows as well as the clock; the counters then span one step more.
    counted_from, counters = max(0, clock.start_step - 1), None
    while True:
        done = current_step()
        if done != seen:  # the first micro-batch of step done + 1: step `done` is over
            seen = done
            if done == counted_from:
                counters = proc_counters.snapshot()
            if done == clock.start_step:
                start = (time.perf_counter(), time.time(), torch.get_num_threads())
            elif done == clock.end_step and start is not None:
                end = (time.perf_counter(), time.time())
                with open(clock.timing_file, "w") as out:  # read once the run is over
                    json.dump({
                        "start_step": clock.start_step, "end_step": clock.end_step, "seconds": end[0] - start[0],
                        "start_time": start[1], "end_time": end[1], "threads": start[2], "niceness": os.nice(0),
                        "memory_batches": clock.memory_batches is not None,
                        "proc": proc_counters.window(counters, proc_counters.snapshot(), steps=clock.end_step - counted_from),
                    }, out)
        try:
            item = next(source)
        except StopIteration:
            return
        yield item
