"""Python garbage collection under control in the step loop.

A full (generation 2) collection walks every tracked object: with a large heap it takes tens to
hundreds of milliseconds and lands at a different step on every rank, which makes stragglers. So,
after setup: freeze the heap (everything alive now is never scanned again), stop automatic full
collections, and run one timed full collection every N steps instead, on all ranks at the same
step. Young-generation collections stay automatic (they are cheap). Every collection, automatic or
not, is timed through `gc.callbacks` so the slowdown detector can name GC as a cause.
"""

from __future__ import annotations

import gc
import time

# Automatic full collections happen when generation 1 has been collected this many times; a
# threshold this high means never (0 would mean "always", not "off").
_NEVER = 2**31 - 1


class GcControl:
    """Freezes the heap, owns full collections and measures the time every collection takes."""

    def __init__(self, *, every_steps: int) -> None:
        self.every_steps = every_steps
        self.active = False
        self.collect_s = 0.0
        """Seconds spent in any collection (automatic or ours) since start()."""
        self.num_collections = 0
        self._started_at: float | None = None
        self._saved_threshold: tuple[int, int, int] | None = None

    def _callback(self, phase: str, info: dict) -> None:
        # Runs inside the collector, in whichever thread triggered it (the GIL is held throughout,
        # so every thread, the training thread included, is paused for the whole collection).
        if phase == "start":
            self._started_at = time.perf_counter()
        elif self._started_at is not None:
            self.collect_s += time.perf_counter() - self._started_at
            self.num_collections += 1
            self._started_at = None

    def start(self) -> None:
        """Call once setup is done (model, engine, data built): collect, freeze, take over."""
        gc.callbacks.append(self._callback)
        if self.every_steps <= 0:
            self.active = True  # measure only; Python's GC runs as usual
            return
        gc.collect()
        gc.freeze()
        self._saved_threshold = gc.get_threshold()
        young, middle, _ = self._saved_threshold
        gc.set_threshold(young, middle, _NEVER)
        self.active = True

    def step(self, step: int) -> bool:
        """One timed full collection on every `every_steps`-th step. True if it collected."""
        if not self.active or self.every_steps <= 0 or step % self.every_steps:
            return False
        gc.collect(2)  # timed by the callback
        return True

    def close(self) -> None:
        """Give Python's GC back its own settings."""
        if not self.active:
            return
        self.active = False
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        if self._saved_threshold is not None:
            gc.set_threshold(*self._saved_threshold)
            gc.unfreeze()
            self._saved_threshold = None
