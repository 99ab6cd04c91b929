"""The README's promises: its commands are what CI runs, and its config reference is current."""

from __future__ import annotations

import re
from pathlib import Path

from raytrain_fast.config import reference_markdown

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def test_readme_starts_with_the_run_and_the_test_command():
    run_command, test_command = (block.strip() for block in bash_blocks()[:2])
    assert run_command.endswith("raytrain-fast pretrain") and "constraints-cpu.txt" in run_command
    assert test_command.endswith("pytest") and '".[test]"' in test_command


def test_ci_runs_the_readme_test_command():
    test_command = bash_blocks()[1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_config_reference_in_readme_is_current():
    section = README.split("<!-- config-reference:start", 1)[1].split("<!-- config-reference:end -->", 1)[0]
    table = section.split("\n", 1)[1]
    assert table == reference_markdown(), "regenerate with: raytrain-fast show-config --reference"


def test_constraints_pin_the_cpu_torch():
    assert "torch==2.13.0" in (ROOT / "constraints-cpu.txt").read_text()
