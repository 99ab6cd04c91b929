"""The sink thread: the training thread hands each record to `SinkWriter`, which puts it on a bounded
queue and returns; one daemon thread feeds every `MetricSink` in order. A slow or stuck sink (a
network stall in W&B, a slow bucket) costs the training thread nothing. When the queue is full the
oldest record is dropped and counted (`sink/dropped`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
import logging
from typing import Any, Protocol

logger = logging.getLogger("raytrain_fast.metrics")


class MetricSink(Protocol):
    """Where metrics go. Called from the sink thread only, never from the training thread."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


_FLUSH = ("__flush__",)  # queue marker: flush the sinks, in order with the records before it


class SinkWriter:
    """A bounded queue and one daemon thread that feeds every sink in order.

    The thread first opens every sink that has an `open` (W&B's import and `wandb.init`,
    TensorBoard's writer: seconds of CPU), so a writer built during setup has its sinks open
    before training starts instead of taking those seconds from the first steps.
    `log` never blocks and never raises because of a sink. A sink that raises is reported once
    (a warning naming it) and counted in `errors`; the other sinks keep going.
    """

    def __init__(self, sinks: Sequence[MetricSink], *, max_queue: int = 1000, close_timeout_s: float = 60.0) -> None:
        self.sinks = list(sinks)
        self.max_queue = max_queue
        self.close_timeout_s = close_timeout_s
        self.dropped = 0
        """Records dropped because the queue was full (oldest first)."""
        self.errors = 0
        """Sink calls that raised."""
        self._cpu_in_calls = 0.0
        self._queue: deque[tuple[dict[str, float], int] | None] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._warned: set[tuple[str, str]] = set()
        self.opened = threading.Event()
        """Set once every sink's `open` has returned (or raised)."""
        self._thread = threading.Thread(target=self._run, name="raytrain-fast-metric-sinks", daemon=True)
        self._thread.start()
        # The sink thread's own CPU clock, readable from the training thread while a sink call is
        # still running (a long call would otherwise show up only when it returns).
        try:
            self._clock_id: int | None = time.pthread_getcpuclockid(self._thread.ident)  # type: ignore[arg-type]
        except (AttributeError, OSError):
            self._clock_id = None
        self._last_cpu_s = 0.0

    @property
    def cpu_s(self) -> float:
        """CPU time the sink thread has used so far (time it may have taken from training)."""
        if self._clock_id is not None and self._thread.is_alive():
            with contextlib.suppress(OSError):
                self._last_cpu_s = time.clock_gettime(self._clock_id)
                return self._last_cpu_s
        return max(self._last_cpu_s, self._cpu_in_calls)

    @property
    def backlog(self) -> int:
        """Records waiting for the sink thread."""
        return len(self._queue)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = (dict(metrics), step)
        with self._cond:
            if self._closed:
                return
            if len(self._queue) >= self.max_queue:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(record)
            self._cond.notify()

    def request_flush(self) -> None:
        """Ask every sink to persist what it has (e.g. at a checkpoint), without waiting for it."""
        with self._cond:
            if not self._closed:
                self._queue.append(_FLUSH)
                self._cond.notify()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued record has been handed to the sinks (tests, end of run)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self) -> None:
        """Deliver what is queued, close every sink, stop the thread (bounded by close_timeout_s)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.append(None)  # sentinel: after everything already queued
            self._cond.notify()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "metric sinks did not finish within %.0f s; %d records may be lost", self.close_timeout_s, len(self._queue)
            )

    def _run(self) -> None:
        self._call_all("open")
        self.opened.set()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
                self._busy = item is not None
            if item is None:
                break
            if item is _FLUSH:
                self._call_all("flush")
            else:
                self._call_all("log", *item)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        self._call_all("close")
        with self._cond:
            self._cond.notify_all()

    def _call_all(self, method: str, *args: Any) -> None:
        """`method` of every sink that has it, in order (`log` and `close` are on every sink)."""
        for sink in self.sinks:
            if hasattr(sink, method):
                self._call(sink, method, *args)

    def _call(self, sink: MetricSink, method: str, *args: Any) -> None:
        started = time.thread_time()
        try:
            getattr(sink, method)(*args)
        except Exception as error:  # a sink must never take training down
            self.errors += 1
            name = type(sink).__name__
            if (name, method) not in self._warned:
                self._warned.add((name, method))
                logger.warning("metric sink %s.%s failed (further failures are counted in sink/errors): %r", name, method, error)
        finally:
            self._cpu_in_calls += time.thread_time() - started
