"""Training that others can't starve: a real run with busy processes beside it for a known range of
steps, and memory held against a small budget. The worker runs at normal priority, the live stall
alert fires in that range with its cause, and the report names the stall, the host contention and
the memory pressure with their steps and numbers."""

from __future__ import annotations

import os
import statistics

import pytest

from raytrain_fast.drills import CpuBurn, HoldMemory, LoopHooks
from raytrain_fast.report import make_report
from raytrain_fast.report.load import load_run

pytestmark = pytest.mark.ray

CORES = os.cpu_count() or 2
# Busy processes after step 35 until step 50 (windows 40, 45, 50): three per core, so training's one
# thread gets a fair share of 2/7 of a core on 2 cores, a 3.5x slowdown, above the stall factor 2.5.
BURN_FROM, BURN_TO, BURNERS = 35, 50, 3 * CORES
THREADS = 1  # the worker's torch threads (resources.cpus_per_worker): one, so OpenMP barriers don't
# multiply the slowdown (two threads that wait for each other lose more than their share)
BURN_WINDOWS = range(BURN_FROM + 5, BURN_TO + 1, 5)
HOLD_GB, HOLD_FROM, BUDGET_GB = 1.5, 55, 2.0  # a ~0.7 GB process plus 1.5 GB against a 2 GB budget


@pytest.fixture(scope="module")
def contended_run(ray_session, tmp_path_factory):
    from raytrain_fast.config import load_config
    from raytrain_fast.launch.trainer import run

    tmp_path = tmp_path_factory.mktemp("contention")
    config = load_config(
        "tiny",
        [
            "train.steps=75", "train.log_every=5", "optim.warmup_steps=5", "data.max_tokens=400000", "train.micro_batch=8",
            f"resources.cpus_per_worker={THREADS}", "resources.max_failures=0", f"resources.memory_budget_gb={BUDGET_GB}",
            "engine.precision=fp32", "metrics.slowdown_warmup_steps=15", "metrics.peak_measure_s=0.2",
            f"storage.uri={tmp_path / 'runs'}",
        ],
        name="contended",
    )
    hooks = LoopHooks(CpuBurn(BURN_FROM, BURN_TO, BURNERS), HoldMemory(HOLD_GB, HOLD_FROM))
    run(config, hooks=hooks)
    return tmp_path / "runs"


def _records(runs) -> dict[int, dict]:
    return {r["step"]: r for r in load_run(str(runs), "contended").records}


def test_worker_runs_at_normal_priority_and_gets_a_fair_share(contended_run):
    records = _records(contended_run)
    first = records[min(records)]
    assert first["host/niceness"] == 0  # Ray started it at 15: the worker lowered it
    assert all("host/niceness" not in r for s, r in records.items() if s != min(records))  # once per run
    before = [records[s]["time/step_s"] for s in range(20, BURN_FROM + 1, 5)]
    during = [records[s]["time/step_s"] for s in BURN_WINDOWS]
    slowdown = statistics.median(during) / statistics.median(before)
    fair = (BURNERS + THREADS) / CORES  # every runnable thread gets the same share of the cores
    # At Ray's default niceness 15 the busy processes take nearly all of the CPU (70x seen with two
    # of them); at niceness 0 training gets its fair share, with a 2x margin. Other load on the
    # machine lowers the ratio (training was already sharing before the burn), never raises it.
    assert 1.5 < slowdown < 2 * fair, (before, during)
    waits = [records[s]["host/cpu_wait_frac"] for s in BURN_WINDOWS]
    assert statistics.median(waits) > 0.25, waits  # the training thread waited for a core


def test_live_stall_alert_fires_in_the_contended_range_and_names_the_cpu(contended_run):
    records = _records(contended_run)
    stalled = [s for s in BURN_WINDOWS if records[s].get("alert/stall")]
    assert stalled, [records[s] for s in BURN_WINDOWS]
    assert all(records[s].get("alert/stall_cause/cpu") == 1 for s in stalled), [records[s] for s in stalled]


@pytest.mark.quiet
def test_no_stall_before_the_busy_processes_start(contended_run):
    """On a quiet machine the clean part of the run has no stall. Another process that starts and
    stops beside the suite can stall a window for real, so this one needs a quiet machine."""
    records = _records(contended_run)
    assert not [s for s in records if s <= BURN_FROM and records[s].get("alert/stall")]


def test_report_names_the_stall_the_contention_and_the_memory_pressure(contended_run, tmp_path):
    report = make_report(str(contended_run), "contended", out_dir=str(tmp_path / "report"))
    found = {f.key: f for f in report.diagnosis.findings}
    assert {"stall", "host_contention", "memory_pressure"} <= set(found), report.text
    stall, contention = found["stall"], found["host_contention"]
    assert "other processes took the CPU" in stall.title and stall.numbers["lost_s"] > 0
    assert any(f"step {s} (" in stall.evidence[0] or f", {s} (" in stall.evidence[0] for s in BURN_WINDOWS), report.text
    assert contention.numbers["cpu_wait_frac"] > 0.25
    assert any(str(s) in contention.evidence[0] for s in BURN_WINDOWS), report.text
    pressure = found["memory_pressure"]
    assert pressure.numbers["host/memory_budget_frac"] > 0.9
    assert "resources.memory_budget_gb" in " ".join(pressure.advice)
    assert "step_time.png" in {p.rsplit("/", 1)[-1] for p in report.pngs}


@pytest.mark.unit
def test_a_worker_started_at_niceness_15_lowers_every_thread_to_0():
    """What a Ray worker started with Ray's default niceness does at setup (the suite's own Ray
    starts workers at 0, see conftest): every thread, those started before the call included."""
    import subprocess
    import sys

    code = (
        "import os, threading, time\n"
        "from raytrain_fast.metrics.host import run_at_normal_priority\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "before = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "after = run_at_normal_priority()\n"
        "threads = [os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')]\n"
        "print(before, after, max(threads))\n"
    )
    out = subprocess.run(["nice", "-n", "15", sys.executable, "-c", code], capture_output=True, text=True, check=True)
    if os.geteuid() == 0:  # root may lower niceness (CI, containers)
        assert out.stdout.split() == ["15", "0", "0"], out.stderr
    else:  # not permitted: it trains on at 15 and one warning names the fix
        assert out.stdout.split()[1] == "15" and "RAY_worker_niceness=0" in out.stderr, out.stderr
