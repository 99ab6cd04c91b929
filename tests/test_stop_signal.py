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


def test_ctrl_c_and_sigterm_each_save_a_checkpoint_the_same_command_continues_from(tmp_path):
    """Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group (the driver and
    the Ray processes it started; Ray Train's own SIGINT handler would abort the run unsaved): exit
    130 with a checkpoint. The same command continues from it, its output piped to tee, and a SIGTERM
    (as `ray job stop`, Kubernetes or Slurm send it) to tee and then to the run stops that run with a
    checkpoint too (exit 143)."""
    first = _Cli(tmp_path, "--set", "train.steps=100000", terminal=True)
    first.wait_for(r"step\s+6/100000", timeout_s=240)
    os.killpg(first.process.pid, signal.SIGINT)
    code = first.finish(timeout_s=120)
    assert code == 130, first.output
    interrupted = int(first.wait_for(r"saved a checkpoint at step (\d+) and stopped", timeout_s=1).group(1))
    assert "Stopped by SIGINT" in first.output
    assert re.search(rf"Saved checkpoint at step {interrupted} \([\d.]+ MB, uploaded in [\d.]+ s\)", first.output), first.output
    assert re.findall(r"Precision: .*", first.output) == ["Precision: fp32 (engine.precision=fp32, set explicitly)"]
    [run] = [r for r in list_runs(str(tmp_path / "runs"), StorageConfig()) if r.name == "stopme"]
    assert [(c.step, c.complete) for c in run.checkpoints] == [(interrupted, True)]
    assert 6 <= interrupted < 100000

    # The same command again, its output piped to tee as `... 2>&1 | tee run.log`; SIGTERM to tee, then to
    # the run: the pipe closes under the run, which still saves and exits 143.
    code, log = _stopped_through_tee(tmp_path, "--resume", "must", "--set", "train.steps=100000",
                                     at=rf"step\s+{interrupted + 4}/100000", notice=signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, log
    assert f"Resumed from checkpoint at step {interrupted}" in log
    assert re.findall(r"Precision: .*", log) == [f"Precision: fp32 (kept from the checkpoint at step {interrupted})"]
    [found] = [r for r in list_runs(str(tmp_path / "runs"), StorageConfig()) if r.name == "stopme"]
    newest = max(found.checkpoints, key=lambda c: c.step)
    assert newest.complete and newest.step > interrupted, log  # the SIGTERM's, past the Ctrl-C's


def _wait_for_line(path: Path, pattern: str, *, timeout_s: float, process: subprocess.Popen) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text(errors="replace") if path.exists() else ""
        if match := re.search(pattern, text):
            return match
        if process.poll() is not None:
            break
        time.sleep(0.2)
    raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s; {path.name}:\n{text}")


def _piped_to_tee(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    """`raytrain-fast pretrain ... 2>&1 | tee run.log` as a shell starts the job: both in the job's own
    process group, Ctrl-C at its default."""
    program = str(Path(sys.executable).parent / "raytrain-fast")
    env = {**os.environ, "RAY_ADDRESS": "local"}
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731 - as a terminal's job starts
    run = subprocess.Popen(
        [program, "pretrain", "--config", "tiny", "--name", "stopme", *args,
         *[item for value in MICRO for item in ("--set", value)], "--set", f"storage.uri={tmp_path / 'runs'}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=tmp_path,
        process_group=0, preexec_fn=default_sigint,  # the job's own process group, as a shell makes one
    )
    tee = subprocess.Popen(["tee", str(tmp_path / "run.log")], stdin=run.stdout, stdout=subprocess.DEVNULL,
                           process_group=run.pid, preexec_fn=default_sigint)
    assert run.stdout is not None
    run.stdout.close()  # tee alone reads the pipe, as in a shell
    return run, tee


def _stopped_through_tee(tmp_path: Path, *args: str, at: str, notice: int) -> tuple[int, str]:
    """The run piped to tee, stopped once run.log shows `at`: Ctrl-C (the terminal sends SIGINT to the
    whole job: tee exits on it) or SIGTERM to tee and then to the run. The run's exit status and run.log."""
    run, tee = _piped_to_tee(tmp_path, *args)
    try:
        _wait_for_line(tmp_path / "run.log", at, timeout_s=240, process=run)
        if notice == signal.SIGINT:
            os.killpg(run.pid, notice)
        else:
            tee.send_signal(notice)
        assert tee.wait(timeout=30) == -notice  # the pipe's reader is gone
        if notice == signal.SIGTERM:
            run.send_signal(notice)
        code = run.wait(timeout=180)
    finally:
        for process in (run, tee):
            if process.poll() is None:
                process.kill()
                process.wait()
    return code, (tmp_path / "run.log").read_text(errors="replace")


def test_a_ctrl_c_with_the_output_piped_to_tee_saves_a_checkpoint(tmp_path):
    """`raytrain-fast pretrain ... 2>&1 | tee run.log`, then Ctrl-C: the pipe closes under the run, which
    still saves and exits 130 (SIGTERM through tee: the resumed run of the test above). (A SIGTERM to
    the whole process group also reaches the local Ray instance's own processes, which end on it.)"""
    code, log = _stopped_through_tee(tmp_path, "--set", "train.steps=100000", at=r"step\s+6/100000", notice=signal.SIGINT)
    assert code == 128 + signal.SIGINT, log
    [found] = [r for r in list_runs(str(tmp_path / "runs"), StorageConfig()) if r.name == "stopme"]
    assert [c.complete for c in found.checkpoints] == [True], log
    assert 6 <= found.checkpoints[0].step < 100000
