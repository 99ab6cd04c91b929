"""Where a command's CPU time goes, by kind of process: run a command (the whole test suite, say)
and sample every process on the machine from /proc while it runs.

    python3 tools/suite_cpu_by_process.py --json /tmp/cpu.json -- bash .ci/run

Standard library only (it runs before the command's virtual environment exists). Every `--every`
seconds it reads each process's command line and CPU time (user + system); a process is charged the
CPU time it had when last seen, under the kind its command line names (Ray sets an actor's process
title to `ray::<Actor>.<method>`). Processes that live less than one interval are missed: the
table's last row is the machine's busy time (/proc/stat) that no sampled process accounts for.
It also counts what the command started: Ray Train runs (a `TrainController` each), Ray instances
(a `raylet` each) and `raytrain-fast` commands.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from cpu_by_test import busy_seconds  # tools/ is this script's folder

TICK = os.sysconf("SC_CLK_TCK")

KINDS = (  # (kind, a substring of the command line), first match wins
    ("Ray Train training workers", "ray::RayTrainWorker"),
    ("Ray Train controllers", "ray::TrainController"),
    ("Ray Train's other actors", "ray::PlacementGroupCleaner"),
    ("Ray Train's other actors", "ray::SynchronizationActor"),
    ("Ray Train's other actors", "ray::DatasetManager"),
    ("Ray Train's other actors", "ray::PreemptionWatcher"),
    ("Ray Train's other actors", "ray::_StatsActor"),
    ("the run's coordinator actor", "ray::_CoordinatorActor"),
    ("the plan's resolve task and the micro-batch probe", "ray::resolve"),
    ("the plan's resolve task and the micro-batch probe", "ray::probe_micro_batch"),
    ("Ray Data tasks", "ray::ReadFiles"),
    ("Ray Data tasks", "ray::MapBatches"),
    ("Ray Data tasks", "ray::SplitCoordinator"),
    ("Ray Data tasks", "ray::Read"),
    ("Tune trial actors", "ray::ImplicitFunc"),
    ("Tune trial actors", "ray::_Inner"),
    ("Ray Data tasks", "ray::_AutoscalingCoordinatorActor"),
    ("Ray helpers (dashboard, agents, log monitor)", "ray::DashboardAgent"),
    ("Ray helpers (dashboard, agents, log monitor)", "ray::RuntimeEnvAgent"),
    ("other Ray actors and tasks", "ray::"),
    ("Ray core (GCS, raylet)", "gcs_server"),
    ("Ray core (GCS, raylet)", "raylet"),
    ("Ray helpers (dashboard, agents, log monitor)", "dashboard"),
    ("Ray helpers (dashboard, agents, log monitor)", "log_monitor"),
    ("Ray helpers (dashboard, agents, log monitor)", "runtime_env"),
    ("Ray helpers (dashboard, agents, log monitor)", "monitor.py"),
    ("Ray workers not yet an actor (setup_worker, default_worker)", "setup_worker.py"),
    ("Ray workers not yet an actor (setup_worker, default_worker)", "default_worker.py"),
    ("`raytrain-fast` commands", "raytrain-fast"),
    ("`raytrain-fast` commands", "raytrain_fast"),
    ("S3 server (moto)", "moto"),
    ("the pytest process", "pytest"),
    ("installs (pip)", "pip"),
    ("C/C++ compiler", "cc1"),
)


def kind_of(cmdline: str) -> str:
    for kind, marker in KINDS:
        if marker in cmdline:
            return kind
    return "other"


def sample(seen: dict[int, dict]) -> None:
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        parts = stat[stat.rindex(")") + 2:].split()
        start, cpu = int(parts[19]), (int(parts[11]) + int(parts[12])) / TICK
        key = pid * 10**12 + start  # a pid reused by a later process is another process
        record = seen.setdefault(key, {"cpu": 0.0, "cmdline": cmdline, "first_cpu": cpu})
        record["cpu"] = cpu
        if cmdline and not cmdline.startswith("ray::IDLE"):
            record["cmdline"] = cmdline  # the last title that names what the process is


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between samples (default 1)")
    parser.add_argument("--json", help="also write the table and counts to this file")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    seen: dict[int, dict] = {}
    sample(seen)
    before = set(seen)  # processes already running are not the command's
    busy0, wall0 = busy_seconds(), time.monotonic()
    process = subprocess.Popen(command)
    while process.poll() is None:
        time.sleep(args.every)
        sample(seen)
    wall, busy = time.monotonic() - wall0, busy_seconds() - busy0
    by_kind: dict[str, float] = {}
    unnamed: dict[str, float] = {}  # what the catch-all kinds hold, by the start of the command line
    counts = {"Ray Train runs (TrainController)": 0, "Ray instances (raylet)": 0, "`raytrain-fast` commands": 0}
    for key, record in seen.items():
        cpu = record["cpu"] - record["first_cpu"] if key in before else record["cpu"]
        kind = "processes running before the command" if key in before else kind_of(record["cmdline"])
        by_kind[kind] = by_kind.get(kind, 0.0) + cpu
        if kind in ("other", "other Ray actors and tasks"):
            title = record["cmdline"][:60]
            unnamed[title] = unnamed.get(title, 0.0) + cpu
        if key not in before:
            counts["Ray Train runs (TrainController)"] += "ray::TrainController" in record["cmdline"]
            counts["Ray instances (raylet)"] += "/raylet" in record["cmdline"].split(" ", 1)[0]
            counts["`raytrain-fast` commands"] += " raytrain-fast " in f" {record['cmdline']} " or "/raytrain-fast " in record["cmdline"]
    by_kind["not seen by a sample (processes shorter than an interval)"] = max(0.0, busy - sum(by_kind.values()))
    print(f"\nwall {wall:,.0f} s; machine busy {busy:,.0f} CPU-s of {wall * os.cpu_count():,.0f} "
          f"({busy / (wall * os.cpu_count()):.0%} of {os.cpu_count()} CPUs); exit code {process.returncode}", file=sys.stderr)
    print("| process kind | CPU s | share |\n| --- | ---: | ---: |", file=sys.stderr)
    for kind, cpu in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"| {kind} | {cpu:,.0f} | {cpu / busy:.0%} |", file=sys.stderr)
    for name, count in counts.items():
        print(f"{name}: {count}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps({"wall_s": wall, "busy_cpu_s": busy, "cpus": os.cpu_count(),
                                               "by_kind": by_kind, "counts": counts, "unnamed": dict(sorted(unnamed.items(), key=lambda i: -i[1])[:40]), "returncode": process.returncode}, indent=1))
    return process.returncode


if __name__ == "__main__":
    sys.exit(main())
