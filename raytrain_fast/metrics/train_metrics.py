"""What the step loop measures, and the one place it reads the device back (every `log_every` steps).

`TrainMetrics` is the loop's one metrics object: the accumulators (accumulators.py, no host syncs), the
log step's collective and ONE host read (agreement.py), the window computation (here), the alerts
(alerts.py), the progress line (progress.py) and the hand-off to the sink thread. docs/architecture.md
(steps 4-6 of the loop) says how they fit.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.console import say
from raytrain_fast.metrics.accumulators import StepAccumulators
from raytrain_fast.metrics.agreement import StepAgreement
from raytrain_fast.metrics.alerts import WindowAlerts
from raytrain_fast.metrics.gc_control import GcControl
from raytrain_fast.metrics.host import HostSampler
from raytrain_fast.metrics.memory import GB, host_memory_gb, memory_in_use_gb, peak_memory_gb, reset_peak_memory
from raytrain_fast.metrics.peak import mfu
from raytrain_fast.metrics.progress import progress_line
from raytrain_fast.metrics.setup import MfuInputs
from raytrain_fast.metrics.sinks import SinkWriter
from raytrain_fast.metrics.slowdown import Window

_HOST_FLOATS = 5  # per rank, gathered on log steps: seconds to reach the drain, data wait, GC, CPU share, CPU wait


@dataclass(frozen=True, kw_only=True)
class StepPlan:
    """The run's steps as the metrics count them: where the log windows end and what a step is worth."""

    log_every: int
    """A window ends every this many steps (train.log_every), and at the last step."""
    total_steps: int
    start_step: int = 0
    """The step this process starts after (a resumed run's checkpoint)."""
    tokens_per_step: int
    """Tokens per optimizer step across all ranks."""

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps


