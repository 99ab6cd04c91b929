#!/usr/bin/env python3
"""Draw the package's layers: each subpackage or top-level module of raytrain_fast as a box with its
size, on the row above everything it imports, and an arrow for each import that no longer path
already implies. Read from the code's own imports (function-level ones too), so it is current.

    python tools/draw_structure.py [docs/images/structure.png]

It also prints the rows as text, bottom first. The graph is tests/test_structure.py's own
`import_graph`, which that test keeps free of cycles, so every unit has a row (run it where the
test dependencies are installed: `pip install -e ".[test]"`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _structure_test():
    """tests/test_structure.py, whose import graph the picture draws: the graph the test keeps free of
    cycles, read the same way (function-level imports too)."""
    spec = importlib.util.spec_from_file_location("test_structure", ROOT / "tests" / "test_structure.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_graph() -> tuple[dict[str, set[str]], dict[str, int]]:
    """(unit -> the units it imports, unit -> its lines of Python)."""
    structure = _structure_test()
    graph = structure.import_graph()
    lines: dict[str, int] = {}
    for path in sorted(structure.PACKAGE.rglob("*.py")):
        if (unit := structure._unit(structure._module_name(path))) in graph:
            lines[unit] = lines.get(unit, 0) + len(path.read_text().splitlines())
    return graph, lines


def rows(graph: dict[str, set[str]]) -> dict[str, int]:
    """unit -> its row: 0 for a unit that imports no other, else one above the highest it imports."""
    row: dict[str, int] = {}

    def place(unit: str) -> int:
        if unit not in row:
            row[unit] = 1 + max((place(t) for t in graph[unit]), default=-1)
        return row[unit]

    for unit in graph:
        place(unit)
    return row


def reduced(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The arrows left when an import another path already implies is dropped (transitive reduction)."""
    def reach(unit: str, seen: set[str]) -> set[str]:
        for target in graph[unit]:
            if target not in seen:
                seen.add(target)
                reach(target, seen)
        return seen

    return {
        unit: {t for t in targets if not any(t in reach(other, set()) for other in targets - {t})}
        for unit, targets in graph.items()
    }


def draw(out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    graph, lines = import_graph()
    row = rows(graph)
    by_row: dict[int, list[str]] = {}
    for unit in sorted(graph, key=lambda u: (row[u], -lines[u], u)):
        by_row.setdefault(row[unit], []).append(unit)
    width = max(len(units) for units in by_row.values())
    fig, ax = plt.subplots(figsize=(2.1 * width + 1, 1.25 * len(by_row) + 1))
    where = {}
    for level, units in by_row.items():
        offset = (width - len(units)) / 2
        for i, unit in enumerate(units):
            where[unit] = (offset + i + 0.5, level)
    for unit, targets in sorted(reduced(graph).items()):
        for target in sorted(targets):  # a fixed order: the same code draws the same file
            (x0, y0), (x1, y1) = where[unit], where[target]
            ax.annotate("", xy=(x1, y1 + 0.22), xytext=(x0, y0 - 0.22),
                        arrowprops={"arrowstyle": "->", "color": "#8a94a6", "lw": 0.8, "shrinkA": 0, "shrinkB": 0})
    for unit, (x, y) in where.items():
        ax.text(x, y, f"{unit}\n{lines[unit]:,} lines", ha="center", va="center", fontsize=9,
                bbox={"boxstyle": "round,pad=0.4", "facecolor": "#eef3fb", "edgecolor": "#3b5b92"})
    ax.set_xlim(0, width)
    ax.set_ylim(-0.6, len(by_row) - 0.4)
    ax.axis("off")
    ax.set_title("raytrain_fast: each box imports only boxes below it (arrows: imports not implied by another path)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    for level in sorted(by_row):
        print(f"row {level}: {', '.join(by_row[level])}")
    print(f"Wrote {out}")


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "docs/images/structure.png")
