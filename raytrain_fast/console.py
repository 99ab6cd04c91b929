"""What the command line prints: every write masked for credentials, colour only on a terminal, and
Ray's start-up and bookkeeping lines that a user needs nothing from left out. Library modules write
their lines through `say`, which knows the rank; only the CLI prints.

Ray forwards worker output to the driver through `print(..., file=sys.stdout/stderr)`, so wrapping
the two streams reaches the workers' lines too. Lines Ray's C++ core writes straight to the file
descriptor cannot be reached from here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
NOISE = (
    "Reporting training result",  # Ray Train's ~1 KB TrainingReport dump per report (also off via LoggingConfig)
    "Started a local Ray instance",
    "Connected to Ray cluster",
    "View the dashboard at",
    "Usage stats collection is",
    "To disable the usage stats collection",
    "See https://docs.ray.io/en/master/cluster/usage-stats.html",
    "Disabling usage stats collection",
    "Token authentication is enabled for this Ray cluster",
    # An E-level line from Ray Train's controller on every run; nothing is wrong.
    "Actor with class name: 'PreemptionWatcher'",
    # Ray Train's placement-group cleanup actor: its monitor thread fails when this machine runs more
    # than one Ray instance ("Found multiple active Ray instances"); training is not affected.
    "(PlacementGroupCleaner pid=",
    "Progress bars disabled. To enable",  # Ray Data, once per worker
    # DeepSpeed on loading a universal checkpoint (a resize): ZeRO-2 here has no tensor parallelism,
    # so tp size 1 is exactly right and the user can do nothing about it.
    "MPU is not provided, setting tp size to 1",
    # Ray Data in a worker whose read failed: advice for Ray Data's own API (the error itself follows,
    # named by the worker's traceback or, for a damaged shard, by the command's one-line error).
    "Dataset execution will now abort. To ignore this exception and continue, set DataContext.max_errored_blocks",
    "Exception occurred in user code, with the abbreviated stack trace below",
)
"""Substrings of lines that are dropped from the console (they stay in Ray's log files)."""
NOISE_WITH_TRACEBACK = (
    # Ray Train's controller when a sweep frees the workers of a trial it stopped early: the workers
    # are gone by design ("expected if one of the workers has crashed"), with an ActorDiedError traceback.
    "Graceful shutdown of backend failed",
    # Ray Train's controller on an overloaded CPU: "safe to ignore", it retries; with a GetTimeoutError traceback.
    "Failed to send resource request for train-",
)
"""Like NOISE, and the traceback lines that follow from the same process go too."""
SWEEP_NOISE_WITH_TRACEBACK = (
    # A trial's worker when its training function raised: a trial over the memory budget, or any other
    # failure; the sweep's table gives its one-line reason and Tune's error.txt under tune/ the whole error.
    "Error in training function:",
    # A trial's actor (run_trial), which Tune ends with SIGTERM once the trial is over: Ray's handler raises
    # SystemExit inside whatever runs then, and Python reports it as ignored. Nothing is wrong.
    "Exception ignored in:",
)
"""Like NOISE_WITH_TRACEBACK while a sweep's trials run (`quiet_lines`): expected outcomes, each one line of the table."""
_TRACEBACK_LINE = re.compile(
    r"^(Traceback |  |\t|During handling|The above exception|The actor is dead because|[\w.]+(: .*)?$|$)"
)
"""A line of a traceback (its frames, the exception line, an actor-death error's indented details)."""
_EXTRA_WITH_TRACEBACK: list[str] = []
"""NOISE_WITH_TRACEBACK added for a while (`quiet_lines`)."""
_PREFIX = re.compile(r"^(\(\S+ pid=\S+?\) )")


def add_command(commands: argparse._SubParsersAction, name: str, summary: str) -> argparse.ArgumentParser:
    """A subcommand whose own --help opens with the summary the command list shows."""
    return commands.add_parser(name, help=summary, description=summary[0].upper() + summary[1:] + ".")


def _on_terminal(stream) -> bool:
    try:
        return bool(stream.isatty()) and "NO_COLOR" not in os.environ
    except (AttributeError, ValueError):
        return False


_last_write = [0.0]  # time.monotonic() of the latest write through any ConsoleStream


def wait_for_quiet(*, quiet_s: float = 1.0, max_s: float = 5.0) -> None:
    """Wait until nothing was written for `quiet_s` (at most `max_s`). Ray forwards the workers'
    lines to the driver asynchronously, so after fit() returns some (rank 1's last lines) may still
    be on the way; the closing `Done.` block should come after them, not between them."""
    deadline = time.monotonic() + max_s
    while (now := time.monotonic()) < deadline:
        left = _last_write[0] + quiet_s - now
        if left <= 0:
            return
        time.sleep(min(left, deadline - now))


class ConsoleStream:
    """A text stream that writes `redact_text(text)` to `stream`, without ANSI colour codes when it
    is not a terminal and without the lines in NOISE."""

    def __init__(self, stream) -> None:
        self._stream = stream
        self._colour = _on_terminal(stream)
        self._dropped_open_line = False
        self._traceback_of: str | None = None
        """The line prefix ("(TrainController pid=1) " or "") whose traceback lines are being dropped."""

    def _is_noise(self, line: str) -> bool:
        match = _PREFIX.match(line)
        prefix = match.group(1) if match else ""
        if self._traceback_of is not None:
            if prefix == self._traceback_of and _TRACEBACK_LINE.match(line[len(prefix):].rstrip("\n")):
                return True
            self._traceback_of = None
        if any(n in line for n in (*NOISE_WITH_TRACEBACK, *_EXTRA_WITH_TRACEBACK)):
            self._traceback_of = prefix
            return True
        return any(n in line for n in NOISE)

    def write(self, text: str) -> int:
        from raytrain_fast.storage.redact import redact_text

        written = len(text)
        _last_write[0] = time.monotonic()
        # print(line) writes the line and its "\n" in two calls: when the line was dropped as noise,
        # its newline goes too, or every dropped line left a blank one behind.
        if self._dropped_open_line and text.startswith("\n"):
            text = text[1:]
        self._dropped_open_line = False
        if self._traceback_of is not None or any(noise in text for noise in (*NOISE, *NOISE_WITH_TRACEBACK, *_EXTRA_WITH_TRACEBACK)):
            lines = text.splitlines(keepends=True)
            kept = [line for line in lines if not self._is_noise(line)]
            self._dropped_open_line = bool(lines) and lines[-1] not in kept and not lines[-1].endswith("\n")
            text = "".join(kept)
        if not self._colour:
            text = _ANSI.sub("", text)
        if text:
            self._unless_gone(self._stream.write, redact_text(text))
        return written

    def flush(self) -> None:
        self._unless_gone(self._stream.flush)

    def _unless_gone(self, call, *args) -> None:
        """A reader that went away closes the pipe (`| tee` ended by the same Ctrl-C, `| head`): from
        then on this stream's output goes to /dev/null, so that printing neither stops the run (a stop
        notice still saves its checkpoint) nor changes its exit status."""
        try:
            call(*args)
        except BrokenPipeError:
            discard_output_of(self._stream)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def quiet_lines(with_traceback: tuple[str, ...]):
    """Within the block, lines holding one of `with_traceback` are dropped from the console with the
    traceback lines that follow them from the same process (a sweep's expected trial outcomes)."""
    _EXTRA_WITH_TRACEBACK.extend(with_traceback)
    try:
        yield
    finally:
        for line in with_traceback:
            _EXTRA_WITH_TRACEBACK.remove(line)


def discard_output_of(stream) -> None:
    """Point `stream`'s file descriptor at /dev/null: what it holds and everything written to it
    later, by Python or by Ray's native code, is dropped without an error."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def configure_console() -> None:
    """Process-wide settings read by Ray: no colour prefix on worker lines unless on a terminal."""
    if not _on_terminal(sys.stdout):
        from raytrain_fast._ray_compat import no_worker_colour_prefix

        no_worker_colour_prefix()


def say(line: str, *, rank: int | None = None, per_rank: bool = False, stderr: bool = False) -> None:
    """Write one line, redacted and flushed, to stdout (`stderr`: to stderr, where a command whose stdout
    is its result puts progress and warnings). `rank` is a training worker's world rank: a worker's line
    is the job's, said once by rank 0, unless `per_rank` (what this rank itself found). The driver and
    actors pass no rank. The stream is looked up at each call, so `contextlib.redirect_stdout` and the
    CLI's wrapped streams apply; in a Ray worker, Ray forwards the line to the driver's console."""
    if rank not in (None, 0) and not per_rank:
        return
    from raytrain_fast.storage.redact import redact_text

    # Masked here too, not only by the driver's ConsoleStream: a worker's own log file keeps no secret
    # either. redact_text is idempotent, so a line masked twice reads the same.
    print(redact_text(line), file=sys.stderr if stderr else sys.stdout, flush=True)


def nothing_to_do(name: str | None, *, steps: int, saved_step: int) -> str:
    """The one line for a run that already reached train.steps, whether the driver finds it in storage
    before Ray starts or a worker finds it after a restart."""
    return (
        f"Run '{name}' already reached train.steps={steps} (checkpoint at step {saved_step}); "
        f"nothing to do. To train further: --set train.steps={max(steps * 2, saved_step + steps)}"
    )
