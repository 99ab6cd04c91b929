"""The tasks of `eval.tasks` inside the step loop. `RunTasks` is built on the driver (the tasks read and
encoded there, every error raised before a worker starts) and reaches the loop in its config as an
object; each worker turns it into `RankTasks`, its share of the batches on its device. The loop's
evaluator (loop/evaluation.py) asks it for the log-likelihoods at its cadence, sums them over the
ranks with the held-out loss in the evaluation's one collective and one host read, and has the
counts made from every request's value on the host, as `raytrain-fast evaluate` makes them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from raytrain_fast.downstream.encode import EncodedTask
from raytrain_fast.downstream.score import ScoringPlan


@dataclass(kw_only=True)
class RunTasks:
    """The run's tasks, encoded for its model and tokenizer (picklable: it travels in the loop config)."""

    tasks: list[EncodedTask]
    window: int

    def note(self, every_steps: int) -> str:
        parts = ", ".join(f"{t.name} ({t.num_items} of {t.total} items, chance {t.chance:.2f})" for t in self.tasks)
        return f"Tasks: {parts}, scored at each evaluation (every {every_steps} steps; docs/evaluation.md)."

    def for_rank(self, *, rank: int, world_size: int, device: torch.device | str, micro_batch: int) -> RankTasks:
        plan = ScoringPlan(self.tasks, micro_batch=micro_batch, device=device, rank=rank, world_size=world_size)
        return RankTasks(self.tasks, plan)


class RankTasks:
    """One rank's share of the run's tasks: its requests' log-likelihoods on the device, and the
    metrics from every request's (summed over all ranks)."""

    def __init__(self, tasks: list[EncodedTask], plan: ScoringPlan) -> None:
        self.tasks, self.plan = tasks, plan
        self.size = plan.num_requests
        """Length of the log-likelihoods tensor."""
        self._marks: tuple[Any, Any] = (None, None)

    def score(self, engine: Any) -> torch.Tensor:
        """This rank's log-likelihoods (device tensor, 0 for other ranks' requests); the caller has the
        model in eval mode under no_grad."""
        start = _mark(self.plan.device)
        loglikelihoods = self.plan.loglikelihoods(engine)  # engine(tokens) -> logits
        self._marks = (start, _mark(self.plan.device))
        return loglikelihoods

    def values(self, loglikelihoods: list[float], *, tokens: int | None) -> dict[str, float]:
        """Metrics from every request's log-likelihood, summed over the ranks (read after the
        evaluation's host read)."""
        values: dict[str, float] = {}
        for task, figures in zip(self.tasks, self.plan.figures(loglikelihoods)):
            values.update({f"eval/{task.name}/{key}": value for key, value in figures.items()})
            values[f"eval/{task.name}/chance"] = task.chance
        scored = sum(task.num_items for task in self.tasks)
        start, stop = self._marks
        if isinstance(stop, float):
            seconds = stop - start
        else:
            stop.synchronize()  # already complete: the counts were read after it
            seconds = start.elapsed_time(stop) / 1e3
        values["time/eval_tasks_s"] = seconds
        values["time/eval_tasks_ms_per_item"] = 1e3 * seconds / max(scored, 1.0)
        if tokens is not None:
            values["eval/tokens"] = float(tokens)
        return values

    def short(self, values: dict[str, float]) -> str:
        """The progress line's part: each task's acc."""
        return "  ".join(f"{task.name} {values[f'eval/{task.name}/acc']:.3f}" for task in self.tasks)


def _mark(device: torch.device) -> Any:
    """The end of the work queued on `device` so far: a recorded CUDA event on a GPU (read after the
    evaluation's host read, so no sync of its own), the host clock on a CPU (ops run as called)."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event
