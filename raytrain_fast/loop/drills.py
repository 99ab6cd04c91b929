"""Drill hooks: plant a performance problem in a real run, to check that the metrics, the slowdown
detector and `raytrain-fast report` name it (tests, and people learning what each problem looks like).

Each is off unless its environment variable is set on the workers (Ray passes the driver's env to
local workers; on a cluster set it in the job's runtime_env). Specs are read once per worker.

- RAYTRAIN_FAST_DRILL_SLOW_DATA="<seconds>[:<from_step>[:<rank>]]": sleep before each micro-batch
  is fetched, from optimizer step <from_step> on (default 0), on <rank> only (default every rank).
  The loop counts it as data wait: a data-bound run. Several specs, comma-separated, add up.
- RAYTRAIN_FAST_DRILL_SLOW_STEP="<seconds>[:<from_step>[:<rank>]]": sleep after each optimizer step,
  outside the data wait: on one rank a straggler, from a step on a progressive slowdown
  (e.g. "0.1:0:1,0.2:40" = rank 1 is 0.1 s late every step, and every rank 0.2 s slower from step 40).
- RAYTRAIN_FAST_DRILL_SLOW_SINK="<seconds>": rank 0's metric sinks sleep this long before each
  record (a slow W&B or bucket): the sink backlog grows and, with a small metrics.queue_size,
  records are dropped.
- RAYTRAIN_FAST_DRILL_SLOW_UPLOAD="<seconds>[:<rank>]": each checkpoint upload of <rank> (default
  every rank) starts this much later: ranks whose files reach storage at different times.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def _specs(name: str, rank: int) -> list[tuple[float, int]]:
    """[(seconds, from_step)] of the comma-separated specs of drill `name` that apply to `rank`."""
    specs = []
    for item in filter(None, os.environ.get(name, "").split(",")):
        seconds, *rest = item.split(":")
        from_step = int(rest[0]) if rest and rest[0] else 0
        if len(rest) > 1 and rest[1] and int(rest[1]) != rank:
            continue
        specs.append((float(seconds), from_step))
    return specs


def _delay(specs: list[tuple[float, int]], step: int) -> float:
    return sum(seconds for seconds, from_step in specs if step >= from_step)


def slow_data(batches: Iterator[T], *, rank: int, current_step: Callable[[], int]) -> Iterator[T]:
    """`batches` itself when RAYTRAIN_FAST_DRILL_SLOW_DATA is unset, else an iterator that sleeps first."""
    specs = _specs("RAYTRAIN_FAST_DRILL_SLOW_DATA", rank)
    if not specs:
        return batches

    def delayed() -> Iterator[T]:
        while True:
            time.sleep(_delay(specs, current_step()))  # inside the loop's next(data): measured as data wait
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    return delayed()


class _SlowStep:
    def __init__(self, rank: int) -> None:
        self._specs = _specs("RAYTRAIN_FAST_DRILL_SLOW_STEP", rank)

    def __call__(self, step: int) -> None:
        if self._specs:
            time.sleep(_delay(self._specs, step))


def slow_step(rank: int) -> Callable[[int], None]:
    """A function to call after each optimizer step; it sleeps when RAYTRAIN_FAST_DRILL_SLOW_STEP says so."""
    return _SlowStep(rank)


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


def slow_sinks(sinks: Sequence[Any]) -> list[Any]:
    """`sinks`, each wrapped to sleep before every record when RAYTRAIN_FAST_DRILL_SLOW_SINK is set."""
    value = os.environ.get("RAYTRAIN_FAST_DRILL_SLOW_SINK")
    if not value:
        return list(sinks)
    return [_SlowSink(sink, float(value)) for sink in sinks]


def slow_upload_s(rank: int) -> float:
    """Seconds each checkpoint upload of `rank` is delayed by RAYTRAIN_FAST_DRILL_SLOW_UPLOAD (0 when unset)."""
    total = 0.0
    for item in filter(None, os.environ.get("RAYTRAIN_FAST_DRILL_SLOW_UPLOAD", "").split(",")):
        seconds, _, only_rank = item.partition(":")
        if not only_rank or int(only_rank) == rank:
            total += float(seconds)
    return total
