"""The micro-batch search both `train.micro_batch: auto` (microbatch/auto.py) and `raytrain-fast sweep`
(sweep/) use: which micro-batches to try (`plan_candidates`, `candidate_micro_batches`) and what to call
a try (`classify_peak`, `classify_error`: ok, over_budget, oom or failed, each with a one-line reason).
The rules and why: docs/sweeps.md#trainmicro_batch-auto.

Neither torch nor Ray is imported at module level (nor the loop or the launcher): cheap to import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, TypeVar

from raytrain_fast.errors import RaytrainFastError

OK, OVER_BUDGET, OOM, FAILED = "ok", "over_budget", "oom", "failed"
_REASON_CHARS = 200

_OOM_ERRORS = frozenset({"OutOfMemoryError"})
"""torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class) and ray.exceptions.OutOfMemoryError
(Ray's memory monitor killed the task): matched by name, also inside Ray's RayTaskError(...) wrappers."""
_OOM_TEXT = ("out of memory", "can't allocate memory", "cannot allocate memory")
"""In an error's text: CUDA's and NCCL's "out of memory", PyTorch's CPU allocator's "can't allocate memory"."""
_KILLED_ERRORS = frozenset({"WorkerCrashedError"})
"""The process died under the task: in a memory search, the kernel's OOM killer."""


class MemoryBudgetExceeded(RaytrainFastError):
    """A measured peak went over resources.memory_budget_gb (raised where nothing else stops a
    process at the budget, e.g. a sweep trial's worker on CPUs). `classify_error` calls it over_budget."""


@dataclass(frozen=True)
class Outcome:
    status: str
    """ok, over_budget, oom or failed."""
    reason: str = ""
    """One line; empty when ok."""

    @property
    def fits(self) -> bool:
        return self.status == OK


# --------------------------------------------------------------------------- candidates


def candidate_micro_batches(global_batch: int, num_workers: int) -> list[int]:
    """The default candidates: powers of two dividing the per-worker batch, and the per-worker batch
    itself. Ascending; empty when num_workers does not divide global_batch."""
    if global_batch <= 0 or num_workers <= 0 or global_batch % num_workers:
        return []
    per_worker = global_batch // num_workers
    values = {m for m in (2**i for i in range(per_worker.bit_length())) if per_worker % m == 0}
    values.add(per_worker)
    return sorted(values)


def plan_candidates(
    global_batch: int, num_workers: int, micro_batches: Iterable[int] | None = None,
) -> tuple[list[tuple[int, int]], list[tuple[int, str]]]:
    """(runnable (micro_batch, grad_accum) pairs, skipped (micro_batch, reason) pairs), both ascending.
    `micro_batches` None: `candidate_micro_batches`."""
    if micro_batches is None:
        micro_batches = candidate_micro_batches(global_batch, num_workers)
    runnable: list[tuple[int, int]] = []
    skipped: list[tuple[int, str]] = []
    for m in sorted(set(micro_batches)):
        per_step = m * num_workers
        if m <= 0:
            skipped.append((m, "micro-batch must be > 0"))
        elif global_batch % per_step:
            skipped.append((m, f"global batch {global_batch} is not a multiple of {m} x {num_workers} worker(s) = {per_step}"))
        else:
            runnable.append((m, global_batch // per_step))
    return runnable, skipped


# --------------------------------------------------------------------------- outcome


def classify_peak(peak_gb: float | None, budget_gb: float | None) -> Outcome:
    """A try that ran: ok, or over_budget when its measured peak exceeds the budget (None: no limit)."""
    if peak_gb is not None and budget_gb is not None and peak_gb > budget_gb:
        return Outcome(OVER_BUDGET, f"over memory budget: peak {peak_gb:.3f} GB > budget {budget_gb:.3f} GB")
    return Outcome(OK)


def classify_error(error: BaseException) -> Outcome:
    """A try that raised: over_budget (a MemoryBudgetExceeded anywhere in the chain), oom, or failed
    with the deepest error's last line. Follows `__cause__`, Ray's RayTaskError.cause and Ray Train's
    controller_failure / worker_failures."""
    chain = _error_chain(error)
    deepest_first = chain[::-1]
    for candidate in deepest_first:
        if _is_a(candidate, {MemoryBudgetExceeded.__name__}):
            return Outcome(OVER_BUDGET, f"over memory budget: {_line(candidate)}")
    for candidate in deepest_first:
        if _is_a(candidate, _KILLED_ERRORS):
            return Outcome(OOM, f"out of memory: process killed ({type(candidate).__name__}: {_line(candidate)})")
        lines = [line.strip() for line in str(candidate).splitlines() if line.strip()]
        said = [line for line in lines if any(words in line.lower() for words in _OOM_TEXT)]
        if said or _is_a(candidate, _OOM_ERRORS):
            line = (said or lines or [type(candidate).__name__])[0]
            return Outcome(OOM, f"out of memory: {line[:_REASON_CHARS]}")
    for candidate in deepest_first:
        lines = [line.strip() for line in str(candidate).splitlines() if line.strip()]
        if lines:
            return Outcome(FAILED, f"{type(candidate).__name__}: {lines[-1][:_REASON_CHARS]}")
    return Outcome(FAILED, type(error).__name__)


def _error_chain(error: BaseException) -> list[BaseException]:
    """The error and all behind it, outermost first (breadth first, each once)."""
    chain: list[BaseException] = []
    queue: list[Any] = [error]
    while queue:
        current = queue.pop(0)
        if not isinstance(current, BaseException) or any(current is seen for seen in chain):
            continue
        chain.append(current)
        queue += [current.__cause__, getattr(current, "cause", None), getattr(current, "controller_failure", None)]
        queue += list((getattr(current, "worker_failures", None) or {}).values())
    return chain


def _is_a(error: BaseException, names: Iterable[str]) -> bool:
    """By class name along the MRO: Ray re-raises a task's error as a subclass named RayTaskError(<Name>)."""
    return any(cls.__name__ in names for cls in type(error).__mro__)


def _line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0][:_REASON_CHARS] if lines else type(error).__name__


# --------------------------------------------------------------------------- choice

T = TypeVar("T")


def fastest(results: Iterable[T]) -> T | None:
    """The ok result with the most tokens/s (anything with `status` and `tokens_per_sec`), or None."""
    done = [r for r in results if r.status == OK and r.tokens_per_sec is not None]  # type: ignore[attr-defined]
    return max(done, key=lambda r: r.tokens_per_sec) if done else None  # type: ignore[attr-defined]
