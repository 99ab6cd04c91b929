"""Every test says what it costs (`unit`, `ray` or `e2e`), so `pytest -m unit` is a quick loop that a
new file cannot silently slow down or leave out (docs/development.md#tests-by-cost)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import COST_MARKS

pytestmark = pytest.mark.unit

TESTS = Path(__file__).resolve().parent


def _cost_marks(node: ast.expr) -> set[str]:
    """The cost marks named in a `pytestmark` value or a decorator: `pytest.mark.unit`, a list of them."""
    return {
        sub.attr for sub in ast.walk(node)
        if isinstance(sub, ast.Attribute) and sub.attr in COST_MARKS
        and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark"
    }


def unmarked_tests(source: str) -> list[str]:
    """The tests of a file that carry no cost mark, neither their own nor the file's `pytestmark`."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            if _cost_marks(node.value):
                return []
    tests = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             and node.name.startswith(("test_", "Test"))]
    return [node.name for node in tests if not any(_cost_marks(d) for d in node.decorator_list)]


def test_the_check_finds_an_unmarked_test_and_accepts_a_file_or_a_test_mark():
    assert unmarked_tests("import pytest\ndef test_a(): pass\n") == ["test_a"]
    assert unmarked_tests("import pytest\npytestmark = pytest.mark.slow\ndef test_a(): pass\n") == ["test_a"]
    assert unmarked_tests("import pytest\npytestmark = [pytest.mark.slow, pytest.mark.ray]\ndef test_a(): pass\n") == []
    assert unmarked_tests("import pytest\n@pytest.mark.e2e\ndef test_a(): pass\ndef test_b(): pass\n") == ["test_b"]


def test_every_test_file_marks_its_cost():
    files = sorted(TESTS.rglob("test_*.py"))
    assert len(files) > 50, files  # the check really read the suite
    unmarked = {str(path.relative_to(TESTS)): names for path in files if (names := unmarked_tests(path.read_text()))}
    assert not unmarked, (
        f"tests without a cost mark: {unmarked}. Add `pytestmark = pytest.mark.unit` (or ray, e2e) under the "
        "file's imports; see docs/development.md#tests-by-cost"
    )


def test_a_tests_own_mark_wins_over_its_files_so_the_quick_loop_skips_it():
    """test_report.py is marked `unit`; its planted-run tests are marked `ray` one by one."""
    def collected(mark: str) -> set[str]:
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", mark,
             str(TESTS / "test_report.py")],
            capture_output=True, text=True, timeout=120, cwd=TESTS.parent,
        )
        return {line.split("::")[1] for line in done.stdout.splitlines() if "::" in line}

    unit, ray = collected("unit"), collected("ray")
    assert unit and ray and not unit & ray
    assert "test_overfitting_is_named_on_a_planted_run" in ray
    assert "test_a_healthy_run_has_no_finding_and_says_what_it_could_not_check" in unit
