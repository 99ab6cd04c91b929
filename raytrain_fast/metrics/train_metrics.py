"""What the step loop measures, and the one place it reads the device back (every `log_every` steps).

Per step, `TrainMetrics` only adds detached tensors into an on-device accumulator (loss, grad norm)
and reads the host clock around each phase: no host syncs. On log steps,
`log()` does, on every rank:

1. one all-reduce of the accumulator and one all-gather of six host floats per rank (time to
   reach the log step, data wait, GC time, a caller's flag, CPU share, CPU wait), both queued on the
   device without waiting;
2. ONE host sync: a single `.tolist()` of all of it (it waits for every kernel queued in the window);
3. on rank 0: throughput, MFU, phase times, memory, host CPU and memory, rank spread, slowdown and
   stall checks, progress line, and a hand-off of the record to the sink thread (which never blocks
   training).

The window's wall time runs from one drain's host sync to the next, so it is exact even on a GPU
where the host runs ahead. Phase times (forward, backward, optimizer) are sampled every
`profile_every` steps: with CUDA events on GPU (read at the next drain, when they are complete:
no extra sync) and with the host clock on CPU, where ops run synchronously. Data wait is the host
time spent in `next(data)`, every step.
"""

from __future__ import annotations

import logging
import math
import resource
import sys
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.metrics.gc_control import GcControl
from raytrain_fast.metrics.host import HostSampler
from raytrain_fast.metrics.peak import mfu
from raytrain_fast.metrics.sinks import MetricSink, SinkWriter
from raytrain_fast.metrics.slowdown import STALL_CAUSES, SlowdownDetector, StallDetector, Window

logger = logging.getLogger("raytrain_fast.metrics")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


PHASES = ("data", "forward", "backward", "optimizer")
_GB = 1e9
_ACC = 2  # on-device sums: loss, grad norm
_STATS = 6  # per-rank host floats gathered on log steps: seconds to reach the drain, data wait, GC, flag, CPU share, CPU wait


def _host_memory_gb() -> tuple[float, float]:
    """(peak RSS since the last `reset_peak_memory`, current RSS) of this process in GB. Linux:
    VmHWM and VmRSS of /proc/self/status; elsewhere the process's lifetime peak (ru_maxrss)."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmHWM", "VmRSS")))
        peak_bytes, current_bytes = (int(fields[name].split()[0]) * 1024 for name in ("VmHWM", "VmRSS"))
    except (OSError, KeyError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak_bytes = current_bytes = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    return max(peak_bytes, current_bytes) / _GB, current_bytes / _GB


def reset_peak_memory(device: Any = "cpu") -> None:
    """Start `peak_memory_gb` over from the memory in use now. Called once setup is done (model,
    engine, FLOP count, peak measurement, data), by the loop and by `micro_batch: auto`'s probes
    alike, so memory/peak_gb and the probes' peaks are the same statistic: training's. CUDA: the
    allocator's peak stats; Linux: the process's RSS high-water mark (/proc/self/clear_refs)."""
    if getattr(device, "type", str(device).split(":", 1)[0]) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM to the current RSS (Linux 4.0+)
    except OSError:
        pass  # elsewhere the peak keeps setup in it


def peak_memory_gb(device: Any = "cpu") -> float:
    """This process's peak memory in GB since `reset_peak_memory`, the one statistic that
    memory/peak_gb, the sweep's budget check and `micro_batch: auto` all use: on CUDA
    `max_memory_reserved` (what the caching allocator holds, so what the next allocation competes
    with; allocator stats, no device sync), elsewhere the peak RSS of the process."""
    if getattr(device, "type", str(device).split(":", 1)[0]) == "cuda":
        return torch.cuda.max_memory_reserved(device) / _GB
    return _host_memory_gb()[0]


def _writer_for(sinks: Sequence[MetricSink] | SinkWriter, config: MetricsConfig, *, logger: bool) -> SinkWriter | None:
    """The logging rank's sink writer: one started during setup (its sinks already open), or a new one."""
    if not logger:
        return None
    if isinstance(sinks, SinkWriter):
        return sinks
    return SinkWriter(sinks, max_queue=config.queue_size) if sinks else None


