"""The one run workflow, from a config to a fitted Ray TorchTrainer. `run` (`raytrain-fast pretrain`)
checks everything before Ray starts (launch/checks.py), plans the run once (launch/plan.py) and fits
it; `fit_run`, which a sweep trial calls too with its plan (sweep/trial.py), drops Ray's checkpoint
snapshot, starts the run's coordinator and hang watchdog, builds the TorchTrainer and fits it under
the stop notice, then reads the measurements and the divergence verdict."""

from __future__ import annotations

import functools
import logging
import signal
import threading
from dataclasses import dataclass
from typing import Any

from raytrain_fast._ray_compat import checkpoint_snapshot_name, trainer_class, worker_env_flags
from raytrain_fast.config import Config
from raytrain_fast.console import nothing_to_do, say
from raytrain_fast.errors import WILL_REPEAT, DivergenceError, RaytrainFastError, repeating_error
from raytrain_fast.launch.checks import check_run
from raytrain_fast.launch.plan import plan_run
from raytrain_fast.launch.resume import RunSnapshot
from raytrain_fast.loop.hooks import LoopHooks, WindowCallback
from raytrain_fast.loop.worker import LoopInputs
from raytrain_fast.plan import RunPlan
from raytrain_fast.storage import uri_of
from raytrain_fast.storage.filesystem import checksum_env

logger = logging.getLogger("raytrain_fast")


@dataclass(kw_only=True)
class RunResult:
    name: str
    run_dir: str
    """Where the run's checkpoints are: `<storage.uri>/<name>`."""
    checkpoint: str | None
    """The latest checkpoint, or None if the run saved none."""
    metrics: dict
    """Metrics reported with the latest checkpoint."""
    checkpoints: list[tuple[str, dict]]
    """(path, metrics) of every checkpoint kept, oldest first."""
    measurements: dict
    """How many times the coordinator measured each value during this fit (FLOPs, peaks)."""
    stopped_by: str | None = None
    """The signal (SIGTERM, SIGINT) that stopped the run early after a checkpoint; None if it ran to the end."""


def build_trainer(
    plan: RunPlan, *, hooks: LoopHooks | None = None, on_window: WindowCallback | None = None, save_checkpoints: bool = True,
    callbacks: list | None = None,
):
    """A TorchTrainer for the run's plan. `callbacks`: Ray Train run callbacks (a sweep trial's
    TuneReportCallback); the other arguments are the loop's `LoopInputs` (loop/worker.py says what each is)."""
    import ray.train
    from ray.train.torch import TorchConfig, TorchTrainer

    config, resources = plan.config, plan.config.resources
    inputs = LoopInputs(plan=plan, hooks=hooks or LoopHooks(), on_window=on_window, save_checkpoints=save_checkpoints)
    # Ctrl-C takes _StopOnSignal's path, and an error that will repeat is not retried (_ray_compat.trainer_class).
    return trainer_class(TorchTrainer, is_final=will_repeat)(
        functools.partial(_train_loop_without_result_dumps, inputs),  # pickled to every worker
        # gloo/NCCL give up just after the hang watchdog would have acted (Ray's default waits 30 minutes).
        torch_config=TorchConfig(backend="nccl" if resources.use_gpu else "gloo", timeout_s=config.watchdog.process_group_timeout_s()),
        scaling_config=ray.train.ScalingConfig(
            num_workers=resources.scaling_workers(),  # (min, max): elastic, each resize a restart
            elastic_resize_monitor_interval_s=resources.elastic_resize_interval_s,
            use_gpu=bool(resources.use_gpu),
            resources_per_worker={"CPU": resources.cpus_per_worker},
        ),
        run_config=ray.train.RunConfig(
            name=config.name,
            storage_path=plan.run_path.rsplit("/", 1)[0],
            storage_filesystem=plan.filesystem if plan.remote else None,  # local: Ray uses the plain path
            # A drained node (spot reclaim) restarts the run against its own budget: the loop saved
            # a checkpoint on the notice (loop/preemption.py).
            failure_config=ray.train.FailureConfig(
                max_failures=resources.max_failures, max_preemption_failures=resources.max_preemption_failures,
                preemption_grace_s=resources.preemption_grace_s,
            ),
            # Retention (keep_last + keep_best) is ours: Ray's can do one or the other.
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=None),
            worker_runtime_env={"env_vars": {  # every training worker's environment
                "DS_ACCELERATOR": "cuda" if resources.use_gpu else "cpu",
                "OMP_NUM_THREADS": str(resources.cpus_per_worker),
                **worker_env_flags(),  # Ray's own: its print patch off (every line would come twice)
                **checksum_env(config.storage),  # S3 clients built in the workers upload as the driver's do
            }},
            callbacks=callbacks,
            # Ray Train's own INFO lines (start-up, each report) stay in its log files, off the console.
            logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        ),
    )


