"""Host contention: the compute threads wait for a CPU."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, duration, ms, pct
from raytrain_fast.report.load import RunMetrics, median


# Host contention: a compute thread (training or torch OpenMP) waited for a CPU at least a quarter of the window
# (host/cpu_wait_frac; a few percent on a node with nothing else running) in at least two steady
# windows and at least 5% of them, and at least 3 s in all: over the 50 ms windows of a tiny test
# model one scheduling hiccup reads as 40%.
CONTENTION_WAIT_FRAC = 0.25
CONTENTION_MIN_WINDOWS = 2
CONTENTION_MIN_SHARE = 0.05
CONTENTION_MIN_WAIT_S = 3.0


def find(run: RunMetrics) -> Finding | str | None:
    if not run.has("host/cpu_wait_frac"):
        return "host contention: host/cpu_wait_frac was not recorded (a Linux kernel's schedstat gives it)"
    steps, waits = run.series("host/cpu_wait_frac", steady=True)
    contended = [(s, w) for s, w in zip(steps, waits) if w >= CONTENTION_WAIT_FRAC]
    if len(contended) < CONTENTION_MIN_WINDOWS or len(contended) < CONTENTION_MIN_SHARE * len(waits):
        return None
    by_step, windows = {r["step"]: r for r in run.records}, run.window_steps()
    waited_s = sum(w * by_step[s].get("time/step_s", 0.0) * windows[s] for s, w in contended)
    if waited_s < CONTENTION_MIN_WAIT_S:
        return None
    wait_in = median([w for _, w in contended])
    quiet = [w for _, w in zip(steps, waits) if w < CONTENTION_WAIT_FRAC]
    evidence = [
        f"the training thread was ready to run but waited for a CPU a median {pct(wait_in)} of the time in {len(contended)} of "
        f"{len(waits)} steady windows (host/cpu_wait_frac, threshold {pct(CONTENTION_WAIT_FRAC)}): steps "
        + ", ".join(str(s) for s, _ in contended[:12]) + (" ..." if len(contended) > 12 else ""),
        f"it waited {duration(waited_s)} in those windows",
    ]
    if quiet:
        evidence.append(f"in the other windows it waited {pct(median(quiet))}")
    shares = [by_step[s]["host/cpu_share"] for s, _ in contended if "host/cpu_share" in by_step[s]]
    if shares:
        evidence.append(f"the training process got {pct(median(shares))} of its threads' CPU time there (host/cpu_share)")
    _, load = run.series("host/load_per_cpu", steady=True)
    if load:
        evidence.append(f"load per CPU on rank 0's node: median {median(load):.2f}, up to {max(load):.2f} (host/load_per_cpu)")
    _, step_s = run.series("time/step_s", steady=True)
    contended_s = [by_step[s]["time/step_s"] for s, _ in contended if "time/step_s" in by_step[s]]
    if contended_s and step_s:
        evidence.append(f"step time {ms(median(contended_s))} in those windows, {ms(median(step_s))} over the run")
    advice = ["other processes on the node took the CPU: keep CPU-heavy work (tokenizers, notebooks, other jobs) off training nodes, or run it with `nice -n 19`"]
    _, nice = run.series("host/niceness")
    if nice and nice[0] > 0:
        evidence.append(f"the training worker ran at niceness {nice[0]:.0f} (host/niceness): every process at normal priority came first")
        advice.insert(0, "run training at normal priority: start Ray with RAY_worker_niceness=0 (cluster.yaml does), or let the worker renice itself (root or CAP_SYS_NICE)")
    return Finding(
        key="host_contention", title=f"Host contention: other processes took the CPU from training in {len(contended)} log windows",
        evidence=evidence, advice=advice, numbers={
            "cpu_wait_frac": wait_in, "windows": float(len(contended)), "first_step": float(contended[0][0]), "waited_s": waited_s,
        },
    )
