"""What a training process and the rest of the machine did during a timed window, from Linux's
/proc counters (read at the two ends of the window, nothing sampled in between, so the steps are
not slowed): the process's threads, its CPU seconds and context switches per step, and the CPU
that every other process took meanwhile, with the largest of them by name. Elsewhere than
Linux the counters are absent ({}), never invented. What they showed: docs/benchmarks.md#where-the-gap-goes."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


@dataclass
class Snapshot:
    wall: float
    per_thread: dict[int, tuple[str, float, int, int]] = field(default_factory=dict)
    """tid -> (name, CPU s, voluntary, involuntary switches): the Python thread's name where the thread
    is Python's, else the kernel's (torch's OpenMP threads carry the process's name). The process's
    figures are summed from these in `window`."""
    others: dict[int, tuple[float, str]] = field(default_factory=dict)


def _stat_cpu_s(path: str) -> tuple[float, str]:
    """(user + system seconds, command name) of /proc/<pid>/stat or a task's stat."""
    with open(path) as stream:
        raw = stream.read()
    name = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK, name


def _per_thread(pid: int) -> dict[int, tuple[str, float, int, int]]:
    """Every thread alive now: (name, CPU s, voluntary, involuntary context switches). CPU from the
    thread's schedstat (nanoseconds) where the kernel has it: a window of a fraction of a second
    would otherwise be a few clock ticks."""
    names = {thread.native_id: thread.name for thread in threading.enumerate() if thread.native_id is not None}
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu_s, kernel_name = _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
            if os.path.exists(f"/proc/{pid}/task/{tid}/schedstat"):  # nanoseconds on the CPU, not 10 ms ticks
                with open(f"/proc/{pid}/task/{tid}/schedstat") as stream:
                    cpu_s = int(stream.read().split()[0]) / 1e9
            voluntary = involuntary = 0
            with open(f"/proc/{pid}/task/{tid}/status") as stream:
                for line in stream:
                    if line.startswith("voluntary_ctxt_switches:"):
                        voluntary = int(line.split()[1])
                    elif line.startswith("nonvoluntary_ctxt_switches:"):
                        involuntary = int(line.split()[1])
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        name = names.get(int(tid)) or f"{kernel_name} (native)"
        out[int(tid)] = (name, cpu_s, voluntary, involuntary)
    return out


def _others(pid: int) -> dict[int, tuple[float, str]]:
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != pid:
            try:
                out[int(entry)] = _stat_cpu_s(f"/proc/{entry}/stat")
            except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
                continue
    return out


def snapshot() -> Snapshot | None:
    """This process's counters and every other process's CPU seconds now; None without /proc."""
    pid = os.getpid()
    try:
        per_thread = _per_thread(pid)
        others = _others(pid)
    except OSError:
        return None
    return Snapshot(time.perf_counter(), per_thread, others)


def window(start: Snapshot | None, end: Snapshot | None, *, steps: int, top: int = 5) -> dict[str, Any]:
    """The counters between two snapshots of the same process, per step of the window."""
    if start is None or end is None or steps <= 0:
        return {}
    wall = end.wall - start.wall
    by_name: dict[str, float] = {}
    for pid, (cpu_s, name) in end.others.items():
        before = start.others.get(pid, (0.0, name))[0]  # a process born in the window counts from 0
        by_name[name] = by_name.get(name, 0.0) + max(0.0, cpu_s - before)
    others_cpu = sum(by_name.values())
    largest = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    threads: dict[str, list[float]] = {}
    for tid, (name, cpu_s, voluntary, involuntary) in end.per_thread.items():
        _, cpu_before, voluntary_before, involuntary_before = start.per_thread.get(tid, (name, 0.0, 0, 0))
        row = threads.setdefault(name, [0, 0.0, 0.0, 0.0])
        row[0] += 1
        row[1] += cpu_s - cpu_before
        row[2] += voluntary - voluntary_before
        row[3] += involuntary - involuntary_before
    # The process's figures are its threads' (those alive at the end; one that ended inside the
    # window is missing from both), so `by_thread` adds up to them.
    process_cpu_s, voluntary_all, involuntary_all = (sum(row[i] for row in threads.values()) for i in (1, 2, 3))
    return {
        "threads": len(end.per_thread),
        "cpu_s_per_step": process_cpu_s / steps,
        "process_cores": process_cpu_s / wall if wall > 0 else 0.0,
        "voluntary_switches_per_step": voluntary_all / steps,
        "involuntary_switches_per_step": involuntary_all / steps,
        "other_processes_cores": others_cpu / wall if wall > 0 else 0.0,
        "other_processes_largest": {name: round(cpu / wall, 4) for name, cpu in largest if wall > 0},
        "by_thread": {  # this process's threads by name, the busiest first
            name: {"count": int(count), "cores": round(cpu / wall, 4) if wall > 0 else 0.0,
                   "voluntary_switches_per_step": round(voluntary / steps, 2),
                   "involuntary_switches_per_step": round(involuntary / steps, 2)}
            for name, (count, cpu, voluntary, involuntary) in sorted(threads.items(), key=lambda kv: -kv[1][1])
        },
    }
