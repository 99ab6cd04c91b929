"""Storage calls with a deadline that Ctrl-C can interrupt.

pyarrow blocks inside C++ (the GIL released, no Python signal check) until a request returns, so
a slow or silent endpoint holds the main thread and Ctrl-C waits with it. Probes therefore run in
a daemon thread while the main thread waits in short slices: KeyboardInterrupt arrives at once,
and a probe past its deadline becomes a StorageError that names what was being tried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from raytrain_fast.errors import StorageError

T = TypeVar("T")
_abandoned: list[threading.Event] = []
"""The `finished` events of probes given up on."""
PROBE_TIMEOUT_S = 30.0
"""Longest any start-up storage probe may take (each request has its own shorter timeouts)."""


def call_with_timeout(fn: Callable[[], T], *, timeout_s: float = PROBE_TIMEOUT_S, what: str, fix: str) -> T:
    """fn() in a daemon thread; its result or exception, StorageError after timeout_s.

    what: the action in words ("reach s3://bucket/runs at endpoint http://..."); fix: the advice.
    """
    outcome: dict[str, object] = {}
    finished = threading.Event()

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error
        finally:
            finished.set()

    threading.Thread(target=target, name="raytrain-fast-storage-probe", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        # An Event, not Thread.join: a Ctrl-C inside join() marks a still running thread as
        # stopped (CPython's bpo-45274 handling), which would hide the hung probe.
        while not finished.wait(0.1):  # short waits: the main thread stays interruptible by Ctrl-C
            if time.monotonic() >= deadline:
                raise StorageError(f"Timed out after {timeout_s:.0f} s trying to {what}. {fix}")
    except BaseException:
        _abandoned.append(finished)
        raise
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]


def probe_still_running() -> bool:
    """Whether a probe given up on (timed out, Ctrl-C) is still blocked in pyarrow. Then the process
    should end with os._exit: pyarrow's S3 shutdown at exit would wait for that request."""
    return any(not finished.is_set() for finished in _abandoned)
