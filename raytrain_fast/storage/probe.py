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

from raytrain_fast.storage.errors import StorageError

T = TypeVar("T")
PROBE_TIMEOUT_S = 30.0
"""Longest any start-up storage probe may take (each request has its own shorter timeouts)."""


def call_with_timeout(fn: Callable[[], T], *, timeout_s: float = PROBE_TIMEOUT_S, what: str, fix: str) -> T:
    """fn() in a daemon thread; its result or exception, StorageError after timeout_s.

    what: the action in words ("reach s3://bucket/runs at endpoint http://..."); fix: the advice.
    """
    outcome: dict[str, object] = {}

    def target() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as error:  # noqa: BLE001 - re-raised in the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=target, name="raytrain-fast-storage-probe", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive():
        if time.monotonic() >= deadline:
            raise StorageError(f"Timed out after {timeout_s:.0f} s trying to {what}. {fix}")
        thread.join(0.1)  # short waits: the main thread stays interruptible by Ctrl-C
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]
    return outcome["value"]  # type: ignore[return-value]
