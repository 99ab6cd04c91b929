"""Every reach into Ray's private modules, in one place, each with the public fallback it takes.

Read on Ray 2.60 (pyproject.toml caps Ray at the minor release CI runs). Each function below tries
Ray's private name first and, where a Ray version has moved or dropped it, falls back to a public
way of doing the same (or to doing nothing where the thing is only cosmetic), so a Ray upgrade
degrades a feature instead of breaking a run. Names of private loggers and files, which only filter
or classify, are constants here too.
"""

from __future__ import annotations

import os
from typing import Any, Callable

TESTED_RAY = ("2.60.0",)

TRAIN_CONTEXT_LOGGER = "ray.train.v2._internal.execution.context"
"""Ray Train's per-report INFO line (a ~1 KB `TrainingReport(...)` dump) logs here."""
TRAIN_ERROR_LOGGER = "ray.train.v2._internal.util"
"""Ray Train logs a worker's failure here, with its traceback ("Error in training function:")."""
DATA_EXECUTOR_LOGGER = "ray.data._internal.execution.streaming_executor"
"""Ray Data's per-Dataset 'execution finished' summary logs here."""
DATA_ITERATOR_THREADS = ("iter_threaded",)
"""The threads Ray Data's batch iterators start in the process that iterates and that call `ray.get` until
they end (ray/data/_internal/block_batching). Its "Prefetcher" thread outlives the iterator, parked on a
condition between blocks (only a `ray.wait` with timeout 0 in between): it is not waited for."""
TRAIN_COLLECTIVE_FILES = ("ray/train/collective", "ray/train/v2/_internal/execution/train_fn_utils")
"""Where a Ray Train worker waits on the other ranks (a py-spy frame in one of them is a collective wait)."""


