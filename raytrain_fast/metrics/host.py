"""The host side of a training process: its scheduling priority, how much CPU it got, and the
machine's load and memory. Host-only and cheap (a few /proc reads per log window, no device sync).

Why it matters: Ray starts every worker process, our training workers among them, at niceness 15
(`RAY_worker_niceness`). On a node where anything else runs at the default priority (a tokenizer
job, a notebook, a second run's driver), the scheduler gives that process the CPU first: a
training worker measured 1.5% of a core against two plain Python busy loops, and a 1 s log window
took 70 s. On a GPU node the same starvation stalls kernel launches. `run_at_normal_priority`
puts the training process back at niceness 0; `HostSampler` measures what the process got.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger("raytrain_fast.metrics")

NORMAL_NICENESS = 0
_FIX = (
    "start Ray with RAY_worker_niceness=0 in its environment (`RAY_worker_niceness=0 ray start ...`, "
    "as cluster.yaml does), or give the worker the CAP_SYS_NICE capability"
)


def niceness() -> int:
    """This thread's niceness (on Linux every thread has its own; they inherit it when created)."""
    return os.getpriority(os.PRIO_PROCESS, 0)


def run_at_normal_priority() -> int:
    """Lower every thread of this process to niceness 0 where permitted; returns the niceness the
    calling thread ends with.

    On Linux `setpriority(PRIO_PROCESS, tid)` changes one thread, so each task in /proc/self/task is
    reniced (Ray's threads, the data prefetch threads); threads started later (torch's OpenMP pool)
    inherit it from the thread that creates them. Lowering niceness needs CAP_SYS_NICE (root has it)
    or an RLIMIT_NICE that allows it: otherwise one warning names the fix and training goes on.
    """
    current = niceness()
    if current <= NORMAL_NICENESS:
        return current
    try:
        tasks = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the whole process is one priority
        tasks = [0]
    failed = False
    for tid in tasks:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > NORMAL_NICENESS:
                os.setpriority(os.PRIO_PROCESS, tid, NORMAL_NICENESS)
        except PermissionError:
            failed = True
        except (ProcessLookupError, OSError):  # a thread that ended meanwhile
            continue
    after = niceness()
    if failed or after > NORMAL_NICENESS:
        logger.warning(
            "This training worker runs at niceness %d (Ray's default for worker processes is 15), and lowering it "
            "was not permitted: any other process on the node takes the CPU from training first. Fix: %s.",
            after, _FIX,
        )
    return after


def _thread_times_s() -> dict[int, tuple[float, float]] | None:
    """{thread id: (seconds on a CPU, seconds runnable but waiting for one)} of every thread of this
    process (Linux schedstat), or None where the kernel does not expose it."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    times = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as stats:
                on_cpu, run_delay = stats.read().split()[:2]
        except (OSError, ValueError):  # a thread that ended meanwhile
            continue
        times[int(tid)] = (int(on_cpu) / 1e9, int(run_delay) / 1e9)
    return times or None


COMPUTE_THREAD_RUNNABLE_FRAC = 0.10
"""A thread that was runnable (on a CPU, or ready and waiting for one) for at least this share of
the window computes: torch's OpenMP threads are, for most of it, however starved; the sink,
heartbeat and Ray's own threads sleep on queues and stay far below."""


def compute_thread_wait(before: dict[int, tuple[float, float]], after: dict[int, tuple[float, float]], *, elapsed: float, calling: int) -> float:
    """The largest share of the window that a compute thread (the calling one, and every thread
    runnable for COMPUTE_THREAD_RUNNABLE_FRAC of it) was ready to run but waited for a CPU. One
    starved OpenMP thread holds back every parallel region, so the worst thread is the one that counts."""
    worst = 0.0
    for tid, (on_cpu, run_delay) in after.items():
        if tid not in before:
            continue
        cpu_s, wait_s = on_cpu - before[tid][0], run_delay - before[tid][1]
        if tid == calling or cpu_s + wait_s >= COMPUTE_THREAD_RUNNABLE_FRAC * elapsed:
            worst = max(worst, wait_s / elapsed)
    return min(1.0, worst)


@dataclass(kw_only=True)
class HostWindow:
    """What the host gave the training process over one log window."""

    cpu_share: float
    """Process CPU time / (wall time x compute threads)."""
    cpu_wait_frac: float | None
    """Share of the wall time the most starved compute thread (the training thread or one of torch's) was ready to run but waited for a CPU."""


class HostSampler:
    """Per log window: the process's CPU share and its compute threads' CPU wait (call `window()`
    from the training thread); machine-wide load and memory (`machine()`)."""

    def __init__(self, *, compute_threads: int) -> None:
        self.compute_threads = max(1, compute_threads)
        """Threads that compute on this process: torch's threads on a CPU, 1 (the launching thread) on a GPU."""
        self._cpu_count = os.cpu_count() or 1
        self._wall = time.perf_counter()
        self._cpu = time.process_time()
        self._threads = _thread_times_s()

    def window(self) -> HostWindow:
        """Since the previous call (or construction): the window's CPU share and CPU wait. A few
        dozen /proc reads (one per thread of the process): about a millisecond, once per log window."""
        wall, cpu, threads = time.perf_counter(), time.process_time(), _thread_times_s()
        elapsed = max(wall - self._wall, 1e-9)
        wait = None
        if threads is not None and self._threads is not None:
            wait = compute_thread_wait(self._threads, threads, elapsed=elapsed, calling=threading.get_native_id())
        share = (cpu - self._cpu) / (elapsed * min(self.compute_threads, self._cpu_count))
        self._wall, self._cpu, self._threads = wall, cpu, threads
        return HostWindow(cpu_share=share, cpu_wait_frac=wait)

    def machine(self) -> dict[str, float]:
        """host/load_per_cpu, host/memory_used_frac and host/swap_used_gb of this node."""
        out: dict[str, float] = {}
        with contextlib.suppress(OSError):
            out["host/load_per_cpu"] = os.getloadavg()[0] / self._cpu_count
        with contextlib.suppress(ImportError, OSError):
            import psutil  # ships with Ray

            memory, swap = psutil.virtual_memory(), psutil.swap_memory()
            out["host/memory_used_frac"] = (memory.total - memory.available) / memory.total
            out["host/swap_used_gb"] = swap.used / 1e9
        return out
