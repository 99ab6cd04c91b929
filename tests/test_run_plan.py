"""The run is resolved once: every derived setting has one place in the package (a second one fails
here), the driver's plan is what every worker follows (a derivation changed on the driver alone is
what the workers do), and every run takes the one set of pre-run checks."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import raytrain_fast

pytestmark = pytest.mark.unit

PACKAGE = Path(raytrain_fast.__file__).parent

DERIVATIONS: dict[str, tuple[str, str]] = {
    # what is derived: (how its derivation reads in the code, the one file that may hold it)
    "the run's directory, <storage.uri>/<name>": (r"rstrip\(['\"]/['\"]\)\}/\{[\w.]*\bname\}", "launch/resume.py"),
    "the storage's filesystem, built from storage.*": (r"\bresolve_filesystem\((storage_path\()?[\w.]*storage\.uri", "launch/resume.py"),
    "the data's manifests, read": (r"\bload_manifest\(", "data/mixture.py"),
    "the data's sources (data.source as a mixture of one)": (r"\bdata_sources\(", "data/mixture.py"),
    "the evaluation's settings for the data": (r"\bresolve_eval\(", "launch/plan.py"),
    "the batch split of every worker count": (r"\bfit_batch\(", "plan.py"),
    "the resources and precision on the cluster": (r"\bresolve_precision_on_a_worker\(", "launch/plan.py"),
    "micro_batch=auto": (r"\bresolve_micro_batch\(", "launch/plan.py"),
    "the sources prepared": (r"\bprepare_sources\(", "launch/plan.py"),
    "the tasks encoded": (r"\bencode_run_tasks\(", "launch/plan.py"),
    "the micro-batch as a number": (r"\bint\([\w.]*micro_batch\)", ""),
}
"""Where a run's settings are derived. The files of a run's path from the command line to its steps
are searched; a second place for one of them fails the test (read it from the plan instead)."""
RUN_PATH = ("cli.py", "plan.py", "launch", "loop", "sweep", "data/ingest.py", "data/mixture.py", "data/validation.py",
            "engine/program.py")


def _code(path: Path) -> str:
    """The file without its docstrings, comments and the `def` lines of the functions that derive (a
    name mentioned there derives nothing)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body[0].value.value = ""
    return re.sub(r"\bdef (\w+)\(", r"def \1 (", ast.unparse(tree))


def _run_path_files() -> dict[str, str]:
    files = {}
    for item in RUN_PATH:
        for path in [PACKAGE / item] if item.endswith(".py") else sorted((PACKAGE / item).rglob("*.py")):
            files[str(path.relative_to(PACKAGE))] = _code(path)
    return files


def test_every_setting_of_a_run_is_derived_in_one_place():
    files = _run_path_files()
    assert len(files) > 20 and "launch/plan.py" in files  # the run's path was really read
    for what, (pattern, home) in DERIVATIONS.items():
        found = {name for name, code in files.items() if re.search(pattern, code)} - {home}
        defined_or_used_at_home = not home or re.search(pattern, files[home])
        assert not found, f"{what} is derived again in {sorted(found)}; read it from the run's plan (raytrain_fast/plan.py)"
        assert defined_or_used_at_home, f"{what}: no longer in {home}; update DERIVATIONS"
    # A worker reads the plan's config as it is: no config derived again in the loop.
    assert not [name for name, code in files.items() if name.startswith("loop/") and re.search(r"\breplace\(", code)]


def test_the_derivation_check_fails_on_a_second_place():
    planted = "def restore(config):\n    return f\"{config.storage.uri.rstrip('/')}/{config.name}\"\n"
    pattern, home = DERIVATIONS["the run's directory, <storage.uri>/<name>"]
    assert re.search(pattern, ast.unparse(ast.parse(planted))) and home != "loop/parts.py"


def _calls(path: str, function: str) -> set[str]:
    tree = ast.parse((PACKAGE / path).read_text())
    [node] = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function]
    return {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", "") for c in ast.walk(node) if isinstance(c, ast.Call)}


def test_pretrain_the_sweep_and_each_trial_take_the_one_set_of_checks():
    callers = {("launch/trainer.py", "run"), ("sweep/runner.py", "_prepare"), ("sweep/trial.py", "run_trial")}
    for path, function in callers:
        assert "check_run" in _calls(path, function), f"{path} {function} does not take launch.checks.check_run"
    # Nothing else on a run's path assembles checks of its own: validation runs in check_run (and against the
    # cluster's resources, in the plan), the data against the model in data/mixture.py's check_sources.
    for name, code in _run_path_files().items():
        if re.search(r"\bvalidate\(", code):
            assert name in ("launch/checks.py", "launch/plan.py", "cli.py"), name
        if re.search(r"\bcheck_sources\(", code):
            assert name in ("launch/checks.py", "launch/plan.py", "data/mixture.py"), name
    # The sinks and the stop watcher start where the loop's parts start, not inside the program's build.
    assert {"start_sinks", "watch_for_stop", "build_program"} <= _calls("loop/parts.py", "build") | _calls("loop/parts.py", "_build_program")
    assert not {"start_sinks", "watch_for_stop"} & _calls("engine/program.py", "build_program")


@pytest.mark.ray
@pytest.mark.slow
def test_a_derivation_changed_on_the_driver_is_what_every_worker_follows(ray_session, tmp_path, monkeypatch, capfd):
    """The evaluation's cadence, derived on the driver alone (its default changed in this process, not
    in the workers'): the workers evaluate on it, the start-up line says it, the saved config holds it."""
    import yaml

    import raytrain_fast.launch.plan as plan
    from raytrain_fast.config import load_config
    from raytrain_fast.launch.trainer import run
    from raytrain_fast.metrics.sinks import read_metrics

    monkeypatch.setattr(plan, "DEFAULT_EVERY_STEPS", 2)
    config = load_config("tiny", [
        "model.d_model=32", "model.num_heads=2", "model.num_layers=1", "model.max_seq_len=32", "data.seq_len=32",
        "data.max_tokens=20000", "train.micro_batch=4", "train.global_batch=4", "train.steps=6", "train.log_every=1",
        "checkpoint.every_steps=0", "eval.sequences=4", "optim.warmup_steps=1", "engine.precision=fp32",
        "metrics.peak_measure_s=0.2", "resources.num_workers=1", f"storage.uri={tmp_path / 'runs'}",
    ], name="cadence")
    result = run(config)
    evaluated = [r["step"] for r in read_metrics(result.run_dir) if "val/loss" in r]
    assert evaluated == [2, 4, 6], evaluated
    assert re.search(r"^Eval: 4 validation sequences \(\S+ 4\) every 2 steps", capfd.readouterr().out, flags=re.M)
    saved = yaml.safe_load((Path(result.checkpoint) / "config.yaml").read_text())
    assert saved["eval"]["every_steps"] == 2 and saved["train"]["grad_accum"] == 1
