"""What the step loop takes from outside: a hooks object for fault injection, drills and the
sequence recorder, and a window callback (a sweep trial's Tune report).

Both are passed in by the caller, never read from the environment: a normal run builds the default
`LoopHooks()`, whose every hook is a no-op that the loop skips, so no variable left in a shell can
inject a failure into a real run. Only tests and `raytrain-fast pretrain --drill NAME=SPEC` build
other hooks. `LoopHooks` is a small picklable dataclass (it travels to the workers in the loop
config); each worker turns it into its rank's `RankHooks`.

Drill specs (see loop/drills.py for what each one plants):
- fail_once_at="<step>:<marker file>[:<rank>[:kill]]": one worker raises (or, with `kill`, dies by
  SIGKILL as on a lost node) when it completes <step>, once: the marker file records that it happened.
- record_sequences="<dir>": every rank appends the sequence ids of each step to <dir>/rank<r>.jsonl
  (tests that prove a resumed run sees exactly the same data).
- slow_data / slow_step="<seconds>[:<from_step>[:<rank>]]", comma-separated specs add up.
- slow_sink="<seconds>": rank 0's metric sinks sleep this long before each record.
- slow_upload="<seconds>[:<rank>]": each checkpoint upload of <rank> (default every rank) starts late.
- cpu_burn="<from_step>:<to_step>[:<processes>]": busy processes at normal priority beside rank 0
  between two steps (host contention, a stall).
- hold_memory="<GB>:<from_step>": rank 0 holds that much host memory from a step on (memory pressure).
- hang="<step>:<marker file>[:<rank>[:<seconds>]]": <rank> (default 0) freezes inside <step>, once
  (the marker file records it): SIGSTOP of its own process, or with <seconds> a sleep of its training
  thread (the hang watchdog, watchdog/).
- nonfinite="<step>[:<rank>[:loss|grad]]": <rank> (default 0) makes its loss (default) or only its
  gradient NaN in step <step>, once per worker process (divergence, loop/health.py).
- spike="<step>[:<rank>]": <rank> (default 0) multiplies its loss by 1000 in step <step>, once per
  worker process (a loss and gradient-norm spike).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from raytrain_fast.loop import drills

T = TypeVar("T")

WindowCallback = Callable[..., None]
"""Called on rank every log step as `on_window(step=..., metrics=...)` with the window's metrics."""