class TrainMetrics:
    """Metrics of one worker's step loop. Construct it on every rank after setup (model, engine and
    data built: it freezes the heap for GC control), right before the first step.

    Per step (hot path, no host sync)::

        metrics.begin_step()
        for each micro-batch:
            tokens = next(data);          metrics.lap("data")
            loss = engine(...);           metrics.lap("forward")
            engine.backward(loss);        metrics.lap("backward")
            engine.step();                metrics.lap("optimizer")
            metrics.add_loss(loss)
        metrics.add_grad_norm(engine.get_global_grad_norm())
        metrics.end_step(step)
        if metrics.is_log_step(step):
            last = metrics.log(step, lr=engine.get_lr()[0])   # every rank: a collective + ONE host sync

    Checkpoints: `with metrics.checkpoint_timer(): save(...)` (or `record_checkpoint(blocked_s=...)`),
    and `record_checkpoint(upload_s=...)` when an async upload reports its duration.
    """

    def __init__(
        self,
        config: MetricsConfig,
        *,
        log_every: int,
        total_steps: int,
        start_step: int,
        tokens_per_step: int,
        device: torch.device | str,
        rank: int = 0,
        world_size: int = 1,
        flops_per_token: float | None = None,
        datasheet_peak_flops: float | None = None,
        measured_peak_flops: float | None = None,
        memory_budget_gb: float | None = None,
        sinks: Sequence[MetricSink] | SinkWriter = (),
        print_progress: bool = True,
        process_group: Any = None,
        niceness: int | None = None,
    ) -> None:
        if log_every <= 0:
            raise ValueError(f"log_every must be > 0, got {log_every}")
        self.config, self.log_every, self.total_steps = config, log_every, total_steps
        self.tokens_per_step = tokens_per_step
        """Tokens per optimizer step across all ranks."""
        self.rank, self.world_size = rank, world_size
        self.flops_per_token = flops_per_token
        self.datasheet_peak_flops = datasheet_peak_flops
        """Per device, from the datasheet table; None where unknown (CPUs, unlisted devices)."""
        self.measured_peak_flops = measured_peak_flops
        """Per device, measured with large matmuls in the training dtype."""
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        # The denominator of memory/peak_frac: the device's memory on GPU, the configured budget on CPU.
        self._memory_capacity_gb = (
            torch.cuda.get_device_properties(self.device).total_memory / _GB if self._cuda else memory_budget_gb
        )
        self._group = process_group
        self._allocate_buffers()
        # Threads that compute: torch's on a CPU, the one that launches kernels on a GPU.
        self._host = HostSampler(compute_threads=1 if self._cuda else torch.get_num_threads())
        self._niceness = niceness
        """Recorded once, in the first record, as host/niceness."""
        self._cpu: tuple[float, float | None] = (0.0, None)
        """(host/cpu_share, host/cpu_wait_frac) of the window being drained: the most starved rank's."""

        self._step = start_step
        self._window_start_step = start_step
        self._reset_window_counters()
        self._lap_t = time.perf_counter()
        self._profiling = False
        self._events: list[tuple[str | None, Any]] = []
        self._pending_events: list[list[tuple[str | None, Any]]] = []

        self._gc = GcControl(every_steps=config.gc_every)
        self._gc.start()
        self._gc_s_at_window_start = self._gc.collect_s
        self._gc_n_at_window_start = self._gc.num_collections

        self._is_logger = rank == 0
        self._print = print_progress and self._is_logger
        self.health_marks: dict[str, tuple[int, int]] = {}
        """What the health check saw so far (loop/health.py): event -> (count, last step); the progress line shows it."""
        self._writer = _writer_for(sinks, config, logger=self._is_logger)
        self._sink_cpu_at_window_start = 0.0
        self._dropped_at_window_start = 0
        self._detector = SlowdownDetector(
            threshold=config.slowdown_threshold,
            num_windows=config.slowdown_windows,
            warmup_steps=start_step + config.slowdown_warmup_steps,
        )
        self._stall = StallDetector(factor=config.stall_factor, warmup_steps=start_step + config.slowdown_warmup_steps)
        self._last_upload_s: float | None = None
        self._compile_s: float | None = None
        self.flags_any_rank = 0
        """After log(): the bitwise OR of the `flags` every rank passed to it."""

        reset_peak_memory(self.device)  # memory/peak_gb: training's, not setup's
        self._window_start = time.perf_counter()

    def _allocate_buffers(self) -> None:
        """The on-device accumulators and, with several ranks, the buffers of the log step's gather."""
        import torch.distributed as dist

        self._distributed = self.world_size > 1 and dist.is_available() and dist.is_initialized()
        # On-device accumulators: [loss sum, grad-norm sum]. Views avoid re-indexing per step.
        self._acc = torch.zeros(_ACC, dtype=torch.float32, device=self.device)
        self._loss_acc, self._grad_norm_acc = self._acc[0], self._acc[1]
        if self._distributed:
            self._stats_host = torch.zeros(_STATS, dtype=torch.float32, pin_memory=self._cuda)
            self._stats_dev = torch.zeros(_STATS, dtype=torch.float32, device=self.device)
            self._gathered = [torch.zeros(_STATS, dtype=torch.float32, device=self.device) for _ in range(self.world_size)]

    # --- hot path ------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start the clock of the next step (and its phase sampling on profile steps)."""
        self._lap_t = time.perf_counter()
        every = self.config.profile_every
        self._profiling = every > 0 and (self._step + 1) % every == 0
        if self._profiling:
            if self._cuda:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                self._events = [(None, start)]
            self._phase_step = {phase: 0.0 for phase in PHASES}

    def lap(self, phase: str) -> None:
        """The phase `phase` (data, forward, backward or optimizer) just ended. Host clock only."""
        now = time.perf_counter()
        if phase == "data":
            self._data_wait_s += now - self._lap_t
        if self._profiling:
            if self._cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self._events.append((phase, event))
            else:
                self._phase_step[phase] += now - self._lap_t
        self._lap_t = now

    def add_loss(self, loss: torch.Tensor) -> None:
        """Add a micro-batch's loss to the on-device sum (detached: no graph is kept, no sync)."""
        self._loss_acc.add_(loss.detach())
        self._num_losses += 1

    def add_grad_norm(self, grad_norm: torch.Tensor | float | None) -> None:
        """The optimizer step's global gradient norm (DeepSpeed: `engine.get_global_grad_norm()`).

        DeepSpeed reports an inf/NaN norm as -1 (bf16, a tensor) or inf (fp32, a float after it
        skipped the step): both enter the sum as non-finite, so one bad step makes the window's
        grad-norm sum non-finite, and the drain's read sees it (docs/health.md). On the device,
        without a sync; a float is added to the device sum without one too."""
        if grad_norm is None:
            return
        if isinstance(grad_norm, torch.Tensor):
            norm = grad_norm.detach()
            self._grad_norm_acc.add_(torch.where(norm < 0, math.nan, norm))
            self._num_grad_norms += 1
        else:
            value = float(grad_norm)
            self._grad_norm_acc.add_(math.nan if value < 0 else value)
            self._num_grad_norms += 1

    def window_finite(self) -> bool:
        """Whether every step since the last drain had a finite loss and gradient norm on every rank:
        one all-reduce (with several ranks) and ONE host read. For a save on a step that is not a
        log step (saves are rare); on a log step the drain already told."""
        bad = (~torch.isfinite(self._acc[:_ACC])).any().float()
        if self._distributed:
            import torch.distributed as dist

            dist.all_reduce(bad, group=self._group)
        return not bool(bad.item())  # HOST SYNC: one per such save

    def end_step(self, step: int) -> None:
        """Step `step` is done (optimizer applied). GC runs its timed collection here on its cadence."""
        self._step = step
        if self._profiling:
            if self._cuda:
                self._pending_events.append(self._events)
                self._events = []
            else:
                for phase, seconds in self._phase_step.items():
                    self._phase_sum[phase] += seconds
                self._num_profiled += 1
            self._profiling = False
        self._gc.step(step)

    def is_log_step(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.total_steps

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
        """Hand values measured outside the window (an evaluation's) to rank 0's sinks as a record of `step`."""
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

    @contextmanager
    def checkpoint_timer(self) -> Iterator[None]:
        """Times the block as checkpoint/blocked_s."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record_checkpoint(blocked_s=time.perf_counter() - start)

    # --- log steps -----------------------------------------------------------------------------

    def log(self, step: int, *, lr: float | None = None, flags: int = 0, epoch: float | None = None) -> dict[str, float]:
        """Drain the window. Every rank must call it at the same step (it is a collective).

        `flags` (small non-negative int bit flags) ride along for free: afterwards `flags_any_rank`
        is the OR of every rank's flags on every rank (e.g. "my checkpoint timer is due", "stop was
        requested"), with no extra collective or sync.
        """
        arrival_s = time.perf_counter() - self._window_start
        gc_s = self._gc.collect_s - self._gc_s_at_window_start
        host = self._host.window()
        self._cpu = (host.cpu_share, host.cpu_wait_frac)
        self.flags_any_rank = flags
        if self._distributed:
            import torch.distributed as dist

            cpu_wait = -1.0 if host.cpu_wait_frac is None else host.cpu_wait_frac
            host_stats = [arrival_s, self._data_wait_s, gc_s, float(flags), host.cpu_share, cpu_wait]  # flags exact in fp32 below 2**24
            self._stats_host.copy_(torch.tensor(host_stats, dtype=torch.float32))
            self._stats_dev.copy_(self._stats_host, non_blocking=True)
            dist.all_reduce(self._acc, group=self._group)
            dist.all_gather(self._gathered, self._stats_dev, group=self._group)
            drained = torch.cat([self._acc, *self._gathered])
        else:
            drained = self._acc
        values = drained.tolist()  # HOST SYNC: the one per log window; waits for all queued work
        now = time.perf_counter()
        metrics = self._compute(step, values, now=now, gc_s=gc_s, lr=lr)
        if epoch is not None:  # from the data position: host arithmetic, no sync
            metrics["train/epoch"] = epoch
        self._start_window(step, now)
        if self._is_logger:
            self._emit(step, metrics)
        return metrics

    def _compute(self, step: int, values: list[float], *, now: float, gc_s: float, lr: float | None) -> dict[str, float]:
        num_steps = max(1, step - self._window_start_step)
        wall = max(now - self._window_start, 1e-9)
        metrics = self._train_metrics(values, lr=lr, num_steps=num_steps, wall=wall)
        data_wait, gc_window = self._time_metrics(metrics, values, num_steps=num_steps, wall=wall, gc_s=gc_s)
        self._checkpoint_metrics(metrics)
        if self._compile_s is not None:
            metrics["time/compile_s"], self._compile_s = self._compile_s, None
        memory_now = self._memory_metrics(metrics)
        self._host_metrics(metrics)
        metrics["gc/collect_s"] = gc_window
        metrics["gc/collections"] = float(self._gc.num_collections - self._gc_n_at_window_start)
        sink_cpu, dropped = self._sink_metrics(metrics)
        if self._is_logger:
            window = Window(
                step=step,
                step_s=metrics["time/step_s"],
                num_steps=num_steps,
                data_wait_s=data_wait / num_steps,
                gc_s=gc_window / num_steps,
                checkpoint_s=self._checkpoint_blocked_s / num_steps,
                sink_cpu_s=sink_cpu / num_steps,
                sink_dropped=dropped,
                sink_backlog=self._writer.backlog if self._writer is not None else 0,
                memory_gb=memory_now,
                cpu_share=metrics["host/cpu_share"],
                cpu_wait_frac=metrics.get("host/cpu_wait_frac"),
            )
            self._slowdown_metrics(metrics, window)
            self._stall_metrics(metrics, window)
        return metrics

    def _train_metrics(self, values: list[float], *, lr: float | None, num_steps: int, wall: float) -> dict[str, float]:
        """Loss, learning rate, grad norm, throughput, MFU and step time: the window's train/ and throughput/."""
        world = self.world_size if self._distributed else 1
        loss_sum, grad_norm_sum = values[0], values[1]
        tokens_per_sec = self.tokens_per_step * num_steps / wall
        metrics: dict[str, float] = {}
        if self._num_losses:
            metrics["train/loss"] = loss_sum / (self._num_losses * world)
        if lr is not None:
            metrics["train/lr"] = float(lr)
        if self._num_grad_norms:
            metrics["train/grad_norm"] = grad_norm_sum / (self._num_grad_norms * world)
        metrics["throughput/tokens_per_sec"] = tokens_per_sec
        for name, peak in (("throughput/mfu", self.datasheet_peak_flops), ("throughput/mfu_measured_peak", self.measured_peak_flops)):
            value = mfu(tokens_per_sec=tokens_per_sec, flops_per_token=self.flops_per_token, peak_flops=peak, num_devices=self.world_size)
            if value is not None:
                metrics[name] = value
        metrics["time/step_s"] = wall / num_steps
        return metrics

    def _time_metrics(
        self, metrics: dict[str, float], values: list[float], *, num_steps: int, wall: float, gc_s: float
    ) -> tuple[float, float]:
        """Data wait, rank spread and phase times into `metrics`; also sets `flags_any_rank`.
        Returns the window's (data wait, GC seconds) of the rank that had the most of each."""
        if self._distributed:
            per_rank = [values[_ACC + i * _STATS: _ACC + (i + 1) * _STATS] for i in range(self.world_size)]
            self.flags_any_rank = 0
            for r in per_rank:
                self.flags_any_rank |= int(round(r[3]))
            # The most starved rank sets the pace: every rank waits for it at the next collective.
            waits = [r[5] for r in per_rank if r[5] >= 0]
            self._cpu = (min(r[4] for r in per_rank), max(waits) if waits else None)
            arrivals = [r[0] for r in per_rank]
            data_wait = max(r[1] for r in per_rank)
            gc_window = max(r[2] for r in per_rank)
            metrics["time/step_s_rank_spread"] = (max(arrivals) - min(arrivals)) / num_steps
            metrics["time/data_wait_frac_rank_min"] = min(r[1] for r in per_rank) / wall
        else:
            data_wait, gc_window = self._data_wait_s, gc_s
        metrics["time/data_wait_frac"] = data_wait / wall  # the rank that waited most: it sets the pace
        phases = self._phase_means()
        for phase in ("forward", "backward", "optimizer"):
            if phase in phases:
                metrics[f"time/{phase}_s"] = phases[phase]
        return data_wait, gc_window

    def _checkpoint_metrics(self, metrics: dict[str, float]) -> None:
        if self._num_checkpoints:
            metrics["checkpoint/blocked_s"] = self._checkpoint_blocked_s / self._num_checkpoints
        if self._last_upload_s is not None:
            metrics["checkpoint/upload_s"] = self._last_upload_s
            self._last_upload_s = None

    def _memory_metrics(self, metrics: dict[str, float]) -> float:
        """memory/* into `metrics`; returns the memory in use now in GB."""
        if self._cuda:
            metrics["memory/peak_gb"] = peak_memory_gb(self.device)
            memory_now = torch.cuda.memory_reserved(self.device) / _GB
        else:
            metrics["memory/peak_gb"], memory_now = _host_memory_gb()
        metrics["memory/current_gb"] = memory_now
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
                metrics["host/memory_budget_frac"] = _host_memory_gb()[1] / self._memory_capacity_gb
            if self._niceness is not None:
                metrics["host/niceness"] = float(self._niceness)
                self._niceness = None  # once per run

    def _sink_metrics(self, metrics: dict[str, float]) -> tuple[float, int]:
        """sink/* into `metrics` (rank 0 only); returns the sink thread's CPU seconds and the records
        dropped during the window."""
        if self._writer is None:
            return 0.0, 0
        sink_cpu = self._writer.cpu_s - self._sink_cpu_at_window_start
        dropped = self._writer.dropped - self._dropped_at_window_start
        metrics["sink/dropped"] = float(self._writer.dropped)
        metrics["sink/backlog"] = float(self._writer.backlog)
        metrics["sink/errors"] = float(self._writer.errors)
        self._sink_cpu_at_window_start = self._writer.cpu_s
        self._dropped_at_window_start = self._writer.dropped
        return sink_cpu, dropped

    def _slowdown_metrics(self, metrics: dict[str, float], window: Window) -> None:
        """Feed the window to the slowdown detector; alert/* into `metrics`, a warning when an alert starts."""
        slowdown, alert = self._detector.update(window)
        if self._detector.baseline is not None:
            metrics["alert/slowdown"] = slowdown
            # The ratio the alert is decided on (rolling median), so a label never reads
            # "SLOWDOWN x0.95" because one window happened to be fast.
            ratio = self._detector.last_ratio
            metrics["alert/slowdown_ratio"] = ratio if ratio is not None else window.step_s / self._detector.baseline.step_s
        if alert is not None:
            metrics[f"alert/slowdown_cause/{alert.cause}"] = 1.0
            logger.warning(alert.message)

    def _stall_metrics(self, metrics: dict[str, float], window: Window) -> None:
        """alert/stall (a window far slower than the ones before it) into `metrics`, with its cause
        and a warning."""
        stall = self._stall.update(window)
        metrics["alert/stall"] = 1.0 if stall else 0.0
        if stall is not None:
            metrics["alert/stall_ratio"] = stall.ratio
            metrics[f"alert/stall_cause/{stall.cause}"] = 1.0
            logger.warning(stall.message)

    def _phase_means(self) -> dict[str, float]:
        if self._cuda:
            # Every event here was recorded before the drain's host sync, so it has completed and
            # elapsed_time() returns without waiting.
            for events in self._pending_events:
                for (_, previous), (phase, event) in zip(events, events[1:]):
                    self._phase_sum[phase] += previous.elapsed_time(event) / 1e3
                self._num_profiled += 1
            self._pending_events = []
        if not self._num_profiled:
            return {}
        return {phase: total / self._num_profiled for phase, total in self._phase_sum.items()}

    def _reset_window_counters(self) -> None:
        self._num_losses = 0
        self._num_grad_norms = 0
        self._data_wait_s = 0.0
        self._checkpoint_blocked_s = 0.0
        self._num_checkpoints = 0
        self._phase_sum = {phase: 0.0 for phase in PHASES}
        self._num_profiled = 0

    def mark_health(self, event: str, step: int) -> None:
        """A spike, a non-finite window or a rollback at `step`: every later progress line counts them."""
        count, _ = self.health_marks.get(event, (0, 0))
        self.health_marks[event] = (count + 1, step)

    def restart_at(self, step: int) -> None:
        """The loop went back to step `step` (a rollback, loop/health.py): the window restarts there
        and what the abandoned steps accumulated is dropped."""
        self._step = step
        self._start_window(step, time.perf_counter())

    def _start_window(self, step: int, now: float) -> None:
        self._acc.zero_()
        self._reset_window_counters()
        self._window_start_step = step
        self._window_start = now  # logging and sink hand-off below count in the next window
        self._gc_s_at_window_start = self._gc.collect_s
        self._gc_n_at_window_start = self._gc.num_collections

    def _emit(self, step: int, metrics: dict[str, float]) -> None:
        if self._writer is not None:
            self._writer.log(metrics, step)
        if self._print:
            print(self.format_line(step, metrics), flush=True)

    def format_line(self, step: int, metrics: dict[str, float]) -> str:
        """The progress line rank 0 prints on log steps."""
        width = len(str(self.total_steps))
        parts = [f"step {step:>{width}}/{self.total_steps}"]
        if "train/epoch" in metrics:
            parts.append(f"epoch {metrics['train/epoch']:.2f}")
        if "train/loss" in metrics:
            parts.append(f"loss {metrics['train/loss']:.4f}")
        if "train/lr" in metrics:
            parts.append(f"lr {metrics['train/lr']:.2e}")
        step_s = metrics["time/step_s"]
        parts.append(f"{metrics['throughput/tokens_per_sec']:,.0f} tok/s")
        parts.append(f"{step_s * 1000:.0f} ms/step")
        if "throughput/mfu" in metrics:
            parts.append(f"MFU {metrics['throughput/mfu']:.1%}")
        if "throughput/mfu_measured_peak" in metrics:
            parts.append(f"{metrics['throughput/mfu_measured_peak']:.0%} of measured peak")
        parts.append(f"data wait {metrics['time/data_wait_frac']:.1%}")
        parts.append(f"ETA {_duration(step_s * max(0, self.total_steps - step))}")
        if metrics.get("alert/slowdown"):
            parts.append(f"SLOWDOWN x{metrics.get('alert/slowdown_ratio', math.nan):.2f}")
        if metrics.get("alert/stall"):
            cause = next((k.rsplit("/", 1)[1] for k in metrics if k.startswith("alert/stall_cause/")), "unknown")
            parts.append(f"STALL x{metrics.get('alert/stall_ratio', math.nan):.1f} ({STALL_CAUSES[cause]})")
        for event, (count, last) in self.health_marks.items():
            parts.append(f"{count} {event}{'s' if count > 1 else ''} (last at step {last})")
        return "  ".join(parts)

    # --- end -----------------------------------------------------------------------------------

    @property
    def slowdown(self) -> SlowdownDetector:
        return self._detector

    def close(self) -> None:
        """Deliver queued records, close the sinks, give Python's GC its settings back."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        self._gc.close()