def will_repeat(error: BaseException) -> bool:
    """A worker's error that a restart would meet again (errors.WILL_REPEAT): the run ends at once."""
    return repeating_error(error) is not None


def _train_loop_without_result_dumps(inputs: LoopInputs) -> None:
    """The step loop, with Ray Train's per-report INFO line (a ~1 KB `TrainingReport(...)` dump) off
    in the worker, where it logs. An error that will repeat (a ConfigError or DataError, also inside a
    Ray task's error) leaves the worker as itself and without Ray Train's traceback on the console:
    the failure policy ends the run on it and the driver prints its line."""
    from raytrain_fast.loop.train_loop import train_loop_per_worker

    from raytrain_fast._ray_compat import quiet_train_report_logger, quiet_worker_tracebacks_of

    quiet_train_report_logger()
    quiet_worker_tracebacks_of(WILL_REPEAT)  # the driver prints their one line
    try:
        train_loop_per_worker(inputs)
    except Exception as error:
        repeated = repeating_error(error)
        if repeated is None or repeated is error:
            raise
        raise repeated from None  # itself, not the Ray task error around it: the failure policy and the driver see it


def drop_ray_run_snapshot(plan: RunPlan) -> None:
    """Remove Ray Train's snapshot of reported checkpoints from the run directory before fit().

    Ray keeps every checkpoint ever reported in that snapshot and refuses to start a new driver on
    the run ("a reference to a checkpoint that does not exist anymore") once one of them is gone;
    our retention (keep_last + keep_best) deletes checkpoints Ray still lists. A run resumes from
    our own manifests (Checkpointer.restore_state), never from Ray's snapshot, so nothing is lost.
    """
    import pyarrow.fs as pafs

    path = f"{plan.run_path}/{checkpoint_snapshot_name()}"
    if plan.filesystem.get_file_info(path).type == pafs.FileType.File:
        plan.filesystem.delete_file(path)


def run_result(snapshot: RunSnapshot, *, name: str, metrics: dict, measurements: dict, stopped_by: str | None = None) -> RunResult:
    """The run as storage holds it after retention (what a rerun resumes from): every complete
    checkpoint, oldest first, with its metrics at save time; `metrics` where the run kept none."""
    now = RunSnapshot.of(snapshot.filesystem, snapshot.run_path, run_uri=snapshot.run_uri)
    kept = [(uri_of(path, like=snapshot.run_uri), now.state(path).metrics) for _, path in reversed(now.complete)]
    return RunResult(
        name=name, run_dir=snapshot.run_uri, checkpoint=kept[-1][0] if kept else None,
        metrics=dict(kept[-1][1] if kept else metrics), checkpoints=kept, measurements=measurements, stopped_by=stopped_by,
    )


def run(config: Config, *, create_bucket: bool = False, hooks: LoopHooks | None = None) -> RunResult:
    """`raytrain-fast pretrain`: the checks, the plan, then `fit_run`. Same name + same storage = the
    run continues from its latest checkpoint. `hooks`: drills and fault injection for the loop
    (tests, `pretrain --drill`); none by default."""
    checked = check_run(config, create_bucket=create_bucket)
    name, state = checked.config.name or "", checked.state
    if state is not None and state.step >= checked.config.train.steps:
        for line in (*checked.lines, nothing_to_do(name, steps=checked.config.train.steps, saved_step=state.step)):
            say(line)
        return run_result(checked.snapshot, name=name, metrics=state.metrics, measurements={})  # no Ray, no workers
    plan = plan_run(checked)
    for line in (plan.summary, *plan.lines):
        say(line)
    fitted = fit_run(plan, hooks=hooks)
    return run_result(checked.snapshot, name=name, metrics=fitted.result.metrics or {}, measurements=fitted.measurements,
                      stopped_by=fitted.stopped_by)


@dataclass(kw_only=True)
class Fitted:
    """What `fit_run` returns: Ray Train's Result, and the measurements and stopped_by of RunResult."""

    result: Any
    measurements: dict
    stopped_by: str | None


class HungRun(RaytrainFastError):
    """The hang watchdog ended a worker group and no restart followed: the message names the step,
    the stuck ranks, the top of their stacks and where all the stacks are."""


