"""Score tasks on a model outside training (`raytrain-fast evaluate`): on this process, or on N Ray
workers that each score every N-th batch of every task (downstream/score.py: the batches are the
same whatever N), their log-likelihoods merged. Each request is scored by exactly one worker; an
item's record names the worker of its first choice.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from raytrain_fast.downstream.encode import EncodedTask
from raytrain_fast.downstream.models import ModelSource
from raytrain_fast.downstream.score import ScoringPlan, choose, task_figures


@dataclass(kw_only=True)
class TaskResult:
    name: str
    acc: float
    acc_norm: float
    loglikelihood: float
    """The right choice's log-likelihood, mean per item (nats)."""
    chance: float
    items: int
    """Items scored."""
    cut: int
    """Of them, items whose context was cut from the left to fit the window."""
    skipped: int
    """Items left out: a choice longer than the window by itself."""
    total: int
    """Items in the task's file."""
    seconds: float
    """Wall time of the task's scoring (the slowest worker's, with several)."""

    @property
    def ms_per_item(self) -> float:
        return 1e3 * self.seconds / max(1, self.items)


@dataclass(kw_only=True)
class Evaluation:
    model: str
    step: int | None
    workers: int
    window: int
    precision: str
    micro_batch: int
    tasks: list[TaskResult]
    items: list[dict[str, Any]] = field(default_factory=list)
    """One record per item scored: task, index (its line in the task's file, from 0), gold, choice,
    choice_norm, loglikelihoods (one per choice), characters (acc_norm's divisors), cut, worker (of its first choice)."""

    def to_json(self) -> dict[str, Any]:
        tasks = {t.name: {**{k: v for k, v in asdict(t).items() if k != "name"}, "ms_per_item": t.ms_per_item}
                 for t in self.tasks}
        return {
            "model": self.model, "step": self.step, "workers": self.workers, "window": self.window,
            "precision": self.precision, "micro_batch": self.micro_batch,
            "acc_norm": "log-likelihood per character of the choice, leading whitespace not counted",
            "tasks": tasks, "items": self.items,
        }

    def table(self) -> str:
        rows = [("task", "acc", "acc_norm", "loglik", "chance", "items", "cut", "skipped", "ms/item")]
        rows += [(t.name, f"{t.acc:.4f}", f"{t.acc_norm:.4f}", f"{t.loglikelihood:.3f}", f"{t.chance:.4f}", f"{t.items:,}", f"{t.cut:,}", f"{t.skipped:,}",
                  f"{t.ms_per_item:.1f}") for t in self.tasks]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
                         for row in rows)


def score_shard(
    source: ModelSource, tasks: list[EncodedTask], *, rank: int, world_size: int, micro_batch: int, device: str,
    threads: int | None = None,
) -> dict[str, Any]:
    """Worker `rank` of `world_size`: its batches of every task scored. {"rank": rank, "values": {task:
    [log-likelihood per request, None where another worker scores it]}, "seconds": {task: s}}."""
    from raytrain_fast.engine.deepspeed_engine import enable_tf32

    if threads:
        torch.set_num_threads(threads)
    enable_tf32(torch.device(device))  # fp32 on a GPU as training evaluates it
    forward = source.build(device)
    values: dict[str, list[float | None]] = {}
    seconds: dict[str, float] = {}
    with torch.no_grad():
        for task in tasks:
            start = time.perf_counter()
            plan = ScoringPlan([task], micro_batch=micro_batch, device=device, packed=source.packs, rank=rank, world_size=world_size)
            loglikelihoods = plan.loglikelihoods(forward).tolist()
            seconds[task.name] = time.perf_counter() - start
            mine = {int(r) for batch in plan.batches for r in batch.requests.tolist()}
            values[task.name] = [value if r in mine else None for r, value in enumerate(loglikelihoods)]
    return {"rank": rank, "values": values, "seconds": seconds}


def evaluate(
    source: ModelSource, tasks: list[EncodedTask], *, window: int, step: int | None = None, workers: int = 1,
    micro_batch: int = 16, device: str | None = None, connect_ray: Callable[[], None] | None = None,
) -> Evaluation:
    """Every task's items scored once, on this process (workers=1) or on `workers` Ray tasks
    (`connect_ray` joins or starts Ray first)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if workers <= 1:
        parts = [score_shard(source, tasks, rank=0, world_size=1, micro_batch=micro_batch, device=device)]
    else:
        parts = _on_ray_workers(source, tasks, workers=workers, micro_batch=micro_batch, device=device, connect_ray=connect_ray)
    records: list[dict[str, Any]] = []
    results = []
    for task in tasks:
        loglikelihoods, worker = _merged(task, parts)
        records += _records(task, loglikelihoods, worker)
        figures = task_figures(task, loglikelihoods)
        results.append(TaskResult(
            name=task.name, acc=figures["acc"], acc_norm=figures["acc_norm"], loglikelihood=figures["loglikelihood"],
            chance=task.chance, items=task.num_items, cut=int(figures["cut"]), skipped=len(task.skipped), total=task.total,
            seconds=max(part["seconds"].get(task.name, 0.0) for part in parts),
        ))
    return Evaluation(model=source.description, step=step, workers=max(1, workers), window=window, precision=source.precision,
                      micro_batch=micro_batch, tasks=results, items=records)


def _merged(task: EncodedTask, parts: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """Every request's log-likelihood of `task` from the workers that scored it, and which worker did."""
    loglikelihoods = np.full(len(task.sequences), np.nan)
    worker = np.full(len(task.sequences), -1)
    for part in parts:
        for request, value in enumerate(part["values"][task.name]):
            if value is not None:
                loglikelihoods[request], worker[request] = value, part["rank"]
    return loglikelihoods, worker


def _records(task: EncodedTask, loglikelihoods: np.ndarray, worker: np.ndarray) -> list[dict[str, Any]]:
    """One record per item of `task`, in file order."""
    choice, choice_norm = choose(task, loglikelihoods)
    starts = np.searchsorted(task.request_item, np.arange(task.num_items + 1))
    return [{
        "task": task.name, "index": int(task.item_index[item]), "gold": int(task.gold[item]),
        "choice": int(choice[item]), "choice_norm": int(choice_norm[item]),
        "loglikelihoods": loglikelihoods[a:b].tolist(), "characters": task.characters[a:b].tolist(),
        "cut": bool(task.cut[item]), "worker": int(worker[a]),
    } for item, (a, b) in enumerate(zip(starts[:-1], starts[1:]))]


def _on_ray_workers(
    source: ModelSource, tasks: list[EncodedTask], *, workers: int, micro_batch: int, device: str,
    connect_ray: Callable[[], None] | None,
) -> list[dict[str, Any]]:
    import ray

    if connect_ray is not None:
        connect_ray()
    elif not ray.is_initialized():
        ray.init(configure_logging=False, include_dashboard=False)
    gpu = device.startswith("cuda")
    cpus = 1 if gpu else max(1, int(ray.cluster_resources().get("CPU", 1) // workers))
    task = ray.remote(score_shard).options(num_cpus=cpus, num_gpus=1 if gpu else 0)
    shared_source, shared_tasks = ray.put(source), ray.put(tasks)  # once in the object store, read by every worker
    return ray.get([
        task.remote(shared_source, shared_tasks, rank=rank, world_size=workers, micro_batch=micro_batch,
                    device="cuda" if gpu else "cpu", threads=None if gpu else cpus)
        for rank in range(workers)
    ])