class TrainMetrics:
    """Metrics of one worker's step loop. Construct it on every rank after setup (model, engine and
    data built: it freezes the heap for GC control), right before the first step.

    Per step (hot path, no host sync): engine/step.py's `train_step` records into it (`begin_step`,
    `lap`, `add_loss`, `add_grad_norm`), then `end_step(step)`; on log steps every rank calls
    `log(step, ...)`: a collective and ONE host sync.

    Checkpoints: `record_checkpoint(blocked_s=...)` after a save, and `record_checkpoint(upload_s=...)`
    when an async upload reports its duration.
    """

    def __init__(
        self, config: MetricsConfig, *, steps: StepPlan, device: torch.device | str, rank: int = 0, world_size: int = 1,
        mfu: MfuInputs | None = None, memory_budget_gb: float | None = None, niceness: int | None = None,
        sinks: SinkWriter | None = None, print_progress: bool = True,
    ) -> None:
        self.steps, self.world_size = steps, world_size
        self.is_log_step = steps.is_log_step
        self.flops_per_token = mfu.flops_per_token if mfu is not None else None
        self.peaks = {"throughput/mfu": mfu.datasheet_peak_flops if mfu is not None else None,
                      "throughput/mfu_measured_peak": mfu.measured_peak_flops if mfu is not None else None}
        """Per device: the datasheet's (None where unknown: CPUs, unlisted devices) and the measured one."""
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # The denominator of memory/peak_frac: the device's memory on GPU, the configured budget on CPU.
        self._memory_capacity_gb = (
            torch.cuda.get_device_properties(self.device).total_memory / GB if self._cuda else memory_budget_gb
        )
        self._acc = StepAccumulators(device=self.device, profile_every=config.profile_every, start_step=steps.start_step)
        # The hot path (engine/step.py's StepRecorder) calls the accumulators' own methods: no wrapper per call.
        self.begin_step, self.lap = self._acc.begin_step, self._acc.lap
        self.add_loss, self.add_grad_norm = self._acc.add_loss, self._acc.add_grad_norm
        self._agreement = StepAgreement(world_size=world_size, device=self.device, host_floats=_HOST_FLOATS)
        # Threads that compute: torch's on a CPU, the one that launches kernels on a GPU.
        self._host = HostSampler(compute_threads=1 if self._cuda else torch.get_num_threads())
        self._niceness = niceness
        """Recorded once, in the first record, as host/niceness."""
        self._cpu: tuple[float, float | None] = (0.0, None)
        """(host/cpu_share, host/cpu_wait_frac) of the window being drained: the most starved rank's."""
        self._gc = GcControl(every_steps=config.gc_every)
        self._gc.start()
        self._is_logger = rank == 0
        self._print = print_progress and self._is_logger
        self.health_marks: dict[str, tuple[int, int]] = {}
        """What the health check saw so far (loop/health.py): event -> (count, last step); the progress line shows it."""
        self._writer = sinks if self._is_logger else None  # rank 0's, started during setup (its sinks already open)
        self._sink_at_window_start = (0.0, 0)  # the sink thread's CPU seconds and dropped records
        self._alerts = WindowAlerts(config, start_step=steps.start_step)
        self._last_upload_s: float | None = None
        self._compile_s: float | None = None
        reset_peak_memory(self.device)  # memory/peak_gb: training's, not setup's
        self._start_window(steps.start_step, time.perf_counter())

    # --- hot path (metrics/accumulators.py) ------------------------------------------------------

    def end_step(self, step: int) -> None:
        """Step `step` is done (optimizer applied). GC runs its timed collection here on its cadence."""
        self._acc.end_step(step)
        self._gc.step(step)

    @property
    def agreed_flags(self) -> int:
        """The OR of the flags every rank passed to the last `log` (metrics/agreement.py)."""
        return self._agreement.flags

    def window_finite(self) -> bool:
        """Whether every step since the last drain had a finite loss and gradient norm on every rank:
        one all-reduce (with several ranks) and ONE host read. For a save on a step that is not a
        log step (saves are rare); on a log step the drain already told."""
        return self._agreement.all_finite(self._acc.sums)

    # --- side concerns -------------------------------------------------------------------------

    def record_checkpoint(self, *, blocked_s: float | None = None, upload_s: float | None = None) -> None:
        """Time training was blocked by a checkpoint, and/or how long its (async) upload took."""
        if blocked_s is not None:
            self._checkpoint_blocked_s += blocked_s
            self._num_checkpoints += 1
        if upload_s is not None:
            self._last_upload_s = upload_s

    def flush_sinks(self) -> None:
        """Make the records so far durable (JSONL written to storage) without blocking training.
        Called after each checkpoint, so a crash never loses metrics older than the checkpoint."""
        if self._writer is not None:
            self._writer.request_flush()

    def exclude_from_window(self, seconds: float) -> None:
        """Leave `seconds` spent outside training (an evaluation) out of the window's wall time, so
        tokens/s, step time, MFU and the slowdown detector's baseline see training only."""
        self._window_start += seconds

    def emit(self, step: int, values: dict[str, float]) -> None:
        """Hand values to rank 0's sinks as a record of `step`: the window's, or an evaluation's measured outside it."""
        if self._writer is not None:
            self._writer.log(values, step)

    @contextmanager
    def compile_timer(self, step: int, *, active: bool = True) -> Iterator[None]:
        """Times step `step`, the first of a compiled model (compilation happens in it), as
        time/compile_s in the next record, and keeps that step out of the window's tokens/s, step
        time, MFU and the slowdown baseline (unless it ends a window by itself). One device sync,
        once per run. `active=False`: does nothing."""
        if not active:
            yield
            return
        start = time.perf_counter()
        yield
        if self._cuda:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - start
        self._compile_s = seconds
        if not self.is_log_step(step):
            self._window_start += seconds
            self._window_start_step += 1

    # --- log steps -----------------------------------------------------------------------------

    def log(self, step: int, *, lr: float | None = None, flags: int = 0, epoch: float | None = None) -> dict[str, float]:
        """Drain the window. Every rank must call it at the same step (it is a collective).

        `flags` (small non-negative int bit flags) ride along for free: afterwards `agreed_flags`
        is the OR of every rank's flags on every rank, with no extra collective or sync."""
        arrival_s = time.perf_counter() - self._window_start
        gc_s = self._gc.collect_s - self._gc_at_window_start[0]
        host = self._host.window()
        cpu_wait = -1.0 if host.cpu_wait_frac is None else host.cpu_wait_frac
        sums, ranks = self._agreement.drain(
            self._acc.sums, [arrival_s, self._acc.data_wait_s, gc_s, host.cpu_share, cpu_wait], flags
        )
        now = time.perf_counter()
        metrics = self._compute(step, sums, ranks, now=now, lr=lr)
        if epoch is not None:  # from the data position: host arithmetic, no sync
            metrics["train/epoch"] = epoch
        self._start_window(step, now)
        self.emit(step, metrics)  # rank 0's sinks only
        if self._print:
            say(progress_line(step, self.steps.total_steps, metrics, self.health_marks))
        return metrics

    def _compute(self, step: int, sums: list[float], ranks: list[list[float]], *, now: float, lr: float | None) -> dict[str, float]:
        num_steps = max(1, step - self._window_start_step)
        wall = max(now - self._window_start, 1e-9)
        metrics = self._train_metrics(sums, lr=lr, num_steps=num_steps, wall=wall)
        data_wait, gc_window = self._time_metrics(metrics, ranks, num_steps=num_steps, wall=wall)
        self._checkpoint_metrics(metrics)
        if self._compile_s is not None:
            metrics["time/compile_s"], self._compile_s = self._compile_s, None
        memory_now = self._memory_metrics(metrics)
        self._host_metrics(metrics)
        metrics["gc/collect_s"] = gc_window
        metrics["gc/collections"] = float(self._gc.num_collections - self._gc_at_window_start[1])
        sink_cpu, dropped = self._sink_metrics(metrics)
        if self._is_logger:
            self._alerts.check(metrics, Window(
                step=step, step_s=metrics["time/step_s"], num_steps=num_steps, data_wait_s=data_wait / num_steps,
                gc_s=gc_window / num_steps, checkpoint_s=self._checkpoint_blocked_s / num_steps,
                sink_cpu_s=sink_cpu / num_steps, sink_dropped=dropped,
                sink_backlog=self._writer.backlog if self._writer is not None else 0, memory_gb=memory_now,
                cpu_wait_frac=metrics.get("host/cpu_wait_frac"),
            ))
        return metrics

    def _train_metrics(self, sums: list[float], *, lr: float | None, num_steps: int, wall: float) -> dict[str, float]:
        """Loss, learning rate, grad norm, throughput, MFU and step time: the window's train/ and throughput/."""
        world = self.world_size if self._agreement.distributed else 1
        tokens_per_sec = self.steps.tokens_per_step * num_steps / wall
        metrics: dict[str, float] = {}
        if self._acc.num_losses:
            metrics["train/loss"] = sums[0] / (self._acc.num_losses * world)
        if lr is not None:
            metrics["train/lr"] = float(lr)
        if self._acc.num_grad_norms:
            metrics["train/grad_norm"] = sums[1] / (self._acc.num_grad_norms * world)
        metrics["throughput/tokens_per_sec"] = tokens_per_sec
        for name, peak in self.peaks.items():
            value = mfu(tokens_per_sec=tokens_per_sec, flops_per_token=self.flops_per_token, peak_flops=peak, num_devices=self.world_size)
            if value is not None:
                metrics[name] = value
        metrics["time/step_s"] = wall / num_steps
        return metrics

    def _time_metrics(self, metrics: dict[str, float], ranks: list[list[float]], *, num_steps: int, wall: float) -> tuple[float, float]:
        """Data wait, rank spread and phase times into `metrics`. Returns the window's (data wait,
        GC seconds) of the rank that had the most of each: it sets the pace at the next collective."""
        arrivals, waits, gcs = [r[0] for r in ranks], [r[1] for r in ranks], [r[2] for r in ranks]
        cpu_waits = [r[4] for r in ranks if r[4] >= 0]
        self._cpu = (min(r[3] for r in ranks), max(cpu_waits) if cpu_waits else None)  # the most starved rank's
        if len(ranks) > 1:
            metrics["time/step_s_rank_spread"] = (max(arrivals) - min(arrivals)) / num_steps
            metrics["time/data_wait_frac_rank_min"] = min(waits) / wall
        metrics["time/data_wait_frac"] = max(waits) / wall
        phases = self._acc.phase_means()
        for phase in ("forward", "backward", "optimizer"):
            if phase in phases:
                metrics[f"time/{phase}_s"] = phases[phase]
        return max(waits), max(gcs)

    def _checkpoint_metrics(self, metrics: dict[str, float]) -> None:
        if self._num_checkpoints:
            metrics["checkpoint/blocked_s"] = self._checkpoint_blocked_s / self._num_checkpoints
        if self._last_upload_s is not None:
            metrics["checkpoint/upload_s"], self._last_upload_s = self._last_upload_s, None

    def _memory_metrics(self, metrics: dict[str, float]) -> float:
        """memory/* into `metrics`; returns the memory in use now in GB."""
        metrics["memory/peak_gb"] = peak_memory_gb(self.device)
        metrics["memory/current_gb"] = memory_now = memory_in_use_gb(self.device)
        if self._memory_capacity_gb:
            metrics["memory/peak_frac"] = metrics["memory/peak_gb"] / self._memory_capacity_gb
        return memory_now

    def _host_metrics(self, metrics: dict[str, float]) -> None:
        """host/*: the CPU the training process got (the most starved rank), and rank 0's node's
        load and memory. /proc reads and psutil on the host only."""
        cpu_share, cpu_wait = self._cpu
        metrics["host/cpu_share"] = cpu_share
        if cpu_wait is not None:
            metrics["host/cpu_wait_frac"] = cpu_wait
        if self._is_logger:
            metrics.update(self._host.machine())
            if not self._cuda and self._memory_capacity_gb:  # the process against its CPU memory budget
                metrics["host/memory_budget_frac"] = host_memory_gb()[1] / self._memory_capacity_gb
            if self._niceness is not None:
                metrics["host/niceness"] = float(self._niceness)
                self._niceness = None  # once per run

    def _sink_metrics(self, metrics: dict[str, float]) -> tuple[float, int]:
        """sink/* into `metrics` (rank 0 only); returns the sink thread's CPU seconds and the records
        dropped during the window."""
        if self._writer is None:
            return 0.0, 0
        cpu_before, dropped_before = self._sink_at_window_start
        metrics["sink/dropped"] = float(self._writer.dropped)
        metrics["sink/backlog"] = float(self._writer.backlog)
        metrics["sink/errors"] = float(self._writer.errors)
        self._sink_at_window_start = (self._writer.cpu_s, self._writer.dropped)
        return self._writer.cpu_s - cpu_before, self._writer.dropped - dropped_before

    def mark_health(self, event: str, step: int) -> None:
        """A spike, a non-finite window or a rollback at `step`: every later progress line counts them."""
        count, _ = self.health_marks.get(event, (0, 0))
        self.health_marks[event] = (count + 1, step)

    def restart_at(self, step: int) -> None:
        """The loop went back to step `step` (a rollback, loop/health.py): the window restarts there
        and what the abandoned steps accumulated is dropped."""
        self._acc.step = step
        self._start_window(step, time.perf_counter())

    def _start_window(self, step: int, now: float) -> None:
        self._acc.reset()
        self._checkpoint_blocked_s, self._num_checkpoints = 0.0, 0
        self._window_start_step = step
        self._window_start = now  # logging and sink hand-off below count in the next window
        self._gc_at_window_start = (self._gc.collect_s, self._gc.num_collections)

    # --- end -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Deliver queued records, close the sinks, give Python's GC its settings back."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._gc.close()