def fit_run(
    plan: RunPlan, *, hooks: LoopHooks | None = None, on_window: WindowCallback | None = None,
    save_checkpoints: bool = True, callbacks: list | None = None, controller_poll_s: float | None = None,
) -> Fitted:
    """The path every run takes once it is checked and planned (`pretrain` and each sweep trial):
    Ray Data's actors on this node, Ray's checkpoint snapshot dropped, the run's
    coordinator and hang watchdog, the TorchTrainer fitted under the stop notice, then the
    measurements and the divergence verdict; the coordinator ends with the fit.

    Raises DivergenceError when the workers left that verdict, HungRun when the watchdog ended the
    last worker group, a ConfigError or DataError a worker raised as itself. `controller_poll_s`:
    Ray Train's controller polls the workers this often during the fit (a sweep trial's windows are
    short); the arguments in between are `build_trainer`'s."""
    from raytrain_fast._ray_compat import controller_poll_interval, create_ray_data_cluster_actors
    from raytrain_fast.coordinator import Coordinator

    create_ray_data_cluster_actors()
    drop_ray_run_snapshot(plan)
    # One named actor per run, owned by this driver (coordinator.py); kept referenced until fit() returns.
    coordinator = Coordinator.start(plan.config.name or "run")
    try:
        watchdog = plan.config.watchdog  # held by the actor (it outlives group restarts); stacks to <run>/hangs/
        if watchdog.enabled:
            coordinator.start_watchdog(
                timeout_s=watchdog.hang_timeout_s, min_timeout_s=watchdog.min_timeout_s,
                beat_interval_s=watchdog.beat_interval_s(), filesystem=plan.filesystem, run_path=plan.run_path,
            )
        trainer = build_trainer(plan, hooks=hooks, on_window=on_window, save_checkpoints=save_checkpoints, callbacks=callbacks)
        with _StopOnSignal(coordinator) as stop, controller_poll_interval(controller_poll_s):
            result = fit(trainer, coordinator, plan)
        measurements, diverged = coordinator.measurements(), coordinator.divergence()
    finally:  # quiet when Ray is gone: that must not hide the run's own error
        coordinator.end()
    if diverged:  # the workers ended normally (so Ray did not restart them): the run failed
        raise DivergenceError(diverged)
    return Fitted(result=result, measurements=measurements, stopped_by=stop.signal_name)


def fit(trainer, coordinator, plan: RunPlan):
    """trainer.fit(). A failure after the watchdog ended a group that no new group followed (its hang
    not yet announced by a restarted rank 0) is raised as HungRun, naming the hang; a ConfigError or
    DataError that ended it in a worker as itself (its one-line message, exit status 2 from the
    command line), not as Ray's worker group error."""
    try:
        return trainer.fit()
    except Exception as error:
        repeated = repeating_error(error)
        try:
            hangs = coordinator.take_hangs()
        except Exception:  # noqa: BLE001 - the coordinator is gone: the failure as it is
            hangs = []
        if hangs:
            raise HungRun(hang_summary(hangs[-1], plan=plan)) from (repeated or error)
        if repeated is None:
            raise
        raise repeated from None


def hang_summary(record: dict, *, plan: RunPlan) -> str:
    """One line for a hang that ended a run (the watchdog's record, watchdog/stacks.py)."""
    ranks = record["stuck_ranks"]
    tops = "; ".join(f"rank {r}: {record['ranks'][str(r)]['top']}" for r in ranks)
    return (
        f"hang at step {record['step']}: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} completed no "
        f"step for {record['stuck_s']:.0f} s (top of stack: {tops}); the hang watchdog ended the workers and no restart "
        f"was left (resources.max_failures={plan.config.resources.max_failures}). All stacks: "
        f"{plan.run_uri}/{record['stacks_file']}"
    )


class _StopOnSignal:
    """While fit() runs: the first SIGTERM or SIGINT (Ctrl-C) asks the workers, through the
    coordinator, to save a checkpoint at their next log step and stop; a second one stops at once.

    The handler only records the signal (it may run inside a blocking Ray call); a small thread
    sends the request. Outside the main thread (where Python allows no handlers) it does nothing.
    """

    def __init__(self, coordinator) -> None:
        self.coordinator = coordinator
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        self._event = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _StopOnSignal:
        if threading.current_thread() is not threading.main_thread():
            return self
        for number in (signal.SIGTERM, signal.SIGINT):
            self._previous[number] = signal.signal(number, self._handle)
        self._thread = threading.Thread(target=self._send, name="raytrain-fast-stop", daemon=True)
        self._thread.start()
        return self

    def _handle(self, number: int, frame) -> None:
        name = signal.Signals(number).name
        if self.signal_name is not None:  # the second notice: stop now
            self._restore()
            say(f"{name} again: stopping now without a checkpoint.")
            raise KeyboardInterrupt
        self.signal_name = name
        self._event.set()  # first: the request goes out whatever printing does
        say(f"{name}: saving a checkpoint at the next log step, then stopping (send it again to stop at once).")

    def _send(self) -> None:
        self._event.wait()
        if self.signal_name is not None:
            self.coordinator.request_stop(self.signal_name)

    def _restore(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)
        self._previous.clear()

    def __exit__(self, *exc) -> None:
        self._restore()
        self._event.set()  # lets the thread end
        if self._thread is not None:
            self._thread.join(timeout=5)
