"""Library modules write their lines through `raytrain_fast.console.say`, which masks credentials,
flushes and knows the rank; only the CLI (cli.py) and the console module itself print."""

from __future__ import annotations

import ast
import contextlib
import io
import sys
from pathlib import Path

import pytest

import raytrain_fast
from raytrain_fast.console import ConsoleStream, say

pytestmark = pytest.mark.unit

PACKAGE = Path(raytrain_fast.__file__).resolve().parent
MAY_PRINT = {"cli.py", "console.py"}


def direct_writes(source: str) -> list[int]:
    """Lines that reach the console without the console module: the builtin print, called or passed on
    (`warn=print`), and `sys.stdout.write` / `sys.stderr.write`."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id == "print" and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif (isinstance(node, ast.Attribute) and node.attr == "write" and isinstance(node.value, ast.Attribute)
              and node.value.attr in ("stdout", "stderr") and getattr(node.value.value, "id", None) == "sys"):
            lines.append(node.lineno)
    return sorted(lines)


def _library_modules() -> dict[str, Path]:
    return {path.relative_to(PACKAGE).as_posix(): path for path in sorted(PACKAGE.rglob("*.py"))}


def test_the_check_finds_a_print_called_or_passed_on_and_a_stream_write():
    assert direct_writes("x = 1\nprint('hi', flush=True)\n") == [2]
    assert direct_writes("def f(*, warn=print):\n    warn('x')\n") == [1]
    assert direct_writes("import sys\nsys.stderr.write('x\\n')\nsys.stdout.write('y')\n") == [2, 3]
    # Not console writes: a method or attribute of that name, a string, a file's write.
    assert direct_writes("self.print_summary()\ncontext.print_on_execution_start = False\n'print(x)'\nout.write(b'')\n") == []


def test_library_modules_write_through_the_console():
    modules = _library_modules()
    assert len(modules) > 100, modules  # the check really read the package
    found = {
        name: lines for name, path in modules.items()
        if name not in MAY_PRINT and (lines := direct_writes(path.read_text()))
    }
    assert not found, (
        f"library modules that print: {found} (file: lines). Write the line with "
        "`raytrain_fast.console.say(line, rank=...)`, or return the text for the CLI to print"
    )


def test_a_workers_line_is_said_once_by_rank_zero_and_a_per_rank_line_by_each(capsys):
    for rank in range(3):
        say(f"job line from rank {rank}", rank=rank)
        say(f"found by rank {rank}", rank=rank, per_rank=True)
    say("driver line")
    out = capsys.readouterr().out.splitlines()
    assert out == ["job line from rank 0", "found by rank 0", "found by rank 1", "found by rank 2", "driver line"]


def test_stderr_lines_stay_off_stdout(capsys):
    say("prepare-data: 3/10 files", stderr=True)
    say("result")
    captured = capsys.readouterr()
    assert captured.err == "prepare-data: 3/10 files\n" and captured.out == "result\n"


def test_say_writes_to_the_stream_in_place_at_the_call(capsys):
    """`contextlib.redirect_stdout(sys.stderr)` (a bench keeping stdout for its JSON) moves said lines too."""
    with contextlib.redirect_stdout(sys.stderr):
        say("progress")
    captured = capsys.readouterr()
    assert captured.err == "progress\n" and captured.out == ""


def test_a_said_line_is_flushed_at_once(monkeypatch):
    raw = io.BytesIO()
    buffered = io.TextIOWrapper(io.BufferedWriter(raw, buffer_size=1 << 16), encoding="utf-8")  # no line buffering
    monkeypatch.setattr(sys, "stdout", buffered)
    say("Saved checkpoint at step 10")
    assert raw.getvalue() == b"Saved checkpoint at step 10\n"


def test_a_said_line_is_masked_once_in_a_worker_and_reads_the_same_through_the_clis_streams(monkeypatch):
    secret = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYEXAMPLEKEY"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    line = f"Skipping checkpoint s3://user:hunter2pass@bucket/run: key {secret}"
    worker, driver = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", worker)  # a Ray worker: nothing wraps its stdout
    say(line)
    monkeypatch.setattr(sys, "stdout", ConsoleStream(driver))  # the CLI's wrapped stdout
    say(line)
    assert secret not in worker.getvalue() and "hunter2pass" not in worker.getvalue(), worker.getvalue()
    assert worker.getvalue() == driver.getvalue() == "Skipping checkpoint s3://user:***@bucket/run: key ***\n"
