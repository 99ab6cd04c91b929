"""Held-out evaluation inside the step loop: the `Evaluator` the loop asks on every step whether
this is its step, on the cadence the driver planned (launch/plan.py `resolve_eval`).

An evaluation never disturbs training: it runs between optimizer steps, in eval mode (no dropout,
so no random numbers drawn) under no_grad (no graph, no gradient touched), on a fixed set of
validation sequences held in memory (the training data stream and its position are not used).
It costs one collective and ONE host read; its wall time is left out of the training window
(TrainMetrics.exclude_from_window), so tokens/s, step time, MFU and the slowdown baseline see
training only. The downstream tasks of eval.tasks (raytrain_fast/downstream/, passed in as an
object) are scored in the same evaluation: their counts join the loss sums in that collective and read.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from raytrain_fast.console import say
from raytrain_fast.data.validation import SourceSplit
from raytrain_fast.metrics import TrainMetrics

class Evaluator:
    """val/loss of this rank's share of the fixed validation set, summed across ranks, and the
    downstream tasks' accuracy.

    `tokens`: (n, seq_len + 1) on the training device, this rank's share, in `sources`' parts (each
    source's val/loss/<name>; val/loss is their weighted mean). `tasks`: this rank's share of eval.tasks
    (downstream/in_loop.py), or None. An evaluator with neither (`tokens=None`, `tasks=None`) is never due.
    `start_step`: the step the steps start from (a resumed run's first evaluation is on the cadence).
    """

    def __init__(
        self, *, tokens: torch.Tensor | None, sources: list[SourceSplit], every_steps: int, total_steps: int,
        start_step: int = 0, micro_batch: int, rank: int, world_size: int, tasks: Any = None,
    ) -> None:
        self.tokens, self.sources, self.every_steps, self.total_steps = tokens, sources, every_steps, total_steps
        self.micro_batch, self.rank, self.world_size, self.tasks = micro_batch, rank, world_size, tasks
        self._next_step = (start_step // every_steps + 1) * every_steps
        self._sum = torch.zeros(len(sources), dtype=torch.float32, device=tokens.device) if tokens is not None else None

    @property
    def enabled(self) -> bool:
        return self.tokens is not None or self.tasks is not None

    def due(self, step: int, *, logged: bool, saving: bool) -> bool:
        """On log steps only (right after the drain, where the ranks met, so the evaluation's time is
        its own, and its values join that step's record): the first one at or after each multiple
        of every_steps, the last step, and any log step that saves a checkpoint (which then carries
        a fresh val/loss)."""
        if not (self.enabled and logged and (saving or step == self.total_steps or step >= self._next_step)):
            return False
        self._next_step = (step // self.every_steps + 1) * self.every_steps
        return True

    def run(self, engine: Any, metrics: TrainMetrics, *, step: int, tokens: int | None = None) -> dict[str, float]:
        """Evaluate (every rank, same step: a collective); the values also go to rank 0's sinks.
        `tokens`: tokens trained on so far (recorded with the tasks' accuracy)."""
        start = time.perf_counter()
        sums = self._forward_all(engine)
        own_s = time.perf_counter() - start
        if self.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(sums)
        read = sums.tolist()  # HOST SYNC: the one read of an evaluation
        seconds = time.perf_counter() - start
        # What leaves the training window: on a CPU, where ops run synchronously, only this rank's
        # own forward passes, so that waiting in the all-reduce for a slower rank still counts as
        # training time (a straggler stays visible); on a GPU the host only queued the passes, so
        # the whole evaluation (it follows the log step's drain, where the ranks met).
        metrics.exclude_from_window(own_s if sums.device.type == "cpu" else seconds)
        values = self._loss_values(read[: len(read) - (self.tasks.size if self.tasks else 0)])
        if self.tasks is not None:
            values.update(self.tasks.values(read[len(read) - self.tasks.size:], tokens=tokens))
        values["time/eval_s"] = seconds
        metrics.emit(step, values)
        say(self._line(step, values), rank=self.rank)
        return values

    def _loss_values(self, sums: list[float]) -> dict[str, float]:
        if self.tokens is None:
            return {}
        per_source = {f"val/loss/{s.name}": total / s.total for s, total in zip(self.sources, sums)}
        loss = sum(s.weight * v for s, v in zip(self.sources, per_source.values()))
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 80.0)), **per_source}

    def _line(self, step: int, values: dict[str, float]) -> str:
        parts = [f"step {step}/{self.total_steps}"]
        if "val/loss" in values:
            parts.append(f"val/loss {values['val/loss']:.4f}  val/ppl {values['val/ppl']:.4g}")
        if self.tasks is not None:
            parts.append(self.tasks.short(values))
        return "  ".join([*parts, f"eval {values['time/eval_s']:.2f}s"])

    def _forward_all(self, engine: Any) -> torch.Tensor:
        """Loss sums and task counts on the device (one tensor), in eval mode and no_grad, the training
        mode restored after."""
        module = getattr(engine, "module", engine)  # DeepSpeed's engine keeps the mode on its module
        was_training = module.training
        engine.eval()
        parts = []
        try:
            with torch.no_grad():
                if self.tokens is not None:
                    parts.append(self._loss_sums(engine))
                if self.tasks is not None:
                    parts.append(self.tasks.score(engine))
        finally:
            engine.train(was_training)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _loss_sums(self, engine: Any) -> torch.Tensor:
        self._sum.zero_()  # type: ignore[union-attr]
        parts = self.tokens.split([s.rows for s in self.sources])  # type: ignore[union-attr]
        for index, part in enumerate(parts):
            for batch in part.split(self.micro_batch) if len(part) else ():  # a batch never mixes sources
                loss = engine(batch[:, :-1], batch[:, 1:])
                self._sum[index].add_(loss.detach().float() * batch.shape[0])  # type: ignore[index]
        return self._sum  # type: ignore[return-value]
