"""The command line and the `ray job submit` entry point, without starting Ray."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from raytrain_fast.cli import main

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def test_show_config_prints_resolved_yaml(capsys):
    assert main(["show-config", "--set", "train.steps=42", "--name", "abc"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["name"] == "abc" and shown["train"]["steps"] == 42 and shown["model"]["d_model"] == 128


def test_bad_config_exits_2_with_the_message(capsys):
    assert main(["pretrain", "--set", "train.micro_batch=0"]) == 2
    err = capsys.readouterr().err
    assert "train.micro_batch must be > 0, got 0" in err and "Traceback" not in err


def test_job_entry_point_parses_the_same_arguments():
    # Runs as `ray job submit` would: a plain python process in the repo root.
    done = subprocess.run(
        [sys.executable, "jobs/pretrain.py", "--config", "tiny", "--set", "train.stepz=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    assert "unknown key 'train.stepz'" in done.stderr


def test_drills_are_asked_for_by_name_and_a_bad_one_is_refused_before_ray(capsys):
    from raytrain_fast.drills import FailOnce, LoopHooks, SlowData, SlowSink, parse_drills

    hooks = parse_drills(["slow_data=0.1:40:0", "slow-sink=2", "fail_once_at=150:/tmp/m:1:kill"])
    assert hooks == LoopHooks(SlowData(0.1, 40, 0), SlowSink(2.0), FailOnce(150, "/tmp/m", 1, kill=True))
    assert LoopHooks().active() == [] and hooks.for_rank(1).on_batch is None
    for bad, says in [("slow_dat=1", "NAME one of"), ("slow_step=x", "malformed SPEC for slow_step"),
                      ("fail_once_at=/tmp/m", "malformed SPEC for fail_once_at"), ("slow_sink", "expected NAME=SPEC")]:
        assert main(["pretrain", "--drill", bad]) == 2, bad
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err, (bad, err)


def test_console_masks_secrets_strips_colour_off_a_terminal_and_drops_ray_dumps(monkeypatch):
    import io

    from raytrain_fast.console import ConsoleStream

    monkeypatch.setenv("SOME_SERVICE_TOKEN", "tok-0123456789")
    sink = io.StringIO()  # not a terminal
    stream = ConsoleStream(sink)
    stream.write("\x1b[36m(RayTrainWorker pid=1)\x1b[0m step 10 loss 2.5\n")
    stream.write("(RayTrainWorker pid=1) Reporting training result 1: TrainingReport(checkpoint=...)\nkept line\n")
    stream.write("(TrainController pid=2) [...] E 1 2] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and ...\n")
    stream.write("endpoint http://user:hunter22@host:9000/x?X-Amz-Signature=abc and tok-0123456789\n")
    assert sink.getvalue().splitlines() == [
        "(RayTrainWorker pid=1) step 10 loss 2.5",
        "kept line",
        "endpoint http://user:***@host:9000/x?X-Amz-Signature=*** and ***",
    ]


def test_version_and_debug_flags(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0 and capsys.readouterr().out.startswith("raytrain-fast ")
    assert main(["show-config", "--debug", "--set", "engine.precision=bfloat16"]) == 0  # --debug anywhere
    assert yaml.safe_load(capsys.readouterr().out)["engine"]["precision"] == "bf16"  # torch's spelling accepted


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """Every parser of the command line with its command path, sub-commands included."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_command_and_option_has_help():
    from raytrain_fast.cli import build_parser

    parser = build_parser()
    assert "Ray" in parser.description and "command line." not in parser.description
    missing = []
    for path, sub in _parsers(parser):
        if path and not (sub.description or "").strip():
            missing.append(f"{' '.join(path)}: no description")
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction) or not action.option_strings:
                continue
            if not (action.help or "").strip():
                missing.append(f"{' '.join(path)} {action.option_strings[0]}: no help")
    assert not missing, missing
    names = {path: sub for path, sub in _parsers(parser)}
    for command in (("sweep",), ("show-config",)):
        name_help = next(a.help for a in names[command]._actions if "--name" in a.option_strings)
        assert "resumes" not in name_help, (command, name_help)  # only pretrain resumes a run