def canonicalize_bootstrap_address() -> Callable[[str | None], str] | None:
    """Ray's own resolver of the address `ray.init()` joins (RAY_ADDRESS, "auto", then the recorded
    cluster), or None where this Ray has none (nothing is pinned then; Ray resolves as before)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address as canonicalize
    except ImportError:  # pragma: no cover - another Ray version
        return None
    return canonicalize


def preemption_info_reader() -> Callable[[], Any] | None:
    """A function returning this Ray Train worker's copy of the preemption notice without a barrier,
    or None where this Ray keeps it elsewhere or this is not a Ray Train worker (the caller then
    uses the public `ray.train.get_preemption_info`, a barrier)."""
    try:
        from ray.train.v2._internal.execution.context import get_train_context

        context = get_train_context().preemption_context
    except Exception:  # noqa: BLE001 - any Ray version or mode without it
        return None
    return lambda: context.preemption_info


def create_ray_data_cluster_actors() -> None:
    """Create Ray Data's cluster-wide detached actors (its stats actor and autoscaling coordinator)
    from this process, so they live on its node. Where the private helpers are missing, a one-row
    dataset run here creates the same actors."""
    try:
        from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
            get_or_create_autoscaling_coordinator,
        )
        from ray.data._internal.stats import get_or_create_stats_actor

        get_or_create_stats_actor()
        get_or_create_autoscaling_coordinator()
    except (ImportError, AttributeError):  # another Ray version
        import ray.data

        for _ in ray.data.range(1).iter_batches():
            pass


def stop_retrying_on(controller_kwargs: dict[str, Any], is_final: Callable[[BaseException], bool]) -> dict[str, Any]:
    """Ray Train's controller arguments (`DataParallelTrainer._initialize_and_run_controller`) with its
    failure policy wrapped: a worker group failure in which any worker raised an error that `is_final`
    accepts ends the run at once; every other failure (a crash, a lost node, a preemption) goes to
    Ray's policy and its FailureConfig budgets. Another Ray: the arguments as they are (every failure
    is retried; the driver still names the error in one line)."""
    try:
        from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
    except ImportError:  # pragma: no cover - another Ray version
        return controller_kwargs
    inner = controller_kwargs.get("failure_policy")
    if inner is None:
        return controller_kwargs

    class StopOnFinalErrors(FailurePolicy):
        def __init__(self, policy: Any) -> None:
            super().__init__(policy.failure_config)
            self.policy = policy

        def make_decision(self, training_failed_error: Any) -> Any:
            failures = getattr(training_failed_error, "worker_failures", None) or {}
            if any(is_final(error) for error in failures.values()):
                return FailureDecision.RAISE
            return self.policy.make_decision(training_failed_error)

    return {**controller_kwargs, "failure_policy": StopOnFinalErrors(inner)}


def quiet_worker_tracebacks_of(errors: tuple[type, ...]) -> None:
    """In this Ray Train worker: Ray Train's traceback of a failure that ends with one of `errors` off
    the console (the driver prints that error's one-line message); every other failure keeps its
    traceback. Another Ray: nothing changes."""
    import logging
    import re

    names = "|".join(re.escape(f"{error.__module__}.{error.__qualname__}") for error in errors)
    final = re.compile(rf"^({names})(:|$)", re.MULTILINE)

    class DropFinalErrorTracebacks(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            return not (message.startswith("Error in training function") and final.search(message))

    logger = logging.getLogger(TRAIN_ERROR_LOGGER)
    if not any(type(f).__name__ == DropFinalErrorTracebacks.__name__ for f in logger.filters):
        logger.addFilter(DropFinalErrorTracebacks())


def quiet_train_report_logger() -> None:
    """Ray Train's per-report INFO line off in this worker (its logger is named after its file, outside
    `ray.train`, so RunConfig's LoggingConfig does not reach it). Another Ray: the console filter drops it."""
    import logging

    logging.getLogger(TRAIN_CONTEXT_LOGGER).setLevel(logging.WARNING)


def checkpoint_snapshot_name() -> str:
    """The file in a run directory where Ray Train keeps its snapshot of reported checkpoints."""
    try:
        from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

        return CHECKPOINT_MANAGER_SNAPSHOT_FILENAME
    except ImportError:  # the name Ray 2.60 uses
        return "checkpoint_manager_snapshot.json"


def health_check_interval_s() -> float:
    """Ray Train's controller polls each worker this often: its health-check interval, as the
    environment sets it (Ray passes the variable to the controller); 2.60's default otherwise."""
    try:
        from ray.train.v2._internal.constants import DEFAULT_HEALTH_CHECK_INTERVAL_S, HEALTH_CHECK_INTERVAL_S_ENV_VAR
    except ImportError:  # the names and default of Ray 2.60
        DEFAULT_HEALTH_CHECK_INTERVAL_S, HEALTH_CHECK_INTERVAL_S_ENV_VAR = 2.0, "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    return float(os.environ.get(HEALTH_CHECK_INTERVAL_S_ENV_VAR, DEFAULT_HEALTH_CHECK_INTERVAL_S))


def remove_placement_group_by_hex(group_id: str) -> None:
    """Remove the placement group whose id a trial reported (hex); nothing where it is gone already."""
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    try:
        from ray._raylet import PlacementGroupID

        remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
    except Exception:  # noqa: BLE001 - already removed, or another Ray version
        pass


def wait_for_ray_data_iterators(timeout_s: float = 10.0) -> list[str]:
    """Before `ray.shutdown()` in a process that iterated a Ray Data dataset itself (not in a Ray worker):
    finalize abandoned batch iterators and wait for their threads to end. A thread still in a `ray.wait`
    or `ray.get` when the core worker shuts down makes Ray end the whole process ("The core worker has
    already been shutdown"), exit status 1 with no other output. Returns the threads still alive."""
    import gc
    import threading
    import time

    gc.collect()  # an abandoned iterator's finalizer stops its prefetcher thread
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if thread.name in DATA_ITERATOR_THREADS and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))
    return [t.name for t in threading.enumerate() if t.name in DATA_ITERATOR_THREADS and t.is_alive()]
