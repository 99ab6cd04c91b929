"""What the step loop takes from outside: hooks for drills, fault injection, the sequence recorder
and a bench's clock, and a window callback (a sweep trial's Tune report).

Both are passed in by the caller, never read from the environment. A normal run passes
`LoopHooks()`, which holds no hook, so the loop skips every call and no variable left in a shell can
inject a failure into a real run. A hook is a `StepHooks` object: the drills (raytrain_fast/drills/,
which the loop never imports: they arrive pickled in its `LoopInputs`), built by tests or by
`raytrain-fast pretrain --drill NAME=SPEC`, and the overhead bench's clock. Each worker turns the
run's `LoopHooks` into its rank's `RankHooks`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

WindowCallback = Callable[..., None]
"""Called on rank every log step as `on_window(step=..., metrics=...)` with the window's metrics."""


class StepHooks:
    """One concern the loop takes from outside. Every method does nothing by default; the loop calls
    only what some hook overrides. `order`: where this hook's wrappers and calls go among the others
    (lower first: data sources, then drills, then whatever observes them)."""

    order = 1

    def for_rank(self, rank: int) -> StepHooks | None:
        """This hook on worker `rank` (per-rank state is built here, on the worker), or None where it
        does nothing."""
        return self

    def batches(self, data: Iterator[T], *, current_step: Callable[[], int]) -> Iterator[T]:
        """The micro-batches the loop trains on (`data`, or an iterator around it)."""
        return data

    def on_batch(self, seq_ids: Any) -> None:
        """Each micro-batch's sequence ids."""

    def on_loss(self, loss: Any) -> Any:
        """Each micro-batch's loss; returns the loss to back-propagate."""
        return loss

    def after_step(self, step: int) -> None:
        """Step `step` is done."""

    def sinks(self, sinks: Sequence[Any]) -> list[Any]:
        """Rank 0's metric sinks (or sinks around them)."""
        return list(sinks)

    def before_upload(self) -> None:
        """Each checkpoint upload of this rank is about to start (on the upload thread)."""

    def close(self) -> None:
        """The loop ends: stop what the hook started."""


@dataclass(init=False)
class LoopHooks:
    """The hooks a run passes to its loop (picklable: it travels in the `LoopInputs`); none by default."""

    hooks: tuple[StepHooks, ...]

    def __init__(self, *hooks: StepHooks) -> None:
        self.hooks = tuple(hooks)

    def active(self) -> list[str]:
        """The hooks set, one short description each (for a one-line notice on the driver)."""
        return [repr(hook) for hook in self.hooks]

    def for_rank(self, rank: int) -> RankHooks:
        mine = [hook.for_rank(rank) for hook in sorted(self.hooks, key=lambda hook: hook.order)]
        return RankHooks([hook for hook in mine if hook is not None], rank)


def _overrides(hook: StepHooks, name: str) -> bool:
    return getattr(type(hook), name) is not getattr(StepHooks, name)


class RankHooks:
    """One worker's hooks, built once. `on_batch`, `on_loss` and `before_upload` are None where no
    hook overrides them (the loop and the checkpointer then skip the call: nothing on the hot path)."""

    def __init__(self, hooks: Sequence[StepHooks], rank: int) -> None:
        self.rank, self.hooks = rank, list(hooks)
        self.on_batch = self._chain("on_batch")
        self.on_loss = self._chain("on_loss", returns=True)
        self.before_upload = self._chain("before_upload")
        self._after_step = [hook.after_step for hook in self.hooks if _overrides(hook, "after_step")]

    def _chain(self, name: str, *, returns: bool = False) -> Callable[..., Any] | None:
        calls = [getattr(hook, name) for hook in self.hooks if _overrides(hook, name)]
        if not calls:
            return None
        if len(calls) == 1:
            return calls[0]

        def chained(*args: Any) -> Any:
            value = args[0] if args else None
            for call in calls:
                result = call(*(value,) if args else ())
                value = result if returns else value
            return value

        return chained

    def batches(self, data: Iterator[T], *, current_step: Callable[[], int]) -> Iterator[T]:
        for hook in self.hooks:
            data = hook.batches(data, current_step=current_step)
        return data

    def sinks(self, sinks: Sequence[Any]) -> list[Any]:
        for hook in self.hooks:
            sinks = hook.sinks(sinks)
        return list(sinks)

    def after_step(self, step: int) -> None:
        for call in self._after_step:
            call(step)

    def close(self) -> None:
        for hook in self.hooks:
            hook.close()
