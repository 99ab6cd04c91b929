#!/usr/bin/env python3
"""The GPU check: the main path and the speed figures on one GPU node, in one command, most important first.

    tools/gpu_check.sh OUTDIR        (installs .wheelhouse, then runs this)
    python3 tools/gpu_check.py OUTDIR [--size gpu|cpu] [--only STAGE,...] [--budget-s S]

Stages, each in its own process(es) with its own time limit, each result written to OUTDIR/summary.json
as soon as it is known (a stage that fails or runs out of time does not stop the next):
1. `preflight`: the GPU, torch, torchao, Ray, DeepSpeed and the free disk;
2. `pretrain`: `raytrain-fast pretrain` through Ray Train: llama-1b, bf16, ZeRO-2, compiled blocks,
   seq 2048 x micro-batch 4 x 8, checkpoints inside the timed steps; tokens/s over every timed step
   and in the windows without a save, the first save's window against those, MFU, data wait;
3. `engine`: the same program without the loop (tools/train_speed.py): the denominator of the loop's
   ratio, a profile of a steady step (OUTDIR/profile_trace.json.gz, the top kernels and each kind's
   share of the step in the JSON), which SDPA kernel runs and each backend's time at this shape;
4. `width_8b`: the llama-8b preset with 8 layers (the 8B width on one GPU), bf16, compiled blocks;
5. `fp8_8b`: the same in engine.precision=fp8, on the same data from the same weights: tokens/s and
   the loss after the same steps against `width_8b`'s;
6. `gpu_tests`: the suite's `gpu`-marked tests (FP8's among them);
7. `levers`: llama-1b variants the profile judges, each against `engine`: micro-batch 8, cuDNN
   attention, the whole model compiled instead of each block;
8. `drills`: a planted non-finite step and a planted hang through the loop, each named and recovered.

A stage starts only if its expected time fits in what is left of `--budget-s` (9 minutes on a GPU: a
lent machine's call lasts 10); one that does not is marked skipped, and `--only` runs it later.
OUTDIR holds summary.json, check.log (every stage's output, in order, appended to by a rerun; a rerun's stages join summary.json's), pretrain_metrics.jsonl and
profile_trace.json.gz. `--size cpu` runs every stage at CPU sizes (llama-tiny, fp32; the 8B width
shrunk, FP8 emulated and refused): tools/rehearse_gpu_kit.sh uses it to check this script and the
wheelhouse here before a GPU node ever sees them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

TARGETS = {
    "loop_over_engine": 0.97,  # the full loop's tokens/s over every timed step, saves included, over the compiled engine's
    "first_save_window": 0.97,  # the window holding the run's first save, over the median of the windows without one
    "mfu_1b": 0.50,  # llama-1b at seq 2048, against the datasheet's dense bf16 peak
    "mfu_8b_width": 0.55,  # the llama-8b width (8 layers), the same way
    "fp8_over_bf16": 1.25,  # tokens/s at the 8B width
    "fp8_loss_rel": 0.01,  # the loss after the same steps on the same data, relative to bf16's
    "checkpoint_blocked_s": 1.0,  # per save
    "data_wait_frac": 0.01,
}

_1B = {"config": "llama-1b", "seq_len": 2048, "micro_batch": 4, "grad_accum": 8}
_8B_WIDTH = {"config": "llama-8b", "seq_len": 4096, "micro_batch": 1, "grad_accum": 4, "steps": 24, "warmup": 4,
             "set": ["model.num_layers=8", "model.activation_checkpointing=none", "optim.warmup_steps=5"]}
SIZES: dict[str, dict[str, Any]] = {
    "gpu": {
        "preset": "llama-1b", "seq_len": 2048, "micro_batch": 4, "grad_accum": 8, "steps": 45, "checkpoint_every": 20,
        "log_every": 5, "compile": "on", "precision": "bf16", "use_gpu": "true", "cpus_per_worker": 8,
        "drill_preset": "llama-tiny", "drill_seq": 128, "threads": 8,
        "engine": {**_1B, "steps": 7, "warmup": 2, "profile_steps": 1, "set": []},
        "width_8b": _8B_WIDTH,
        "fp8_8b": {**_8B_WIDTH, "set": [*_8B_WIDTH["set"], "engine.precision=fp8"]},
        "levers": {
            "micro_batch_8": {**_1B, "micro_batch": 8, "grad_accum": 4, "steps": 6, "warmup": 2, "set": []},
            "sdpa_cudnn": {**_1B, "steps": 6, "warmup": 2, "set": [], "args": ["--sdpa", "cudnn"]},
            "model_compile": {**_1B, "steps": 6, "warmup": 2, "set": [], "args": ["--compile-scope", "model"]},
        },
        "disk_gb": 45,  # two ZeRO-2 checkpoints of llama-1b (about 17 GB each) and the prepared corpus
        "budget_s": 540,
        # Seconds each stage is expected to take on one H100 or H200 (from the last runs' stages where they
        # existed, else estimated), and the most each may take.
        "expected": {"preflight": 10, "pretrain": 190, "engine": 55, "width_8b": 60, "fp8_8b": 70, "gpu_tests": 90,
                     "levers": 35, "drills": 95},  # levers: per variant
        "timeouts": {"preflight": 60, "pretrain": 300, "engine": 150, "width_8b": 180, "fp8_8b": 200, "gpu_tests": 200,
                     "levers": 120, "drills": 150},
    },
    "cpu": {
        "preset": "llama-tiny", "seq_len": 128, "micro_batch": 8, "grad_accum": 2, "steps": 20, "checkpoint_every": 10,
        "log_every": 5, "compile": "off", "precision": "fp32", "use_gpu": "false", "cpus_per_worker": 1,
        "drill_preset": "llama-tiny", "drill_seq": 64, "threads": 0,
        "engine": {"config": "llama-tiny", "seq_len": 128, "micro_batch": 8, "grad_accum": 2, "steps": 4, "warmup": 1,
                   "profile_steps": 1, "set": ["engine.precision=fp32"]},
        "width_8b": {"config": "llama-8b", "seq_len": 128, "micro_batch": 2, "grad_accum": 2, "steps": 8, "warmup": 2,
                     "set": ["model.num_layers=2", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=2",
                             "model.mlp_hidden=2048", "model.vocab_size=512", "model.activation_checkpointing=none",
                             "optim.warmup_steps=2", "engine.precision=fp32"]},
        "levers": {
            "micro_batch_16": {"config": "llama-tiny", "seq_len": 128, "micro_batch": 16, "grad_accum": 1, "steps": 3,
                               "warmup": 1, "set": ["engine.precision=fp32"]},
            "sdpa_math": {"config": "llama-tiny", "seq_len": 128, "micro_batch": 8, "grad_accum": 2, "steps": 3,
                          "warmup": 1, "set": ["engine.precision=fp32"], "args": ["--sdpa", "math"]},
            "model_compile": {"config": "llama-tiny", "seq_len": 128, "micro_batch": 8, "grad_accum": 2, "steps": 3,
                              "warmup": 1, "set": ["engine.precision=fp32"], "args": ["--compile-scope", "model"]},
        },
        "disk_gb": 1,
        "budget_s": 0,  # no budget: the rehearsal runs every stage
        "expected": {},
        "timeouts": {"preflight": 120, "pretrain": 600, "engine": 600, "width_8b": 600, "fp8_8b": 900, "gpu_tests": 300,
                     "levers": 900, "drills": 900},
    },
}
# The CPU's FP8 stage: the 8B-width rehearsal with float8 emulated (a CPU has no FP8 tensor cores, and refuses fp8).
SIZES["cpu"]["fp8_8b"] = {**SIZES["cpu"]["width_8b"], "args": ["--fp8-emulate"]}
STAGES = ("preflight", "pretrain", "engine", "width_8b", "fp8_8b", "gpu_tests", "levers", "drills")
LOG = "check.log"


class Check:
    def __init__(self, out: Path, size: str, *, budget_s: float) -> None:
        self.out, self.size, self.s = out, size, SIZES[size]
        self.work = Path(os.environ.get("GPU_CHECK_WORK") or _work_root(self.s["disk_gb"]))
        self.summary: dict[str, Any] = {"size": size, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "targets": TARGETS,
                                        "budget_s": budget_s or None, "stages": {}}
        earlier = out / "summary.json"
        if earlier.exists():  # a rerun with --only into the same OUTDIR: its stages join the earlier ones
            self.summary["stages"] = json.loads(earlier.read_text()).get("stages", {})
        # gpu_check.sh says when it started, so the wheelhouse's install counts against the budget too.
        self.started = float(os.environ.get("GPU_CHECK_STARTED") or time.time())
        self.budget_s = budget_s

    # ------------------------------------------------------------------ plumbing
    def elapsed(self) -> float:
        return time.time() - self.started

    def fits(self, name: str, expected: float | None = None) -> bool:
        """Whether a stage (or one lever) expected to take `expected` seconds fits in the budget's rest."""
        expected = self.s["expected"].get(name, 0) if expected is None else expected
        return not self.budget_s or self.elapsed() + expected <= self.budget_s

    def timeout(self, name: str) -> float:
        limit = self.s["timeouts"][name]
        if self.budget_s:  # a stage that started may run past the budget only this much
            limit = min(limit, max(30.0, self.budget_s - self.elapsed() + 45))
        return limit

    def save(self) -> None:
        self.summary["elapsed_s"] = round(self.elapsed(), 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        tmp.replace(self.out / "summary.json")

    def run(self, name: str, argv: list[str], *, timeout: float, env: dict[str, str] | None = None,
            stdout_file: Path | None = None) -> dict[str, Any]:
        """Run argv in its own process group, its output appended to OUTDIR/check.log (stdout to
        stdout_file if given); the result has rc, seconds and the output it logged."""
        print(f"[gpu_check] {name}: {' '.join(argv)}", flush=True)
        log = self.out / LOG
        start, offset = time.monotonic(), log.stat().st_size if log.exists() else 0
        with open(log, "a") as err, (open(stdout_file, "w") if stdout_file else open(os.devnull)) as std:
            err.write(f"\n===== {name} ({time.strftime('%H:%M:%S')}): {' '.join(argv)}\n")
            err.flush()
            process = subprocess.Popen(argv, stdout=std if stdout_file else err, stderr=err, cwd=self.work,
                                       env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True)
            try:
                rc = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                rc = "timeout"
        seconds = round(time.monotonic() - start, 1)
        print(f"[gpu_check] {name}: rc={rc} in {seconds} s", flush=True)
        with open(log, errors="replace") as text:
            text.seek(offset)
            return {"rc": rc, "seconds": seconds, "output": text.read()}

    def stage(self, name: str, fn) -> None:
        if not self.fits(name):
            self.summary["stages"][name] = {
                "skipped": f"{self.s['expected'][name]} s expected, {self.budget_s - self.elapsed():.0f} s of the budget left; "
                           f"run it alone: tools/gpu_check.sh OUTDIR --only {name}"}
            self.save()
            return
        try:
            self.summary["stages"][name] = fn()
        except Exception as error:  # noqa: BLE001 - one stage's failure must not stop the check
            self.summary["stages"][name] = {"error": f"{type(error).__name__}: {error}"}
        if name in ("pretrain", "drills") and self.size == "gpu":
            # Nothing of a run (a worker holding GPU memory) outlives its stage. It stops every Ray
            # process of the node: the check assumes a node of its own (never on a shared CPU machine).
            subprocess.run(["ray", "stop", "--force"], capture_output=True, cwd=self.work, check=False)
        self.save()

    def speed(self, name: str, shape: dict[str, Any], *, timeout: float, extra: list[str] = ()) -> dict[str, Any]:
        """tools/train_speed.py at `shape`, in its own process; its JSON result with rc and seconds."""
        result_file = self.work / f"{name}.json"
        result_file.unlink(missing_ok=True)
        argv = [sys.executable, str(ROOT / "tools" / "train_speed.py"), "--config", shape["config"],
                "--seq-len", str(shape["seq_len"]), "--micro-batch", str(shape["micro_batch"]),
                "--grad-accum", str(shape["grad_accum"]), "--steps", str(shape["steps"]), "--warmup", str(shape["warmup"]),
                "--data-cache", str(self.work / "runs" / "_prepared"), "--threads", str(self.s["threads"]),
                "--out", str(result_file), *[a for item in shape["set"] for a in ("--set", item)],
                *shape.get("args", []), *extra]
        ran = self.run(name, argv, timeout=timeout)
        result = {"rc": ran["rc"], "seconds": ran["seconds"]}
        if result_file.exists():
            result.update(json.loads(result_file.read_text()))
        return result

    # ------------------------------------------------------------------ stages
    def preflight(self) -> dict[str, Any]:
        code = (
            "import json, torch, ray, deepspeed, raytrain_fast, sys\n"
            "from importlib.metadata import version, PackageNotFoundError\n"
            "try: torchao = version('torchao')\n"
            "except PackageNotFoundError: torchao = None\n"
            "out = {'python': sys.version.split()[0], 'torch': torch.__version__, 'ray': ray.__version__,"
            " 'deepspeed': deepspeed.__version__, 'torchao': torchao, 'cuda': torch.cuda.is_available()}\n"
            "if torch.cuda.is_available():\n"
            "    p = torch.cuda.get_device_properties(0)\n"
            "    out.update(gpu=p.name, gpu_gb=round(p.total_memory / 1e9, 1), gpus=torch.cuda.device_count(),"
            " sms=p.multi_processor_count, capability=f'{p.major}.{p.minor}', cudnn=torch.backends.cudnn.version())\n"
            "print(json.dumps(out))\n"
        )
        stdout = self.work / "preflight.json"
        result = self.run("preflight", [sys.executable, "-c", code], timeout=self.timeout("preflight"), stdout_file=stdout)
        del result["output"]
        lines = stdout.read_text().strip().splitlines()  # DeepSpeed prints to stdout too
        result.update(json.loads(lines[-1]) if lines else {})
        result["cpus"] = os.cpu_count()
        result["disk_free_gb"] = {p: round(shutil.disk_usage(p).free / 1e9, 1) for p in ("/tmp", "/dev/shm") if os.path.isdir(p)}
        result["work"] = str(self.work)
        result["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
        return result

    def _storage(self, name: str) -> str:
        return str(self.work / "runs")

    def pretrain(self) -> dict[str, Any]:
        s = self.s
        name = f"check-{s['preset']}"
        storage = self._storage(name)
        shutil.rmtree(f"{storage}/{name}", ignore_errors=True)  # a fresh run every time: no resume
        argv = [
            "raytrain-fast", "pretrain", "--config", s["preset"], "--name", name,
            "--set", f"storage.uri={storage}", "--set", f"train.steps={s['steps']}",
            "--set", f"train.micro_batch={s['micro_batch']}", "--set", f"train.global_batch={s['micro_batch'] * s['grad_accum']}",
            "--set", f"data.seq_len={s['seq_len']}", "--set", f"model.max_seq_len={s['seq_len']}",
            "--set", f"train.log_every={s['log_every']}", "--set", f"engine.compile={s['compile']}",
            "--set", f"engine.precision={s['precision']}", "--set", f"resources.use_gpu={s['use_gpu']}",
            "--set", f"resources.cpus_per_worker={s['cpus_per_worker']}",
            "--set", f"checkpoint.every_steps={s['checkpoint_every']}", "--set", "checkpoint.keep_last=1",
            "--set", "optim.warmup_steps=20",
        ]
        result = self.run("pretrain", argv, timeout=self.timeout("pretrain"))
        reserved = re.search(r"Checkpoint saves reuse ([\d.]+) GB of ([\w ]+), reserved in ([\d.]+) s", result.pop("output"))
        records = _read_metrics(f"{storage}/{name}", result)
        _copy_metrics(records, self.out / "pretrain_metrics.jsonl")
        result.update(loop_figures(records, log_every=s["log_every"], tokens_per_step=s["micro_batch"] * s["grad_accum"] * s["seq_len"]))
        if reserved:
            result["snapshot_memory"] = {"gb": float(reserved[1]), "kind": reserved[2], "reserved_s": float(reserved[3])}
        return result

    def engine(self) -> dict[str, Any]:
        return self.speed("engine", self.s["engine"], timeout=self.timeout("engine"),
                          extra=["--profile-steps", str(self.s["engine"]["profile_steps"]),
                                 "--trace", str(self.out / "profile_trace.json.gz"), "--attention"])

    def width_8b(self) -> dict[str, Any]:
        return self.speed("width_8b", self.s["width_8b"], timeout=self.timeout("width_8b"))

    def fp8_8b(self) -> dict[str, Any]:
        result = self.speed("fp8_8b", self.s["fp8_8b"], timeout=self.timeout("fp8_8b"))
        if self.size == "cpu":  # the refusal a CPU gives, as a user sees it: one line, exit status 2
            refused = self.speed("fp8_refused", {**self.s["width_8b"], "steps": 1, "warmup": 1,
                                                 "set": [*self.s["width_8b"]["set"], "engine.precision=fp8"]}, timeout=120)
            result["refusal_on_cpu"] = {"rc": refused["rc"], "line": refused.get("refused")}
        return result

    def levers(self) -> dict[str, Any]:
        """Each variant in its own process while the budget lasts; its tokens/s over `engine`'s."""
        engine = self.summary["stages"].get("engine", {}).get("tokens_per_sec")
        result: dict[str, Any] = {}
        for name, shape in self.s["levers"].items():
            if not self.fits("levers"):
                result[name] = {"skipped": f"budget; run it alone: tools/gpu_check.sh OUTDIR --only levers"}
                continue
            ran = self.speed(f"lever_{name}", shape, timeout=self.timeout("levers"))
            keep = ("rc", "seconds", "tokens_per_sec", "mfu", "step_s", "peak_gb", "compile_s", "micro_batch", "grad_accum",
                    "sdpa", "compile_scope", "lines", "refused")
            result[name] = {k: ran[k] for k in keep if k in ran}
            if engine and ran.get("tokens_per_sec"):
                result[name]["over_engine"] = ran["tokens_per_sec"] / engine
            self.summary["stages"]["levers"] = result
            self.save()
        return result

    def gpu_tests(self) -> dict[str, Any]:
        files = [str(ROOT / "tests" / f) for f in ("gpu", "test_autobatch.py", "test_document_masking.py", "test_checkpoint_snapshot.py")]
        argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rA", "--rootdir", str(ROOT), *files]
        result = self.run("gpu_tests", argv, timeout=self.timeout("gpu_tests"),
                          env={"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
        tail = result.pop("output").strip().splitlines()[-1:]
        result["summary_line"] = tail[0] if tail else ""
        return result

    def drills(self) -> dict[str, Any]:
        s = self.s
        name = "check-drills"
        storage = self._storage(name)
        shutil.rmtree(f"{storage}/{name}", ignore_errors=True)
        marker = self.work / "hang-marker"
        marker.unlink(missing_ok=True)
        argv = [
            "raytrain-fast", "pretrain", "--config", s["drill_preset"], "--name", name,
            "--set", f"storage.uri={storage}", "--set", "train.steps=40", "--set", "train.log_every=5",
            "--set", f"data.seq_len={s['drill_seq']}", "--set", f"resources.use_gpu={s['use_gpu']}",
            "--set", f"resources.cpus_per_worker={s['cpus_per_worker']}", "--set", "checkpoint.every_steps=10",
            "--set", "watchdog.hang_timeout_s=15", "--set", "engine.compile=off",
            "--drill", "nonfinite=15", "--drill", f"hang=28:{marker}",
        ]
        result = self.run("drills", argv, timeout=self.timeout("drills"))
        records = _read_metrics(f"{storage}/{name}", result)
        log = result.pop("output")
        rollbacks = [r["step"] for r in records if r.get("health/rollback")]
        hangs = [(r["step"], r.get("hang/step"), r.get("hang/rank"), r.get("hang/stuck_s")) for r in records if "hang/step" in r]
        result.update(
            nonfinite_named="non-finite" in log.lower() or "nonfinite" in log.lower(),
            rollback_steps=rollbacks, hangs=hangs, hang_named="HANG at step" in log,
            finished=bool(records) and records[-1].get("step") == 40,
        )
        result["recovered"] = bool(rollbacks) and bool(hangs) and result["finished"]
        return result


def _work_root(disk_gb: float) -> str:
    """The run's storage (checkpoints, prepared data): /tmp if it has disk_gb free, else whichever of
    /tmp and /dev/shm has more (a node's root disk may be small; /dev/shm is memory)."""
    free = {p: shutil.disk_usage(p).free / 1e9 for p in ("/tmp", "/dev/shm") if os.path.isdir(p)}
    base = "/tmp" if free.get("/tmp", 0) >= disk_gb else max(free, key=free.get)
    return f"{base}/raytrain-fast-gpu-check"


def _read_metrics(run_uri: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """The run's metric records; if they cannot be read, none, and result["metrics_error"] says why."""
    from raytrain_fast.metrics import read_metrics

    try:
        return read_metrics(run_uri)
    except Exception as error:  # noqa: BLE001 - no metrics is a finding, not a crash of the check
        result["metrics_error"] = f"reading the metrics of {run_uri} failed: {type(error).__name__}: {error}"
        return []


def _copy_metrics(records: list[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))


def loop_figures(records: list[dict[str, Any]], *, log_every: int, tokens_per_step: int) -> dict[str, Any]:
    """The loop's figures from its own log windows. `steady`: the windows without a checkpoint save or
    an evaluation; `timed`: every window after the first (which holds the compile step), saves
    included, as one rate (tokens over the summed window times); the window that holds the run's
    first save against the steady median."""
    windows = [r for r in records if "throughput/tokens_per_sec" in r]
    if len(windows) < 2:
        return {"windows": len(windows)}
    timed = windows[1:]  # the first window holds the compile step and warm-up
    steady = [r for r in timed if "checkpoint/blocked_s" not in r and "time/eval_s" not in r]
    tokens = log_every * tokens_per_step
    seconds = [tokens / r["throughput/tokens_per_sec"] for r in timed]

    def median(key: str, rows: list[dict[str, Any]]) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else None

    steady_median = median("throughput/tokens_per_sec", steady)
    first_save = next((r for r in timed if "checkpoint/blocked_s" in r), None)
    return {
        "windows": len(windows), "timed_windows": len(timed), "steady_windows": len(steady),
        "tokens_per_sec_steady_median": steady_median,
        "tokens_per_sec_steady_range": [min(r["throughput/tokens_per_sec"] for r in steady), max(r["throughput/tokens_per_sec"] for r in steady)] if steady else None,
        "tokens_per_sec_timed": len(timed) * tokens / sum(seconds),
        "first_save_window": {"step": first_save["step"], "tokens_per_sec": first_save["throughput/tokens_per_sec"],
                              "over_steady": first_save["throughput/tokens_per_sec"] / steady_median if steady_median else None}
        if first_save else None,
        "mfu_datasheet_median": median("throughput/mfu", steady),
        "mfu_measured_peak_median": median("throughput/mfu_measured_peak", steady),
        "step_s_median": median("time/step_s", steady),
        "data_wait_frac_max": max((r.get("time/data_wait_frac") or 0.0) for r in timed),
        "data_wait_frac_median": median("time/data_wait_frac", timed),
        "checkpoint_blocked_s": [r["checkpoint/blocked_s"] for r in records if "checkpoint/blocked_s" in r],
        "checkpoint_upload_s": [r["checkpoint/upload_s"] for r in records if "checkpoint/upload_s" in r],
        "compile_s": next((r["time/compile_s"] for r in records if "time/compile_s" in r), None),
        "eval_s": [r["time/eval_s"] for r in records if "time/eval_s" in r],
        "peak_gb": max((r.get("memory/peak_gb") or 0.0) for r in records),
        "final_loss": windows[-1].get("train/loss"),
        "last_step": records[-1].get("step") if records else None,
    }


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Each target against what the stages measured (None where a stage gave no figure)."""
    stages = summary["stages"]
    loop, engine = stages.get("pretrain", {}), stages.get("engine", {})
    width, fp8 = stages.get("width_8b", {}), stages.get("fp8_8b", {})
    ratio = _ratio(loop.get("tokens_per_sec_timed"), engine.get("tokens_per_sec"))
    first_save = (loop.get("first_save_window") or {}).get("over_steady")
    blocked = loop.get("checkpoint_blocked_s") or []
    speedup = _ratio(fp8.get("tokens_per_sec"), width.get("tokens_per_sec"))
    loss_rel = (abs(fp8["loss_last"] - width["loss_last"]) / width["loss_last"]
                if fp8.get("loss_last") is not None and width.get("loss_last") else None)

    def at_least(value: float | None, target: str) -> bool:
        return value is not None and value >= TARGETS[target]

    return {
        "loop_over_engine_timed": ratio, "loop_over_engine_met": at_least(ratio, "loop_over_engine"),
        "loop_over_engine_steady": _ratio(loop.get("tokens_per_sec_steady_median"), engine.get("tokens_per_sec")),
        "first_save_window_over_steady": first_save, "first_save_window_met": at_least(first_save, "first_save_window"),
        "mfu_1b": loop.get("mfu_datasheet_median"), "mfu_1b_met": at_least(loop.get("mfu_datasheet_median"), "mfu_1b"),
        "mfu_1b_engine": engine.get("mfu"),
        "mfu_8b_width": width.get("mfu"), "mfu_8b_width_met": at_least(width.get("mfu"), "mfu_8b_width"),
        "fp8_over_bf16": speedup, "fp8_over_bf16_met": at_least(speedup, "fp8_over_bf16"),
        "fp8_loss_rel": loss_rel, "fp8_loss_met": loss_rel is not None and loss_rel <= TARGETS["fp8_loss_rel"],
        "fp8_same_data_and_weights": bool(fp8.get("data_digest")) and all(
            fp8.get(key) == width.get(key) for key in ("data_digest", "weights_sum")),
        "sdpa_backend": (engine.get("profile") or {}).get("sdpa_backend"),
        "checkpoint_blocked_s_max": max(blocked) if blocked else None,
        "checkpoint_met": bool(blocked) and max(blocked) <= TARGETS["checkpoint_blocked_s"],
        "data_wait_frac_max": loop.get("data_wait_frac_max"),
        "data_wait_met": loop.get("data_wait_frac_max") is not None and loop["data_wait_frac_max"] <= TARGETS["data_wait_frac"],
        "gpu_tests_met": stages.get("gpu_tests", {}).get("rc") == 0,
        "drills_met": bool(stages.get("drills", {}).get("recovered")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="where summary.json and the logs go")
    parser.add_argument("--size", choices=tuple(SIZES), default="gpu", help="gpu (default) or cpu (the rehearsal)")
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma list of stages (default: all: {','.join(STAGES)})")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no stage that would end past this many seconds (default: 540 on a GPU, none at --size cpu; 0: none)")
    args = parser.parse_args()
    out = Path(args.outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",")
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        sys.exit(f"error: unknown stage {', '.join(map(repr, unknown))}; stages: {', '.join(STAGES)}")
    check = Check(out, args.size, budget_s=SIZES[args.size]["budget_s"] if args.budget_s is None else args.budget_s)
    check.work.mkdir(parents=True, exist_ok=True)
    for name in names:
        check.stage(name, getattr(check, name))
    check.summary["verdict"] = verdict(check.summary)
    check.save()
    print(json.dumps(check.summary["verdict"], indent=1), flush=True)


if __name__ == "__main__":
    main()
