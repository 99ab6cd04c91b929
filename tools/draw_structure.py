#!/usr/bin/env python3
"""Draw the package's layers: each subpackage or top-level module of raytrain_fast as a box with its
size, on the row above everything it imports, and an arrow for each import that no longer path
already implies. Read from the code's own imports (function-level ones too), so it is current.

    python tools/draw_structure.py [docs/images/structure.png]

It also prints the rows as text, bottom first. tests/test_structure.py keeps the graph free of
cycles, so every unit has a row.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "raytrain_fast"


def _unit_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "raytrain_fast" and len(parts) > 1 else None


def _imported_units(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
                found.update(f"{'.'.join(base)}.{alias.name}" for alias in node.names if not node.module)
            else:
                found.add(node.module or "")
                if node.module == "raytrain_fast":
                    found.update(f"raytrain_fast.{alias.name}" for alias in node.names)
    return {unit for name in found if (unit := _unit_of(name))}


def import_graph() -> tuple[dict[str, set[str]], dict[str, int]]:
    """(unit -> the units it imports, unit -> its lines of Python)."""
    graph: dict[str, set[str]] = {}
    lines: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        unit = _unit_of(".".join(parts))
        if unit is None:
            continue
        graph.setdefault(unit, set()).update(_imported_units(path, ".".join(parts)) - {unit})
        lines[unit] = lines.get(unit, 0) + len(path.read_text().splitlines())
    return {unit: {t for t in targets if t in graph} for unit, targets in graph.items()}, lines


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
    for unit, targets in reduced(graph).items():
        for target in targets:
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
