"""Every reach into Ray's internals, in one place, each with the public fallback it takes: its private
modules, the private methods of its classes that we override, and its internal environment flags.

Read on Ray 2.60 (pyproject.toml caps Ray at the minor release CI runs). Each function below tries
Ray's private name first and, where a Ray version has moved or dropped it, falls back to a public
way of doing the same (or to doing nothing where the thing is only cosmetic), so a Ray upgrade
degrades a feature instead of breaking a run; where the fallback changes what a user sees, it says
so in one warning line. Names of private loggers, files and environment flags are constants here too
(tests/test_structure.py keeps every such reach in this module or engine/deepspeed_compat.py).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from typing import Any, Callable

TESTED_RAY = ("2.60.0",)

_logger = logging.getLogger("raytrain_fast.compat")
_WARNED: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    """One warning line per process for a fallback (`key` names it)."""
    if key not in _WARNED:
        _WARNED.add(key)
        import ray

        _logger.warning("Ray %s: %s (tested on %s).", ray.__version__, message, ", ".join(TESTED_RAY))


def _train_constant(name: str, default: Any) -> Any:
    """A constant of Ray Train v2's private constants module, or the value Ray 2.60 gives it."""
    try:
        from ray.train.v2._internal import constants
    except ImportError:  # pragma: no cover - another Ray version
        return default
    return getattr(constants, name, default)

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
TRAIN_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
"""Where Ray Train 2.60 keeps its snapshot of a run's reported checkpoints, in the run directory
(`checkpoint_snapshot_name` reads Ray's own constant; this name is for code that must not import Ray)."""
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
    from this process, so they live on its node. Ray pins them to the node of the process that first
    needs them, else a training worker's: when that node goes (preemption, an elastic shrink), every
    later dataset fails with ActorDiedError. Where the private helpers are missing, a one-row dataset
    run here creates the same actors."""
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
        FailurePolicy = None  # noqa: N806
    inner = controller_kwargs.get("failure_policy")
    if FailurePolicy is None or inner is None:
        _warn_once("failure-policy", "Ray Train's failure policy is not where it was read: an error that will repeat "
                   "is retried up to resources.max_failures times")
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


def trainer_class(base: type, *, is_final: Callable[[BaseException], bool]) -> type:
    """`base` (Ray Train's TorchTrainer) with two of Ray 2.60's private `DataParallelTrainer` methods
    overridden, each only where the method has the parameters read there (else Ray's own stays, with
    one warning line):

    - `_register_sigint_handler(self, controller)`: fit() installs a SIGINT handler that replaces the
      caller's and aborts the controller on Ctrl-C (no checkpoint, exit 1). Here it installs none, so
      Ctrl-C takes the caller's stop path (launch/trainer.py's `_StopOnSignal`: save, stop, exit 130).
      tests/test_stop_signal.py notices a Ray version that installs its handler another way.
    - `_initialize_and_run_controller(self, **controller_init_kwargs)`: the controller's failure policy
      wrapped by `stop_retrying_on(..., is_final)`."""
    overrides: dict[str, Any] = {}
    if _takes(base, "_register_sigint_handler", ["self", "controller"]):
        overrides["_register_sigint_handler"] = lambda self, controller: None
    else:
        _warn_once("sigint", "TorchTrainer installs its Ctrl-C handler another way: Ctrl-C aborts a run without a checkpoint "
                   "(SIGTERM still saves and stops)")
    if _takes(base, "_initialize_and_run_controller", ["self", "**controller_init_kwargs"]):
        run_controller = base._initialize_and_run_controller

        def _initialize_and_run_controller(self, **controller_kwargs):
            return run_controller(self, **stop_retrying_on(controller_kwargs, is_final))

        overrides["_initialize_and_run_controller"] = _initialize_and_run_controller
    else:
        _warn_once("controller", "TorchTrainer starts its controller another way: an error that will repeat is retried "
                   "up to resources.max_failures times")
    return type("Trainer", (base,), overrides)


def _takes(cls: type, name: str, parameters: list[str]) -> bool:
    """`cls` has a method `name` whose parameters are `parameters` (`**name` for a keyword catch-all)."""
    method = getattr(cls, name, None)
    try:
        found = inspect.signature(method).parameters.values() if method is not None else None
    except (TypeError, ValueError):
        return False
    return found is not None and [("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in found] == parameters


def quiet_worker_tracebacks_of(errors: tuple[type, ...]) -> None:
    """In this Ray Train worker: Ray Train's traceback of a failure that ends with one of `errors` off
    the console (the driver prints that error's one-line message); every other failure keeps its
    traceback. Another Ray: nothing changes."""
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
    logging.getLogger(TRAIN_CONTEXT_LOGGER).setLevel(logging.WARNING)


def checkpoint_snapshot_name() -> str:
    """The file in a run directory where Ray Train keeps its snapshot of reported checkpoints."""
    return _train_constant("CHECKPOINT_MANAGER_SNAPSHOT_FILENAME", TRAIN_SNAPSHOT_FILE)


def _poll_interval_flag() -> str:
    """The environment flag Ray Train's controller reads its poll (health-check) interval from."""
    return _train_constant("HEALTH_CHECK_INTERVAL_S_ENV_VAR", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")


def health_check_interval_s() -> float:
    """Ray Train's controller polls each worker this often: its health-check interval, as the
    environment sets it (Ray passes the variable to the controller); 2.60's default otherwise."""
    return float(os.environ.get(_poll_interval_flag(), _train_constant("DEFAULT_HEALTH_CHECK_INTERVAL_S", 2.0)))


@contextlib.contextmanager
def _environ(variable: str, value: str) -> Iterator[None]:
    """`variable` set to `value` in this process's environment for the block, then as it was."""
    saved = os.environ.get(variable)
    os.environ[variable] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved


def controller_poll_interval(seconds: float | None) -> contextlib.AbstractContextManager[None]:
    """Ray Train's controller polls the workers (and takes one reported result from each) every
    `seconds` in the fit() started inside the block: Ray hands its environment flag to the controller
    that fit() starts. Where the variable is set already, or `seconds` is None, it stays as it is."""
    variable = _poll_interval_flag()
    if seconds is None or variable in os.environ:
        return contextlib.nullcontext()
    return _environ(variable, str(seconds))


def worker_env_flags() -> dict[str, str]:
    """Ray's internal settings for every training worker's environment: Ray Train's print patch off
    (it routes print() through a logger AND the redirected stdout: every line twice)."""
    return {_train_constant("ENABLE_PRINT_PATCH_ENV_VAR", "RAY_TRAIN_ENABLE_PRINT_PATCH"): "0"}


def workers_at_normal_priority() -> None:
    """Before this process starts a local Ray instance: Ray starts its worker processes (training
    workers among them) at niceness 15, so any process at normal priority on the machine takes the
    CPU from training; its raylet setting `worker_niceness`, read from the environment, makes it 0.
    No effect when joining a running cluster; a value already set stays."""
    try:
        from ray._private.ray_constants import RAY_WORKER_NICENESS as variable
    except ImportError:  # pragma: no cover - the name Ray 2.60 reads
        variable = "RAY_worker_niceness"
    os.environ.setdefault(variable, "0")


def no_worker_colour_prefix() -> None:
    """Worker lines forwarded to this driver without Ray's colour codes (read by Ray 2.60's log
    printer, ray/_private/worker.py, from this process's environment); a value already set stays."""
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")


@contextlib.contextmanager
def quiet_tune_output() -> Iterator[None]:
    """Tune's own console output off for the block. Its output engine switched to the old one: the new
    one prints its experiment banner, results path and TensorBoard hint even at verbose=0; the old one,
    chosen by Ray's internal flag RAY_AIR_NEW_OUTPUT=0, is silent at 0. And its per-trial error
    tracebacks, logged by ray.tune, off (a sweep's table has each reason, Tune's error.txt the whole
    error). The previous flag and level come back after."""
    tune_logger = logging.getLogger("ray.tune")
    saved_level = tune_logger.level
    tune_logger.setLevel(logging.CRITICAL)
    try:
        with _environ("RAY_AIR_NEW_OUTPUT", "0"):
            yield
    finally:
        tune_logger.setLevel(saved_level)


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
