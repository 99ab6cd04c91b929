"""The suite's time by test file, from pytest's JUnit XML, as a Markdown table (docs/test-time.md).

    CI=true pytest --junitxml=/tmp/junit.xml
    python tools/test_time_by_file.py /tmp/junit.xml [/tmp/other.xml]

With two files, the second is compared with the first (before, after, change). A test's time is
pytest's own for it: setup, call and teardown, so a session fixture's start-up is charged to the
first test that asked for it. `Tests` counts test ids, skipped ones included.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def by_file(path: str) -> dict[str, tuple[float, int]]:
    """{test file: (seconds, tests)} of one JUnit XML."""
    times: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")
        # classname is "tests.test_x" or "tests.test_x.TestClass": the file is the first test_ part
        parts = module[: next((i + 1 for i, p in enumerate(module) if p.startswith("test_")), len(module))]
        name = "/".join(parts) + ".py"
        times[name] += float(case.get("time", 0))
        counts[name] += 1
    return {name: (times[name], counts[name]) for name in times}


def table(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]] | None = None) -> str:
    rows = []
    if after is None:
        total = sum(t for t, _ in before.values())
        rows += ["| file | tests | s | share |", "| --- | ---: | ---: | ---: |"]
        for name, (seconds, count) in sorted(before.items(), key=lambda kv: -kv[1][0]):
            rows.append(f"| {name} | {count} | {seconds:.0f} | {100 * seconds / total:.1f}% |")
        rows.append(f"| **all** | {sum(c for _, c in before.values())} | {total:.0f} | 100% |")
        return "\n".join(rows)
    rows += ["| file | tests before | tests after | s before | s after | change |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    names = sorted(set(before) | set(after), key=lambda n: -before.get(n, after.get(n, (0, 0)))[0])
    for name in names:
        (b, bc), (a, ac) = before.get(name, (0.0, 0)), after.get(name, (0.0, 0))
        rows.append(f"| {name} | {bc} | {ac} | {b:.0f} | {a:.0f} | {a - b:+.0f} |")
    tb, ta = sum(t for t, _ in before.values()), sum(t for t, _ in after.values())
    cb, ca = sum(c for _, c in before.values()), sum(c for _, c in after.values())
    rows.append(f"| **all** | {cb} | {ca} | {tb:.0f} | {ta:.0f} | {ta - tb:+.0f} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    print(table(by_file(sys.argv[1]), by_file(sys.argv[2]) if len(sys.argv) == 3 else None))
