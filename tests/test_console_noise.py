"""What the command line prints, as a user reads it: nothing that contradicts what
happened, nothing from the Python API, no library chatter."""

from __future__ import annotations

import pytest

import json

from raytrain_fast.cli import main

pytestmark = pytest.mark.unit


def test_prepare_data_does_not_call_a_used_jsonl_file_skipped(tmp_path, capsys):
    good = [json.dumps({"text": f"document number {i} " * 8}) for i in range(4)]
    (tmp_path / "d.jsonl").write_text("\n".join([good[0], "not json", good[1], "{}", '{"text": ""}', *good[2:]]) + "\n")
    assert main(["prepare-data", "--input", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "data"), "--seq-len", "8"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 input" not in err, err  # the file was used
    line = next(line for line in err.splitlines() if "JSONL records skipped" in line)
    assert "used " in line and "d.jsonl" in line and "3 JSONL records skipped" in line, line
    assert ", 0 skipped," in err or " skipped," not in err  # the progress line counts no skipped file


def test_prepare_data_over_other_data_names_the_flag_not_the_python_argument(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text to prepare " * 20)
    (tmp_path / "b.txt").write_text("other text to prepare " * 20)
    out = str(tmp_path / "data")
    assert main(["prepare-data", "--input", str(tmp_path / "a.txt"), "--output", out, "--seq-len", "8"]) == 0
    capsys.readouterr()
    assert main(["prepare-data", "--input", str(tmp_path / "b.txt"), "--output", out, "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err, err


_SUMMARY_SCRIPT = """
import sys
import ray
import ray.data
from raytrain_fast.data.ingest import hide_execution_summaries

ray.init(address=sys.argv[1], log_to_driver=False)

def read():
    dataset = ray.data.range(8, override_num_blocks=2)
    dataset.context.enable_progress_bars = False
    assert sum(len(b["id"]) for b in dataset.iter_batches(batch_size=4)) == 8

read()
print("-- hidden from here --", file=sys.stderr, flush=True)
hide_execution_summaries()
read()
"""


@pytest.mark.ray
def test_ray_data_execution_summary_stays_off_the_console(ray_session):
    # In a process of its own: earlier tests in pytest's process (a bench's own TorchTrainer runs) leave Ray
    # Data printing no summary at all there, so the check could not fail.
    import subprocess
    import sys

    address = ray_session.get_runtime_context().gcs_address
    done = subprocess.run([sys.executable, "-c", _SUMMARY_SCRIPT, address], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=300)  # one stream, in the order written
    assert done.returncode == 0, done.stdout[-3000:]
    before, after = done.stdout.split("-- hidden from here --")
    assert "execution finished" in before, before[-3000:]  # what a training epoch printed: the test sees it first
    assert "execution finished" not in after, after[-3000:]


def test_a_dropped_noise_line_leaves_no_blank_line():
    import io

    from raytrain_fast.console import ConsoleStream

    out = io.StringIO()
    stream = ConsoleStream(out)
    print("Eval: off", file=stream)
    print("Started a local Ray instance. View the dashboard at http://127.0.0.1:8265", file=stream)  # Ray: line, then "\n"
    print("Usage stats collection is enabled", file=stream)
    stream.write("Connected to Ray cluster\nstep 1/2  loss 5.0\n")
    print("", file=stream)  # a blank line the program means stays
    print("Done.", file=stream)
    assert out.getvalue() == "Eval: off\nstep 1/2  loss 5.0\n\nDone.\n"


def test_wait_for_quiet_returns_after_the_last_forwarded_line():
    import io
    import threading
    import time

    from raytrain_fast.console import ConsoleStream, wait_for_quiet

    out = io.StringIO()
    stream = ConsoleStream(out)

    def rank_1() -> None:  # Ray forwarding a worker's last lines after fit() returned
        for i in range(4):
            print(f"(RayTrainWorker pid=2) line {i}", file=stream)
            time.sleep(0.1)

    writer = threading.Thread(target=rank_1)
    writer.start()
    time.sleep(0.05)
    wait_for_quiet(quiet_s=0.3, max_s=3.0)
    print("Done.", file=stream)
    writer.join()
    assert out.getvalue().splitlines()[-1] == "Done.", out.getvalue()


def test_deepspeed_tp_size_notice_is_dropped():
    import io

    from raytrain_fast.console import ConsoleStream

    out = io.StringIO()
    print("(RayTrainWorker pid=1) [WARNING] [base_optimizer.py:343] MPU is not provided, setting tp size to 1 in checkpoint loading.",
          file=ConsoleStream(out))
    assert out.getvalue() == ""


def test_an_expected_backend_shutdown_traceback_is_dropped_whole():
    import io

    from raytrain_fast.console import ConsoleStream

    out = io.StringIO()
    stream = ConsoleStream(out)
    p = "(TrainController pid=7) "
    stream.write(
        f"{p}Graceful shutdown of backend failed. This is expected if one of the workers has crashed.\n"
        f"{p}Traceback (most recent call last):\n"
        f'{p}  File "backend_setup.py", line 27, in before_execution_group_shutdown\n'
        f"{p}    self._backend.on_shutdown(execution_group, self._backend_config)\n"
        f"{p}ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
        "(RayTrainWorker pid=8) step 4/6  loss 3.1\n"
    )
    print(f"{p}Traceback (most recent call last):", file=stream)  # another process's traceback is kept
    assert out.getvalue() == f"(RayTrainWorker pid=8) step 4/6  loss 3.1\n{p}Traceback (most recent call last):\n", out.getvalue()


def test_an_actor_death_dump_goes_with_its_traceback():
    import io

    from raytrain_fast.console import ConsoleStream

    out = io.StringIO()
    stream = ConsoleStream(out)
    p = "(TrainController pid=27519) "
    stream.write(
        f"{p}Graceful shutdown of backend failed. This is expected if one of the workers has crashed.\n"
        f"{p}Traceback (most recent call last):\n"
        f"{p}ray.exceptions.ActorDiedError: The actor died unexpectedly before finishing this task.\n"
        f"{p}\tclass_name: RayTrainWorker\n{p}\tactor_id: 485d2ae3ab73e0190e3ad64b01000000\n{p}\tpid: 28186\n"
        f"{p}The actor is dead because its worker process has died. Worker exit type: INTENDED_SYSTEM_EXIT\n"
        "(RayTrainWorker pid=29165) step 1/6  loss 8.1558\n"
    )
    assert out.getvalue() == "(RayTrainWorker pid=29165) step 1/6  loss 8.1558\n", out.getvalue()


def test_a_sweeps_expected_trial_outcomes_leave_no_traceback_while_its_trials_run():
    import io

    from raytrain_fast.console import SWEEP_NOISE_WITH_TRACEBACK, ConsoleStream, quiet_lines

    over_budget = (
        "(RayTrainWorker pid=29165) Error in training function:\n"
        "(RayTrainWorker pid=29165) Traceback (most recent call last):\n"
        '(RayTrainWorker pid=29165)   File "raytrain_fast/sweep/trial.py", line 41, in report_window\n'
        "(RayTrainWorker pid=29165)     raise MemoryBudgetExceeded(\n"
        "(RayTrainWorker pid=29165) raytrain_fast.microbatch.plan.MemoryBudgetExceeded: peak memory 1.075 GB > "
        "resources.memory_budget_gb 0.900 GB at step 1\n"
        "(RayTrainWorker pid=29165) \n"
    )
    ended = (
        "(run_trial pid=25896) Exception ignored in: <function WeakSet.__init__.<locals>._remove at 0x7feb810b2660>\n"
        "(run_trial pid=25896) Traceback (most recent call last):\n"
        '(run_trial pid=25896)   File "ray/_private/worker.py", line 1063, in sigterm_handler\n'
        "(run_trial pid=25896) SystemExit: 1\n"
    )
    out = io.StringIO()
    with quiet_lines(SWEEP_NOISE_WITH_TRACEBACK):
        ConsoleStream(out).write(over_budget + ended + "Sweep 'tiny-sweep' (1 trial(s) at a time):\n")
    assert out.getvalue() == "Sweep 'tiny-sweep' (1 trial(s) at a time):\n", out.getvalue()
    outside = io.StringIO()
    ConsoleStream(outside).write(over_budget)  # a training run's own failure stays on the console
    assert "MemoryBudgetExceeded" in outside.getvalue()
