"""One small exception hierarchy. Every error raised on purpose by the package derives from
`RaytrainFastError`; all of them pickle, so they survive crossing Ray actor boundaries."""

from __future__ import annotations


class RaytrainFastError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(RaytrainFastError, ValueError):
    """A configuration is invalid. The message names each bad field and how to fix it."""

    def __init__(self, problems: list[str] | str, *, source: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [problems]
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        if len(self.problems) == 1:
            message = f"Invalid configuration{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            message = f"Invalid configuration{where} ({len(self.problems)} problems):\n{lines}"
        super().__init__(message)

    def __reduce__(self):  # keep both arguments when pickled across Ray actors
        return (_rebuild_config_error, (self.problems, self.source))


def _rebuild_config_error(problems: list[str], source: str | None) -> ConfigError:
    return ConfigError(problems, source=source)


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
