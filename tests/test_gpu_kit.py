"""The kit for GPU nodes without internet access (tools/): the pruned Ray wheel stays a wheel pip
installs offline, with its executables executable and a RECORD that matches every file; the GPU
check's figures keep save windows out of the steady rate and in the timed one, and judge the first
save's window against the steady ones; its verdict reads every stage's figure; a stage that does not
fit the budget is skipped with the command that runs it alone; tools/train_speed.py (the check's
engine, 8B-width, FP8 and lever stages) times, profiles and compares runs on the same tokens from
the same weights, emulates FP8 and refuses it on a CPU in one line; and `bench model --grad-accum`
runs that many micro-batches per optimizer step, as training does."""

from __future__ import annotations

import base64
import csv
import gzip
import hashlib
import importlib.util
import io
import json
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
    assert figures["first_save_window"] == {"step": 25, "tokens_per_sec": 250.0, "over_steady": 0.25}


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


def test_the_verdict_reads_each_target_from_its_stage():
    gpu_check = _tool("gpu_check")
    same = {"data_digest": "ab12", "weights_sum": 3.5}
    summary = {"stages": {
        "pretrain": {"tokens_per_sec_timed": 49_000.0, "tokens_per_sec_steady_median": 52_000.0, "mfu_datasheet_median": 0.51,
                     "first_save_window": {"step": 25, "tokens_per_sec": 51_000.0, "over_steady": 51 / 52},
                     "checkpoint_blocked_s": [0.3, 0.03], "data_wait_frac_max": 0.002},
        "engine": {"tokens_per_sec": 52_000.0, "mfu": 0.5, "profile": {"sdpa_backend": "flash"}},
        "width_8b": {"tokens_per_sec": 30_000.0, "mfu": 0.54, "loss_last": 4.00, **same},
        "fp8_8b": {"tokens_per_sec": 39_000.0, "loss_last": 4.03, **same},
        "gpu_tests": {"rc": 0},
    }}
    verdict = gpu_check.verdict(summary)
    assert verdict["loop_over_engine_timed"] == pytest.approx(49 / 52) and not verdict["loop_over_engine_met"]
    assert verdict["first_save_window_met"] and verdict["mfu_1b_met"] and not verdict["mfu_8b_width_met"]
    assert verdict["fp8_over_bf16"] == pytest.approx(1.3) and verdict["fp8_over_bf16_met"]
    assert verdict["fp8_loss_rel"] == pytest.approx(0.0075) and verdict["fp8_loss_met"] and verdict["fp8_same_data_and_weights"]
    assert verdict["sdpa_backend"] == "flash" and verdict["gpu_tests_met"] and not verdict["drills_met"]
    summary["stages"]["fp8_8b"]["data_digest"] = "cd34"  # another corpus: its loss says nothing about float8
    assert not gpu_check.verdict(summary)["fp8_same_data_and_weights"]


def test_a_stage_that_does_not_fit_the_budget_is_skipped_with_the_command_that_runs_it_alone(tmp_path, monkeypatch):
    gpu_check = _tool("gpu_check")
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path / "work"))
    monkeypatch.setenv("GPU_CHECK_STARTED", str(__import__("time").time() - 500))  # 500 s of a 540 s budget gone
    check = gpu_check.Check(tmp_path, "gpu", budget_s=540)
    ran = []
    check.stage("preflight", lambda: ran.append("preflight") or {"rc": 0})  # 10 s expected: fits
    check.stage("drills", lambda: ran.append("drills") or {"rc": 0})  # 95 s expected: does not
    assert ran == ["preflight"]
    skipped = json.loads((tmp_path / "summary.json").read_text())["stages"]["drills"]["skipped"]
    assert "tools/gpu_check.sh OUTDIR --only drills" in skipped
    assert check.timeout("pretrain") < gpu_check.SIZES["gpu"]["timeouts"]["pretrain"]  # what is left, not its own limit


def test_where_the_time_goes_ranks_kernels_by_their_share_of_the_step_and_names_the_attention_kernel():
    train_speed = _tool("train_speed")
    events = [(f"triton_poi_fused_{i}", 0.001, 2) for i in range(20)]
    events += [("sm90_xmma_gemm_bf16bf16_bf16f32", 0.5, 300), ("pytorch_flash::flash_fwd_kernel<...>", 0.2, 32),
               ("void multi_tensor_apply_kernel<adam>", 0.05, 1)]
    found = train_speed.where_time_goes(events, wall_s=1.0, steps=2)
    assert len(found["top"]) == train_speed.TOP and found["top"][0]["name"].startswith("sm90_xmma_gemm")
    assert found["top"][0]["share"] == 0.5 and found["top"][0]["ms_per_step"] == 250.0 and found["top"][0]["calls_per_step"] == 150
    assert found["kinds"] == pytest.approx({"matmul": 0.5, "attention": 0.2, "optimizer": 0.05, "compiled elementwise (triton)": 0.02})
    assert found["busy_share"] == pytest.approx(0.77)
    assert train_speed.sdpa_backend(["aten::mm", "aten::_scaled_dot_product_cudnn_attention"]) == "cudnn"
    assert train_speed.sdpa_backend(["aten::_scaled_dot_product_flash_attention_for_cpu"]) == "flash (CPU)"
    assert train_speed.sdpa_backend(["aten::mm"]) is None


