"""Every command shape the docs show, run as a reader runs it: typed into a fresh bash with a clean
environment (PATH with the venv's `bin` first, HOME, nothing of pytest's: no DS_ACCELERATOR, no Ray
settings, no shared Ray instance), each in its own process, with settings small enough for seconds.

A shape is a subcommand (`bench` counts per benchmark). The set run here must cover every shape that
README.md and docs/*.md show (tests/test_docs.py collects them), so a newly documented command fails
this test until it runs from a shell too. Ctrl-C from a terminal: tests/test_stop_signal.py; `ray job
submit ... -- python jobs/pretrain.py`: tests/test_job_submit.py."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests.shell import SETS, package_texts, shell
from tests.test_docs import COMMANDS

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

# (shape, command line as typed, what its output must show). Run in this order, in one directory.
SESSION = [
    ("show-config", f"raytrain-fast show-config --config tiny {SETS}", "d_model: 32"),
    ("prepare-data", "raytrain-fast prepare-data --input texts --output prepared --seq-len 32 --val-fraction 0.2",
     "prepare-data:"),
    ("train-tokenizer", "raytrain-fast train-tokenizer --input texts --output tok --vocab-size 300",
     "Prepare data with it"),
    ("pretrain", f"raytrain-fast pretrain --config tiny --name shell {SETS} --set data.source=prepared --set storage.uri=runs",
     "Done. Run directory:"),
    ("runs", "raytrain-fast runs --storage runs", "shell"),
    ("evaluate", "raytrain-fast evaluate --storage runs --name shell --tasks csqa --limit 4", "csqa"),
    ("report", "raytrain-fast report --storage runs --name shell --out report", "Run 'shell'"),
    ("export", "raytrain-fast export --storage runs --name shell --out exported", "exported"),
    ("export", "raytrain-fast export --storage runs --name shell --format hf --out hf-exported", "hf-exported"),
    ("evaluate", "raytrain-fast evaluate --hf hf-exported --tasks csqa --limit 4 --workers 2", "csqa"),
    ("sweep", f"raytrain-fast sweep --config tiny --name sw {SETS} --set data.source=prepared --set storage.uri=runs "
              "--micro-batch 4 --steps 4", "micro_batch"),  # one trial (several: test_printed_commands.py)
    ("bench data", "raytrain-fast bench data --steps 2 --warmup-steps 1 --rounds 1 --json", "{"),
    ("bench overhead", "raytrain-fast bench overhead --d-model 32 --layers 1 --heads 2 --steps 4 --warmup-steps 2 --log-every 2 "
                       "--repeats 1 --variants bare,raytrain_fast --json", "{"),
    ("bench checkpoint", "raytrain-fast bench checkpoint --checkpoint-mb 1 --checkpoints 2 --seconds-between 1 --json", "{"),
    ("bench model", "raytrain-fast bench model --preset tiny --seq-len 32 --micro-batch 2 --steps 2 --rounds 1 "
                    "--warmup-steps 1 --variants bare,engine --peak-seconds 0.2 --json", "{"),
    ("bench health", "raytrain-fast bench health --steps 2 --rounds 2 --warmup-steps 1 --ops-calls 10 --json", "{"),
]


def assert_checkpoint_bench(result: dict, *, checkpoints: int, checkpoint_mb: float) -> None:
    """`bench checkpoint --json` on its own loopback S3 server: both modes timed and their last
    checkpoints complete in storage."""
    for mode in ("async", "sync"):
        assert result[f"last_checkpoint_complete_{mode}"] is True, result
        assert len(result[f"blocked_s_{mode}_all"]) == checkpoints and all(b > 0 for b in result[f"blocked_s_{mode}_all"]), result
        assert result[f"write_s_{mode}"] > 0, result
    # A sync save uploads inside Ray's report; an async one never waits for an upload there.
    assert result["report_s_sync"] >= result["upload_s_sync"] * 0.5, result
    assert result["checkpoint_mb"] >= checkpoint_mb
    assert result["ratio"] == pytest.approx(result["blocked_s_async"] / result["blocked_s_sync"])


def documented_shapes() -> set[str]:
    return {f"bench {words[1]}" if words[0] == "bench" and len(words) > 1 else words[0] for _, words in COMMANDS}


def test_the_session_covers_every_documented_command_shape():
    shapes = documented_shapes()
    assert {"pretrain", "export", "bench overhead"} <= shapes  # the collector really read the docs
    missing = shapes - {shape for shape, _, _ in SESSION}
    assert not missing, f"documented but never run from a fresh shell here: {sorted(missing)}"


def test_every_documented_command_shape_runs_from_a_fresh_shell(tmp_path):
    package_texts(tmp_path / "texts", "email", "json")  # real text to train on: about 40 documents, 500 KB
    failures, results = [], {}
    for shape, line, expected in SESSION:
        done = shell(line, cwd=tmp_path, home=tmp_path / "home")
        shown = done.stdout + done.stderr
        if done.returncode != 0 or expected not in shown:
            failures.append(f"$ {line}\nexit {done.returncode}\n{shown[-3000:]}")
            continue
        if re.search(r"\d+%\|", shown):  # a dependency's progress bar (tqdm's "40%|####"), e.g. every --hf worker's
            failures.append(f"$ {line}\nprinted a progress bar:\n{shown[-3000:]}")
        if line.endswith("--json"):
            results[shape] = json.loads(done.stdout)  # the JSON object alone on stdout, as --json promises
    assert not failures, "\n\n".join(failures)
    assert_checkpoint_bench(results["bench checkpoint"], checkpoints=2, checkpoint_mb=1)
    assert (tmp_path / "exported").is_dir() and any((tmp_path / "report").iterdir())
    assert "shell" in os.listdir(tmp_path / "runs")