@dataclass(frozen=True, kw_only=True)
class LoopHooks:
    """Fault injection, drills and the sequence recorder; the default injects nothing."""

    fail_once_at: str = ""
    record_sequences: str = ""
    slow_data: str = ""
    slow_step: str = ""
    slow_sink: float = 0.0
    slow_upload: str = ""
    cpu_burn: str = ""
    hold_memory: str = ""
    hang: str = ""
    nonfinite: str = ""
    spike: str = ""

    @classmethod
    def from_cli(cls, items: Sequence[str]) -> LoopHooks:
        """`--drill NAME=SPEC` items (NAME a field above). Raises ValueError naming the bad item."""
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for item in items:
            name, sep, spec = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in names:
                raise ValueError(f"--drill {item!r}: expected NAME=SPEC with NAME one of {', '.join(names)}")
            try:
                values[name] = float(spec) if name == "slow_sink" else spec
                if name in ("slow_data", "slow_step"):
                    drills.specs(spec, 0)
                elif name == "slow_upload":
                    drills.upload_delay_s(spec, 0)
                elif name == "cpu_burn":
                    drills.cpu_burn_range(spec)
                elif name == "hold_memory":
                    drills.hold_memory_spec(spec)
                elif name == "hang":
                    drills.hang_spec(spec)
                elif name in ("nonfinite", "spike"):
                    drills.nonfinite_spec(spec, kind="spike" if name == "spike" else "")
                elif name == "fail_once_at" and (len(spec.split(":")) < 2 or not spec.split(":")[0].isdigit()):
                    raise ValueError
            except ValueError:
                raise ValueError(f"--drill {item!r}: malformed SPEC for {name} (see loop/hooks.py for each form)") from None
        return cls(**values)

    def active(self) -> dict[str, Any]:
        """The hooks that are set (for a one-line notice on the driver)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name)}

    def for_rank(self, rank: int) -> RankHooks:
        return RankHooks(self, rank)


class RankHooks:
    """One worker's hooks, built once. Every method returns its input (or does nothing) when unset."""

    def __init__(self, hooks: LoopHooks, rank: int) -> None:
        self.rank = rank
        self._hooks = hooks
        self._slow_step = drills.specs(hooks.slow_step, rank)
        self._recorder = _SequenceRecorder(hooks.record_sequences, rank) if hooks.record_sequences else None
        self.on_batch: Callable[[Any], None] | None = self._recorder.add if self._recorder else None
        """Called with each micro-batch's sequence ids, or None (the loop then skips the call)."""
        self.upload_delay_s = drills.upload_delay_s(hooks.slow_upload, rank)
        burn = drills.cpu_burn_range(hooks.cpu_burn) if rank == 0 else None
        self._burner = drills.CpuBurner(burn) if burn else None
        hold = drills.hold_memory_spec(hooks.hold_memory) if rank == 0 else None
        self._memory = drills.MemoryHolder(hold) if hold else None
        nonfinite = drills.nonfinite_spec(hooks.nonfinite) or drills.nonfinite_spec(hooks.spike, kind="spike")
        self._nonfinite = drills.NonfinitePlanter(nonfinite[0], nonfinite[2]) if nonfinite and nonfinite[1] == rank else None
        self.on_loss: Callable[[Any], Any] | None = self._nonfinite.plant if self._nonfinite else None
        """Called with each micro-batch's loss, returns the loss to back-propagate; or None (skipped)."""

    def batches(self, data: Iterator[T], *, current_step: Callable[[], int]) -> Iterator[T]:
        data = drills.slow_data(data, drills.specs(self._hooks.slow_data, self.rank), current_step=current_step)
        hang = drills.hang_spec(self._hooks.hang)
        if hang is not None and hang[2] == self.rank:
            data = drills.hang_data(data, hang, current_step=current_step)
        return data

    def sinks(self, sinks: Sequence[Any]) -> list[Any]:
        return drills.slow_sinks(sinks, self._hooks.slow_sink)

    def after_step(self, step: int) -> None:
        if self._recorder is not None:
            self._recorder.end_step(step)
        if self._hooks.fail_once_at:
            _maybe_fail(self._hooks.fail_once_at, step=step, rank=self.rank)
        if self._slow_step:
            drills.sleep_for(self._slow_step, step)
        if self._burner is not None:
            self._burner.step(step)
        if self._memory is not None:
            self._memory.step(step)
        if self._nonfinite is not None:
            self._nonfinite.completed(step)

    def close(self) -> None:
        """Stop what a drill started (the cpu_burn processes)."""
        if self._burner is not None:
            self._burner.stop()


def _maybe_fail(spec: str, *, step: int, rank: int) -> None:
    fail_step, marker, *rest = spec.split(":")
    fail_rank = int(rest[0]) if rest else 0
    if step == int(fail_step) and rank == fail_rank and not os.path.exists(marker):
        open(marker, "w").close()
        if rest[1:] == ["kill"]:
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure at step {step} on rank {rank} (drill fail_once_at)")


class _SequenceRecorder:
    def __init__(self, directory: str, rank: int) -> None:
        self.path = os.path.join(directory, f"rank{rank}.jsonl")
        self._ids: list[int] = []

    def add(self, seq_ids: Any) -> None:
        self._ids.extend(seq_ids.tolist())  # a host read: only when recording is on (tests)

    def end_step(self, step: int) -> None:
        with open(self.path, "a") as out:
            out.write(json.dumps({"step": step, "ids": self._ids}) + "\n")
        self._ids = []