def _train_speed(tmp_path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / f"{name}.json"
    argv = [sys.executable, str(ROOT / "tools" / "train_speed.py"), "--config", "llama-tiny", "--seq-len", "64",
            "--micro-batch", "2", "--grad-accum", "2", "--steps", "3", "--warmup", "1", "--data-cache", str(tmp_path / "prepared"),
            "--threads", "1", "--out", str(out), "--set", "engine.precision=fp32", "--set", "model.d_model=64",
            "--set", "model.num_layers=2", "--set", "model.mlp_hidden=1024", *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return done, json.loads(out.read_text()) if out.exists() else {}


@pytest.mark.ray
def test_train_speed_times_profiles_and_compares_float8_on_the_same_tokens_and_refuses_it_on_a_cpu(tmp_path):
    """The check's engine, width and FP8 stages in small: a bf16-less CPU run with a profile and the
    attention backends, the same with float8 emulated (the same data and initial weights, a loss
    that follows), and engine.precision=fp8, which a CPU refuses in one line."""
    done, plain = _train_speed(tmp_path, "plain", "--profile-steps", "1", "--trace", str(tmp_path / "trace.json.gz"), "--attention")
    assert done.returncode == 0, done.stderr[-3000:]
    assert plain["timed_steps"] == 2 and plain["tokens_per_sec"] > 0 and len(plain["losses"]) == 3 + 1  # + the profiled step
    profile = plain["profile"]
    assert profile["sdpa_backend"] == "flash (CPU)" and 0 < len(profile["top"]) <= 15
    assert all(0 < row["share"] <= 1 for row in profile["top"]) and profile["kinds"]["matmul"] > 0
    assert json.loads(gzip.open(profile["trace"]).read())["traceEvents"]  # a Chrome trace
    assert plain["attention"]["default"] == "flash (CPU)" and isinstance(plain["attention"]["ms"]["flash"], float)

    done, fp8 = _train_speed(tmp_path, "fp8", "--fp8-emulate")
    assert done.returncode == 0, done.stderr[-3000:]
    assert fp8["precision"] == "fp8 (emulated)" and "FP8 (emulated): 2 linear layers converted" in fp8["lines"]  # gate_up of each block
    assert (fp8["data_digest"], fp8["weights_sum"]) == (plain["data_digest"], plain["weights_sum"])
    assert fp8["losses"][:3] == pytest.approx(plain["losses"][:3], rel=0.02) and fp8["losses"][:3] != plain["losses"][:3]

    done, refused = _train_speed(tmp_path, "refused", "--set", "engine.precision=fp8")
    assert done.returncode == 2 and refused["refused"].startswith("Invalid configuration: engine.precision=fp8 needs a GPU")
    assert done.stderr.strip().splitlines()[-1] == f"error: {refused['refused']}"


def test_a_rerun_of_one_stage_into_the_same_outdir_keeps_the_earlier_stages_and_log(tmp_path, monkeypatch):
    gpu_check = _tool("gpu_check")
    monkeypatch.setenv("GPU_CHECK_WORK", str(tmp_path / "work"))
    (tmp_path / "work").mkdir()
    first = gpu_check.Check(tmp_path, "cpu", budget_s=0)
    first.stage("preflight", lambda: first.run("preflight", [sys.executable, "-c", "print('first run')"], timeout=60))
    again = gpu_check.Check(tmp_path, "cpu", budget_s=0)
    again.stage("engine", lambda: again.run("engine", [sys.executable, "-c", "print('second run')"], timeout=60))
    stages = json.loads((tmp_path / "summary.json").read_text())["stages"]
    assert set(stages) == {"preflight", "engine"} and stages["preflight"]["rc"] == 0
    log = (tmp_path / "check.log").read_text()
    assert "first run" in log and "second run" in log


def test_unreadable_metrics_show_as_an_error_in_the_stages_result():
    gpu_check = _tool("gpu_check")
    result: dict = {"rc": 0}
    assert gpu_check._read_metrics("bogus://bucket/run", result) == []
    assert "bogus://bucket/run" in result["metrics_error"] and "not supported" in result["metrics_error"]
