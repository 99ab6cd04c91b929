"""The kit for GPU nodes without internet access (tools/): the pruned Ray wheel stays a wheel pip
installs offline, with its executables executable and a RECORD that matches every file; the GPU
check's figures keep save windows out of the steady rate and in the timed one; and `bench model
--grad-accum` runs that many micro-batches per optimizer step, as training does."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_ray_wheel(path: Path) -> None:
    """A wheel shaped like Ray's: pruned folders, an ELF binary to strip (a copy of `true`), code."""
    binary = Path(shutil.which("true")).read_bytes()
    files = {
        "ray/__init__.py": b"__version__ = '0.0.1'\n",
        "ray/jars/ray_dist.jar": b"x" * 1000,
        "ray/rllib/__init__.py": b"",
        "ray/dashboard/client/build/index.html": b"<html>",
        "ray/dashboard/head.py": b"# the dashboard's server stays\n",
        "ray/core/src/ray/raylet/raylet": binary,
    }
    record = "ray-0.0.1.dist-info/RECORD"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFREG | (0o755 if name.endswith("raylet") else 0o644)) << 16
            wheel.writestr(info, data)
        wheel.writestr("ray-0.0.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: ray\nVersion: 0.0.1\n")
        wheel.writestr("ray-0.0.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: py3-none-any\n")
        wheel.writestr(record, "")


@pytest.mark.skipif(shutil.which("strip") is None, reason="needs binutils' strip")
def test_the_pruned_ray_wheel_installs_offline_with_a_record_that_matches_and_its_binaries_executable(tmp_path):
    offline_wheels = _tool("offline_wheels")
    wheel = tmp_path / "ray-0.0.1-py3-none-any.whl"
    _fake_ray_wheel(wheel)
    offline_wheels.RAY_STRIPPED = ["ray/core/src/ray/raylet/raylet"]
    offline_wheels.prune_ray(wheel)

    with zipfile.ZipFile(wheel) as pruned:
        names = set(pruned.namelist())
        assert not any(n.startswith(("ray/jars/", "ray/rllib/", "ray/dashboard/client/build/")) for n in names)
        assert "ray/dashboard/head.py" in names
        rows = list(csv.reader(io.StringIO(pruned.read("ray-0.0.1.dist-info/RECORD").decode())))
        for name, digest, size in rows:
            if name.endswith("RECORD"):
                continue
            data = pruned.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={expected}" and int(size) == len(data), name
        assert {r[0] for r in rows} == names

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    raylet = target / "ray" / "core" / "src" / "ray" / "raylet" / "raylet"
    assert os.stat(raylet).st_mode & stat.S_IXUSR
    assert subprocess.run([str(raylet)]).returncode == 0  # `true`, stripped, still runs


def test_the_check_keeps_save_windows_out_of_the_steady_rate_and_in_the_timed_one():
    gpu_check = _tool("gpu_check")
    tokens = 5 * 1000  # log_every x tokens per step
    records = [{"step": 5, "throughput/tokens_per_sec": 500.0, "time/compile_s": 9.0}]  # the compile window
    records += [{"step": s, "throughput/tokens_per_sec": 1000.0} for s in (10, 15, 20)]
    records += [{"step": 25, "throughput/tokens_per_sec": 250.0, "checkpoint/blocked_s": 0.4}]
    figures = gpu_check.loop_figures(records, log_every=5, tokens_per_step=1000)
    assert figures["tokens_per_sec_steady_median"] == 1000.0
    assert figures["steady_windows"] == 3 and figures["timed_windows"] == 4
    assert figures["tokens_per_sec_timed"] < figures["tokens_per_sec_steady_median"]  # the save's window counts there
    assert figures["tokens_per_sec_timed"] * (3 * tokens / 1000.0 + tokens / 250.0) == pytest.approx(4 * tokens)
    assert figures["checkpoint_blocked_s"] == [0.4] and figures["compile_s"] == 9.0


def test_bench_model_grad_accum_runs_that_many_micro_batches_per_optimizer_step():
    from raytrain_fast.bench.model import ModelBenchSetup, _jobs, _resolve
    from raytrain_fast.bench.model_worker import _Variant

    setup = ModelBenchSetup(preset="tiny", seq_len=32, micro_batch=2, grad_accum=3, steps=1, rounds=1, precision="fp32", threads=1)
    config, precision, _, threads, seed = _resolve(setup)
    (job,) = _jobs(setup, ["bare"], config=config, precision=precision, threads=threads, seed=seed)
    variant = _Variant(job)
    forwards = []
    variant.model.register_forward_hook(lambda *_: forwards.append(1))
    variant.step()
    assert len(forwards) == 3
    (state,) = [s for s in variant.engine.optimizer.state.values()][:1]
    assert int(state["step"]) == 1  # one optimizer step for the three micro-batches
    assert variant.info()["grad_accum"] == 3
