"""How busy the machine was during each test: a pytest plugin, and its table by file.

    CPU_PER_TEST=/tmp/cpu.jsonl PYTHONPATH=tools pytest -p cpu_by_test   # one JSON line per test
    python tools/cpu_by_test.py /tmp/cpu.jsonl                           # the table by file

For each test (setup, call and teardown, as pytest times it) the plugin writes its wall seconds and
the CPU seconds the whole machine was busy meanwhile (/proc/stat: every process, the test's Ray
processes and subprocesses too). A file whose tests keep both cores busy is bound by its work; one
with idle cores waits (Ray start-up, polls, timeouts, sleeps), and only less waiting shortens it.
Standard library only; nothing is written unless CPU_PER_TEST is set.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

try:
    import pytest
except ImportError:  # the table needs no pytest
    pytest = None

TICK = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the machine spent busy since boot (all cores; idle and iowait left out)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / TICK


if pytest is not None:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        path = os.environ.get("CPU_PER_TEST")
        busy, start = busy_seconds(), time.monotonic()
        yield
        if path:
            with open(path, "a") as out:
                out.write(json.dumps({"nodeid": item.nodeid, "wall_s": time.monotonic() - start,
                                      "busy_cpu_s": busy_seconds() - busy}) + "\n")


def table(path: str, cpus: int) -> str:
    files: dict[str, list[float]] = {}
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        totals = files.setdefault(record["nodeid"].split("::")[0], [0, 0.0, 0.0])
        totals[0] += 1
        totals[1] += record["wall_s"]
        totals[2] += record["busy_cpu_s"]
    wall = sum(t[1] for t in files.values())
    busy = sum(t[2] for t in files.values())
    rows = [f"| file | tests | wall s | busy CPU-s | busy of {cpus} CPUs | idle CPU-s |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, (tests, w, b) in sorted(files.items(), key=lambda item: -(cpus * item[1][1] - item[1][2])):
        rows.append(f"| {Path(name).name} | {tests} | {w:,.0f} | {b:,.0f} | {b / (cpus * w):.0%} | {cpus * w - b:,.0f} |")
    rows.append(f"| **all** | {sum(t[0] for t in files.values())} | {wall:,.0f} | {busy:,.0f} | "
                f"{busy / (cpus * wall):.0%} | {cpus * wall - busy:,.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/cpu_by_test.py CPU_PER_TEST_FILE")
    print(table(sys.argv[1], os.cpu_count() or 1))
