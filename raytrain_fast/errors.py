"""One small exception hierarchy. Every error raised on purpose by the package derives from
`RaytrainFastError`; all of them pickle, so they survive crossing Ray actor boundaries.

A ConfigError or DataError meets a retry again (the same settings, the same files): one raised in a
training worker ends the run at once (`WILL_REPEAT`, `repeating_error`), where a crash or a lost
node is retried."""

from __future__ import annotations

import functools


class RaytrainFastError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(RaytrainFastError, ValueError):
    """A configuration is invalid. The message names each bad field and how to fix it."""

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            message = f"Invalid configuration{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"Invalid configuration{where} ({len(self.problems)} problems):\n{lines}"
        super().__init__(message)

    def __reduce__(self):  # keep both arguments when pickled across Ray actors
        return functools.partial(ConfigError, source=self.source), (self.problems,)


class DataError(RaytrainFastError):
    """Input data is missing, unreadable or does not match the model."""


class CheckpointError(RaytrainFastError):
    """A checkpoint cannot be saved or restored."""


class StorageError(RaytrainFastError):
    """Storage is unreachable, missing, not writable or the credentials are missing or refused.

    The message names the endpoint, the bucket or path and the fix; it never contains a secret.
    """


class DivergenceError(RaytrainFastError):
    """Training diverged (non-finite or spiking loss) and the health policy stopped the run
    (docs/health.md). The message names the step, the loss, what was tried and what to change."""


WILL_REPEAT = (ConfigError, DataError)
"""Errors that a retry would meet again: raised in a worker, they end the run without a restart."""


def repeating_error(error: BaseException | None) -> RaytrainFastError | None:
    """The ConfigError or DataError behind `error`, or None: `error` itself, the exception a Ray task
    error wraps (its `cause`), an exception's `__cause__` / `__context__`, or, for Ray Train's
    worker group error, any worker's failure (lowest rank first)."""
    pending, seen = [error], set()
    while pending:
        current = pending.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        wrapped = getattr(current, "cause", None)  # a Ray task error: an instance of its cause's class, Ray's text
        if isinstance(wrapped, BaseException):
            pending.insert(0, wrapped)
            continue
        if isinstance(current, WILL_REPEAT):
            return current
        failures = getattr(current, "worker_failures", None)
        if isinstance(failures, dict):
            pending += [failures[rank] for rank in sorted(failures)]
        pending += [current.__cause__, current.__context__]
    return None
