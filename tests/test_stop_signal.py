"""A stop notice (SIGTERM, as `ray job stop`, Kubernetes or Slurm send it) saves a checkpoint and
stops; the same command continues from that checkpoint. Real CLI process, real Ray, real DeepSpeed."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from raytrain_fast.checkpoint import list_runs
from raytrain_fast.storage import StorageConfig

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MICRO = [
    "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
    "data.seq_len=32", "data.max_tokens=60000", "train.micro_batch=4", "train.global_batch=4",
    "train.log_every=2", "optim.warmup_steps=3", "resources.num_workers=1", "resources.max_failures=0",
    "engine.precision=fp32", "metrics.profile_every=0",
    # No step-based saves: any checkpoint before the end comes from the stop notice.
    "checkpoint.every_steps=0", "checkpoint.every_minutes=0",
]


class _Cli:
    """`raytrain-fast pretrain` in its own process (and its own local Ray), output collected live."""

    def __init__(self, tmp_path: Path, *args: str, terminal: bool = False) -> None:
        """terminal: started as a shell starts a foreground job, in a process group (and here a
        session) of its own, so that a Ctrl-C can be sent as the terminal sends it: to the group."""
        env = {**os.environ, "RAY_ADDRESS": "local"}  # a fresh local instance, never a running cluster
        self.process = subprocess.Popen(
            [sys.executable, "-m", "raytrain_fast.cli", "pretrain", "--config", "tiny", "--name", "stopme", *args,
             *[item for value in MICRO for item in ("--set", value)], "--set", f"storage.uri={tmp_path / 'runs'}"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path,
            start_new_session=terminal,
            # A terminal's job starts with Ctrl-C at its default; a child of pytest may inherit it ignored.
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) if terminal else None,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s; output:\n{self.output}")

    def finish(self, timeout_s: float) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def test_sigterm_saves_a_checkpoint_and_the_same_command_continues(tmp_path):
    first = _Cli(tmp_path, "--set", "train.steps=100000")
    first.wait_for(r"step\s+6/100000", timeout_s=240)
    first.process.send_signal(signal.SIGTERM)
    code = first.finish(timeout_s=120)
    assert code == 128 + signal.SIGTERM, first.output
    saved = int(first.wait_for(r"saved a checkpoint at step (\d+) and stopped", timeout_s=1).group(1))
    assert "Stopped by SIGTERM" in first.output
    assert re.findall(r"Precision: .*", first.output) == ["Precision: fp32 (engine.precision=fp32, set explicitly)"]

    [run] = [r for r in list_runs(str(tmp_path / "runs"), StorageConfig()) if r.name == "stopme"]
    assert [(c.step, c.complete) for c in run.checkpoints] == [(saved, True)]
    assert 6 <= saved < 100000

    second = _Cli(tmp_path, "--resume", "must", "--set", f"train.steps={saved + 2}")
    assert second.finish(timeout_s=240) == 0, second.output
    assert f"Resumed from checkpoint at step {saved}" in second.output
    assert re.findall(r"Precision: .*", second.output) == [f"Precision: fp32 (kept from the checkpoint at step {saved})"]
    assert re.search(rf"step\s+{saved + 2}/{saved + 2}", second.output), second.output


def test_ctrl_c_saves_a_checkpoint_and_exits_130(tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group (the driver and
    the Ray processes it started). Ray Train's own SIGINT handler would abort the run unsaved."""
    cli = _Cli(tmp_path, "--set", "train.steps=100000", terminal=True)
    cli.wait_for(r"step\s+6/100000", timeout_s=240)
    os.killpg(cli.process.pid, signal.SIGINT)
    code = cli.finish(timeout_s=120)
    assert code == 130, cli.output
    saved = int(cli.wait_for(r"saved a checkpoint at step (\d+) and stopped", timeout_s=1).group(1))
    assert "Stopped by SIGINT" in cli.output
    assert re.search(rf"Saved checkpoint at step {saved} \([\d.]+ MB, uploaded in [\d.]+ s\)", cli.output), cli.output
    [run] = [r for r in list_runs(str(tmp_path / "runs"), StorageConfig()) if r.name == "stopme"]
    assert [(c.step, c.complete) for c in run.checkpoints] == [(saved, True)]
    assert 6 <= saved < 100000
