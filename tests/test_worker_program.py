"""One worker program (engine/program.py) and one training step (engine/step.py): the step loop,
`train.micro_batch: auto`'s probe and the benches build the model, its compiled blocks and the engine
through `build_program` and step it with `train_step`, and the probe's blocks are compiled exactly
when the run's config compiles them."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raytrain_fast.config import load_config

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[1] / "raytrain_fast"
BUILDERS = {  # who builds a worker's program, and the function (None: anywhere in the file) that does it
    "loop/parts.py": None,
    "microbatch/auto.py": "probe_micro_batch",
    "bench/model_worker.py": None,
    "bench/bare_loops.py": "bare_deepspeed",
    "bench/checkpoint.py": None,
}
STEPPERS = ["loop/steps.py", "microbatch/auto.py", "bench/model_worker.py", "bench/bare_loops.py", "bench/checkpoint.py",
            "bench/health.py", "bench/data.py"]
"""Every user of a training step: each steps through engine/step.py's `train_step`."""
HAND_WRITTEN_STEPS = {
    ("bench/overhead.py", "step"): "the typical hand-written Ray Train loop, the baseline the package's loop is compared against",
}
"""Functions outside engine/step.py allowed to back-propagate and step an optimizer themselves, each with the reason."""
# What only engine/program.py may call for them: a second, hand-made copy of the setup drifts.
BY_HAND = {"build_model", "build_engine", "compile_blocks", "enable_tf32", "select_accelerator", "training_device"}


def _called_names(tree: ast.AST) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            names.add(func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", ""))
    return names


def _scope(path: str, function: str | None) -> ast.AST:
    tree = ast.parse((PACKAGE / path).read_text())
    if function is None:
        return tree
    found = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name == function]
    assert found, f"{path} has no {function}"
    return found[0]


@pytest.mark.parametrize("path", sorted(BUILDERS))
def test_each_builder_builds_through_build_program_and_nothing_by_hand(path):
    called = _called_names(_scope(path, BUILDERS[path]))
    assert "build_program" in called, f"{path} does not build its worker through engine/program.py's build_program"
    assert not called & BY_HAND, f"{path} builds part of the worker by hand: {sorted(called & BY_HAND)}"
    for other in sorted((PACKAGE / "loop").glob("*.py")) + sorted((PACKAGE / "microbatch").glob("*.py")):
        by_hand = _called_names(ast.parse(other.read_text())) & BY_HAND
        assert not by_hand, f"{other.relative_to(PACKAGE)} calls {sorted(by_hand)}: build through build_program"


@pytest.mark.parametrize("path", STEPPERS)
def test_each_user_of_a_training_step_calls_the_one_step_function(path):
    assert "train_step" in _called_names(_scope(path, None)), f"{path} does not step through engine/step.py's train_step"


def hand_written_steps(tree: ast.AST) -> list[str]:
    """Functions that back-propagate (`x.backward(...)`) and step (`y.step()`) in their own body: a
    training step written again."""
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nested = {id(n) for inner in ast.walk(function) if inner is not function
                  and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) for n in ast.walk(inner)}
        called = {n.func.attr for n in ast.walk(function) if id(n) not in nested
                  and isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
        if {"backward", "step"} <= called:
            found.append(function.name)
    return found


def test_no_training_step_is_written_twice():
    """A second copy of the step drifts from the one that trains (the probe would time another step)."""
    second = [
        f"{path.relative_to(PACKAGE)}: {name}" for path in sorted(PACKAGE.rglob("*.py")) if path.name != "step.py"
        for name in hand_written_steps(ast.parse(path.read_text()))
        if (str(path.relative_to(PACKAGE)), name) not in HAND_WRITTEN_STEPS
    ]
    assert not second, f"training steps outside engine/step.py's train_step: {second}"
    assert hand_written_steps(ast.parse((PACKAGE / "bench" / "overhead.py").read_text())) == ["step"]  # the check sees one


def test_the_step_check_fails_on_a_planted_second_step():
    planted = """
def timed(engine, model, optimizer, batches):
    for tokens in batches:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()

def fine(engine, batches):
    return [engine.step() for _ in batches]
"""
    assert hand_written_steps(ast.parse(planted)) == ["timed"]


_PROBE = """
import json, sys
from raytrain_fast.microbatch.auto import probe_micro_batch
probe = probe_micro_batch(json.loads(sys.argv[1]), micro_batch=1, grad_accum=1, budget_gb=None, timed_steps=1)
print("PROBE " + json.dumps({"status": probe.status, "compiled": probe.compiled, "reason": probe.reason}))
"""


def _probe(tmp_path: Path, compile_setting: str) -> dict:
    config = load_config("tiny", [
        "model.vocab_size=256", "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
        "data.seq_len=32", "train.global_batch=1", "train.micro_batch=1", "engine.precision=fp32",
        "resources.use_gpu=false", "resources.cpus_per_worker=1", f"engine.compile={compile_setting}",
        f"storage.uri={tmp_path / 'runs'}",
    ], name="probe")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(config.to_dict())], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


@pytest.mark.ray
def test_the_probe_compiles_its_blocks_exactly_when_the_run_does(tmp_path):
    """A probe in a fresh process (as micro_batch=auto runs it, without Ray's task around it)."""
    compiled = _probe(tmp_path, "on")
    assert compiled["status"] == "ok", compiled
    assert compiled["compiled"] is True, compiled
    eager = _probe(tmp_path, "off")
    assert eager["status"] == "ok" and eager["compiled"] is False, eager
