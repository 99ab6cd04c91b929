"""What a user types, from a fresh shell, and the next-step commands the tools print, run as printed:
a finite blow-up named by the loop and the report with its best checkpoint kept (and the report's
export command for it run); a sweep's best config trained in a directory that already holds the
quickstart's run, its expected trial outcomes one line each; train-tokenizer -> prepare-data ->
pretrain as each prints the next; the help, typo and drill messages. Each command is typed into
`bash -c` with a clean environment (tests/shell.py's). The commands of the tests that train join one
head node started from such a shell for this file (`RAY_ADDRESS`, as on a cluster), so Ray starts
once, not once per command; the S3 test's run starts a local instance of its own, as every training
command of tests/test_fresh_shell.py does."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.shell import SETS, RayHead, fresh_env, package_texts

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

NOISE = ("Traceback", "Exception ignored", "SystemExit", "ActorDiedError", "The actor died", "unexpected")
"""What an expected outcome (a trial over budget, stopped early, a divergence) must not print."""


class Shell:
    """A fresh bash per command: the venv's bin on PATH, a HOME, nothing of pytest's environment."""

    def __init__(self, cwd: Path, *, head: RayHead | None = None) -> None:
        self.cwd = cwd
        self.env = fresh_env(cwd / "home")
        if "PYTHONPATH" in os.environ:  # another source tree under test (the same tests run against it)
            self.env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        if head is not None:  # the shell has RAY_ADDRESS exported: its commands join that head node
            self.env.update(head.env)

    def __call__(self, line: str, *, ok: bool = True, timeout: int = 900) -> str:
        done = subprocess.run(["bash", "--noprofile", "--norc", "-c", line], cwd=self.cwd, env=self.env, text=True,
                              capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL)
        shown = done.stdout + done.stderr
        assert (done.returncode == 0) == ok, f"$ {line}\nexit {done.returncode}\n{shown[-4000:]}"
        return shown


def printed(text: str, label: str) -> str:
    """The command after `label` on its line (in backticks when the line sets it as code)."""
    match = re.search(rf"{re.escape(label)}\s*`?(raytrain-fast [^`\n]+)`?", text)
    assert match, f"no '{label}' command in:\n{text[-3000:]}"
    return match.group(1).strip()


def test_a_finite_blowup_is_warned_reported_and_its_best_checkpoint_kept(tmp_path, ray_head):
    shell = Shell(tmp_path, head=ray_head)
    # A learning rate far too high for its warm-up, held: the loss climbs and stays finite.
    run = shell(
        "set -o pipefail; raytrain-fast pretrain --name blowup --set optim.lr=1.0 --set optim.warmup_steps=20 "
        "--set optim.schedule=constant --set train.steps=60 --set train.log_every=5 --set checkpoint.every_steps=5 "
        "--set checkpoint.keep_last=1 --set eval.sequences=16 --set metrics.peak_measure_s=0.2 2>&1 | tee run.log"
    )
    warnings = [line for line in run.splitlines() if "a finite divergence: loss" in line]
    assert len(warnings) == 1 and "health.on_divergence: warn" in warnings[0], run[-3000:]
    assert not any(noise in run for noise in NOISE), run[-3000:]
    # Retention kept the newest checkpoint and the one with the lowest val/loss, from before the climb.
    kept = sorted(int(p.name.rsplit("_", 1)[1]) for p in (tmp_path / "runs" / "blowup").glob("checkpoint_0*"))
    assert len(kept) == 2 and kept[-1] == 60, kept

    report = shell("raytrain-fast report --storage runs --name blowup")
    assert "Training diverged without a NaN at step" in report and f"the one with the lowest loss is step {kept[0]}" in report
    export = printed(report, "use the checkpoint from before it:")
    assert f"--step {kept[0]}" in export
    shell(export)
    assert (tmp_path / f"blowup-step{kept[0]}" / "model.safetensors").is_file()
    html = (tmp_path / "blowup-report" / "report.html").read_text()
    assert "<code>raytrain-fast export" in html and "`" not in re.sub(r"<[^>]+>", "", html)  # no raw backticks shown


SWEEP_MODEL = [  # activations dominate memory (long sequences, a large vocabulary): micro-batch 8 goes over 0.9 GB
    "model.vocab_size=4096", "model.d_model=64", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=1024",
    "data.seq_len=1024", "data.max_tokens=200000", "train.global_batch=8", "train.micro_batch=4", "train.steps=4", "train.log_every=2",
    "optim.warmup_steps=1", "checkpoint.every_steps=2", "metrics.peak_measure_s=0.2", "eval.sequences=4",
]


def test_a_sweep_writes_its_table_and_files_and_its_best_config_trains_where_the_quickstart_ran(tmp_path, ray_head):
    """A CPU sweep over micro-batches 1, 2, 3 and 8 at a global batch of 8 under a 0.9 GB budget per
    worker (a worker peaks at about 0.7 GB with 1 or 2 sequences of 1024 tokens, 1.1 GB with 8): 3 is
    skipped, 8 fails over the budget in one line, 1 and 2 train; the table, results.csv and
    results.json agree; the printed command trains best.yaml (the winning split of the same global
    batch) under a run name of its own, beside the quickstart's run 'tiny'."""
    import csv
    import json

    from raytrain_fast.config import load_config

    shell = Shell(tmp_path, head=ray_head)
    sets = " ".join(f"--set {item}" for item in SWEEP_MODEL)
    # Run 'tiny', as the quickstart names it: a micro model in bf16, which the best config could not resume.
    shell(f"raytrain-fast pretrain {SETS} --set engine.precision=bf16")
    budget = 0.9
    sweep = shell(f"set -o pipefail; raytrain-fast sweep {sets} --set engine.precision=fp32 "
                  f"--set resources.memory_budget_gb={budget} --micro-batch 1,2,3,8 --steps 6 2>&1 | tee sweep.log")
    # Nor Tune's banner, results path, TensorBoard hint or the failed trial's traceback.
    quiet = (*NOISE, "Configuration for experiment", "tensorboard --logdir", "Trial task failed")
    assert not any(noise in sweep for noise in quiet), sweep[-4000:]
    failed = [line for line in sweep.splitlines() if "failed: over memory budget" in line]
    assert len(failed) == 1 and failed[0].split()[0] == "8", sweep[-4000:]
    assert "tokens/s: the median of a trial's log windows" in sweep and "load/CPU: the machine's 1-minute load" in sweep
    lines = sweep.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["micro-batch"])
    assert [line.split()[0] for line in lines[header + 1:header + 5]] == ["1", "2", "3", "8"], sweep[-4000:]

    sweep_dir = tmp_path / "runs" / "tiny-sweep"
    summary = json.loads((sweep_dir / "results.json").read_text())
    rows = {row["micro_batch"]: row for row in summary["trials"]}
    assert sorted(rows) == [1, 2, 3, 8], summary
    assert rows[3]["status"] == "skipped" and "not a multiple of 3" in rows[3]["reason"], rows[3]
    assert rows[8]["status"] == "failed" and rows[8]["reason"].startswith("over memory budget"), rows[8]
    ran = [rows[1], rows[2]]
    assert all(r["status"] in ("ok", "stopped") for r in ran), ran
    assert all(r["peak_gb"] is not None and r["peak_gb"] <= budget for r in ran), ran
    assert all(r["peak_frac"] == pytest.approx(r["peak_gb"] / budget) for r in ran), ran  # memory/peak_frac, against the budget
    best_row = rows[summary["best_micro_batch"]]
    assert best_row["status"] == "ok"
    assert best_row["tokens_per_sec"] == max(r["tokens_per_sec"] for r in ran if r["status"] == "ok")
    assert summary["max_concurrent_trials"] == 1  # one trial's worker takes both CPUs
    with open(sweep_dir / "results.csv") as f:
        assert {int(r["micro_batch"]): r["status"] for r in csv.DictReader(f)} == {m: r["status"] for m, r in rows.items()}
    best_config = load_config(str(sweep_dir / "best.yaml"))
    micro = best_row["micro_batch"]
    assert (best_config.train.micro_batch, best_config.train.grad_accum, best_config.train.global_batch) == (micro, 8 // micro, 8)

    train = printed(sweep, "Train with:")
    trained = shell(train)
    assert "Done." in trained and (tmp_path / "runs" / "tiny").is_dir()
    best = re.search(r"run '(tiny-mb\d+)'", (sweep_dir / "best.yaml").read_text()).group(1)
    checkpoints = sorted((tmp_path / "runs" / best).glob("checkpoint_0*"))
    assert checkpoints
    state = json.loads((checkpoints[-1] / "train_state.json").read_text())
    assert state["global_batch"] == 8 and state["tokens"] == state["step"] * 8 * 1024, state  # the same global batch


def _mixed_inputs(directory: Path) -> None:
    """Text files, a Parquet file whose text is in `content`, and a JSONL file whose text is in `text`."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    package_texts(directory / "texts", "email", "json")
    documents = [p.read_text() for p in sorted((directory / "texts").iterdir())]
    pq.write_table(pa.table({"id": list(range(10)), "content": documents[:10]}), directory / "posts.parquet")
    (directory / "notes.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents[10:20]))


def test_train_tokenizer_then_prepare_data_then_pretrain_run_as_printed(tmp_path, ray_head):
    pytest.importorskip("tokenizers")
    shell = Shell(tmp_path, head=ray_head)
    _mixed_inputs(tmp_path)
    trained = shell("raytrain-fast train-tokenizer --input texts posts.parquet notes.jsonl --output 'my tok' --vocab-size 400 "
                    "--text-field content,text")
    assert len(re.findall(r"train-tokenizer: (\d+)/\1 files", trained)) == 1, trained  # the progress once
    assert "model.vocab_size=448" in trained
    prepare = printed(trained, "Prepare data with it:")
    assert "--seq-len 128" in prepare and "--text-field content,text" in prepare and "'my tok-data'" in prepare
    prepared = shell(prepare)
    assert "execution finished" not in prepared
    one_file = shell("raytrain-fast prepare-data --input notes.jsonl --output notes-data --seq-len 64 --tokenizer 'my tok'")
    assert "override_num_blocks" not in one_file and "execution finished" not in one_file  # fewer files than CPUs
    train = printed(prepared, "Train on it:")
    assert "model.vocab_size=448" in train
    run = shell(f"{train} --set train.steps=4 --set train.log_every=2 --set optim.warmup_steps=1 --set checkpoint.every_steps=2")
    assert "Done." in run

    # pretrain on a source prepared on the fly: the hint names pretrain's own setting.
    wrong = shell("raytrain-fast pretrain --name posts --set data.source=posts.parquet", ok=False)
    assert "Set data.text_field to the column" in wrong and "--text-field" not in wrong
    shell("raytrain-fast show-config --set data.source=posts.parquet --set data.text_field=content,text")


def test_an_empty_corpus_fails_before_ray_and_a_six_sequence_corpus_trains_as_printed(tmp_path, ray_head):
    shell = Shell(tmp_path, head=ray_head)
    (tmp_path / "empty.txt").write_text("")
    for line in ("raytrain-fast pretrain --name empty --set data.source=empty.txt",
                 "raytrain-fast pretrain --name empty --set 'data.sources=[{source: empty.txt, weight: 1}]'"):
        failed = shell(line, ok=False)
        assert f"'{tmp_path / 'empty.txt'}' is empty (no file with any text): add text to it" in failed, failed
        assert "Precision:" not in failed  # refused before Ray started (it prints the precision first)
    (tmp_path / "short.txt").write_text("too short")
    for name in ("empty", "short"):
        refused = shell(f"raytrain-fast prepare-data --input {name}.txt --output {name}-data --seq-len 128", ok=False)
        assert "the inputs hold no text" in refused or "fewer than one sequence" in refused, refused
        assert not (tmp_path / f"{name}-data").exists()  # no empty val/ (or anything) left behind
    (tmp_path / "six.txt").write_text("x = 1  # a line of code\n" * 35)  # 840 bytes: 6 sequences of 129 tokens
    prepared = shell("raytrain-fast prepare-data --input six.txt --output six-data --seq-len 128")
    assert "Prepared 6 sequences" in prepared, prepared
    train = printed(prepared, "Train on it:")  # fewer sequences than the preset's micro-batch of 16
    run = shell(f"{train} --set train.steps=4 --set train.log_every=2 --set checkpoint.every_steps=2 --set optim.warmup_steps=1 "
                "--set metrics.peak_measure_s=0.2")
    assert "Done." in run, run[-3000:]


def test_a_rollback_with_no_checkpoint_and_its_report_name_the_settings_that_acted(tmp_path, ray_head):
    shell = Shell(tmp_path, head=ray_head)
    package_texts(tmp_path / "texts", "email", "json")
    stopped = shell(f"raytrain-fast pretrain --name early {SETS} --set data.source=texts --set checkpoint.every_steps=100 "
                    "--drill nonfinite=2:0:grad", ok=False)
    assert "Tried: no rollback: no checkpoint was saved before it" in stopped and "max_rollbacks=0" not in stopped
    report = shell("raytrain-fast report --storage runs --name early")
    assert "health.on_nonfinite: rollback, no checkpoint to roll back to" in report and "?" not in report.split("Diagnosis")[1]


def test_an_s3_mixture_says_which_sources_its_val_loss_covers_and_names_its_checkpoints_with_the_scheme(tmp_path, s3_server):
    """One run on S3 storage from two local prepared sources, one without a validation split: the run
    and its report say which sources val/loss covers; the run's last lines and its export name the
    checkpoint with its s3:// scheme."""
    import yaml

    shell = Shell(tmp_path)
    shell.env.update(s3_server.env)
    bucket = s3_server.make_bucket("printed-commands")
    storage = f"--storage s3://{bucket}/runs --endpoint-url {s3_server.endpoint_url}"
    package_texts(tmp_path / "texts", "email", "json")
    (tmp_path / "one.txt").write_text("A single long document, with no held-out part. " * 800)
    shell("raytrain-fast prepare-data --input texts --output code --seq-len 32 --val-fraction 0.2")
    shell("raytrain-fast prepare-data --input one.txt --output notes --seq-len 32")  # one document: no split
    sources = f"[{{source: {tmp_path / 'code'}, weight: 0.5}}, {{source: {tmp_path / 'notes'}, weight: 0.5}}]"
    run = shell(f"raytrain-fast pretrain --name mix {SETS} --set storage.uri=s3://{bucket}/runs "
                f"--set storage.endpoint_url={s3_server.endpoint_url} --set 'data.sources={sources}'")
    assert "Eval: val/loss covers code only" in run and "notes has no validation split" in run, run[-3000:]
    assert f"Latest checkpoint: s3://{bucket}/runs/mix/checkpoint_" in run, run[-2000:]
    report = shell(f"raytrain-fast report {storage} --name mix")
    assert "val/loss covers code only: notes had no validation split" in report, report[-3000:]
    shell(f"raytrain-fast export {storage} --name mix --out exported")
    exported = yaml.safe_load((tmp_path / "exported" / "config.yaml").read_text())["export"]
    assert exported["checkpoint"].startswith(f"s3://{bucket}/runs/mix/checkpoint_"), exported


def test_help_typos_and_drills_point_somewhere(tmp_path):
    from raytrain_fast.drills.specs import PARSERS

    shell = Shell(tmp_path)
    top = shell("raytrain-fast --help")
    assert "decoder-only" in top and "Llama" in top and "GPT pretraining" not in top
    pretrain = shell("raytrain-fast pretrain --help")
    assert "data.source=" in pretrain and "show-config --reference" in pretrain
    listed = " ".join(pretrain.split("(names:", 1)[1].split(";", 1)[0].split())
    assert [name for name in PARSERS if name not in listed] == []  # every drill --drill takes
    typo = shell("raytrain-fast show-config --set train.step=5", ok=False)
    assert "did you mean 'train.steps'?" in typo
    elsewhere = shell("raytrain-fast show-config --set train.lr=0.1", ok=False)
    assert "did you mean 'optim.lr'?" in elsewhere


def test_bench_model_takes_its_variant_processes_with_it_on_sigterm(tmp_path):
    import signal
    import time

    psutil = pytest.importorskip("psutil")
    shell = Shell(tmp_path)
    process = subprocess.Popen(
        ["bash", "--noprofile", "--norc", "-c", "exec raytrain-fast bench model --preset tiny --seq-len 32 --micro-batch 2 "
         "--steps 400 --rounds 4 --warmup-steps 1 --variants bare,engine --peak-seconds 0.2"],
        cwd=tmp_path, env=shell.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 300
        children: list = []
        while time.monotonic() < deadline and len(children) < 3:  # multiprocessing's resource tracker and 2 variants
            time.sleep(1)
            children = psutil.Process(process.pid).children(recursive=True)
        assert len(children) >= 3, "the variant processes never started"
        os.kill(process.pid, signal.SIGTERM)
        code = process.wait(timeout=60)
        gone, alive = psutil.wait_procs(children, timeout=20)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        for left in alive:  # this test's own processes, by id
            left.kill()
        assert not alive, f"{len(alive)} of the bench's processes outlived it"
        assert code == 128 + signal.SIGTERM  # the shell's convention for "ended by SIGTERM"
    finally:
        if process.poll() is None:
            process.kill()
        shutil.rmtree(tmp_path / "home", ignore_errors=True)
