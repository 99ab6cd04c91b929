#!/usr/bin/env python3
"""The GPU check: the main path on one GPU node, in one command, most important figures first.

    tools/gpu_check.sh OUTDIR        (installs .wheelhouse, then runs this)
    python3 tools/gpu_check.py OUTDIR [--size gpu|cpu] [--only STAGE,...]

Stages, each in its own process with its own time limit, each result written to OUTDIR/summary.json
as soon as it is known (a stage that fails or runs out of time does not stop the next):
1. `preflight`: the GPU, torch, Ray, DeepSpeed and the free disk;
2. `pretrain`: `raytrain-fast pretrain` through Ray Train: llama-1b, bf16, ZeRO-2, compiled blocks,
   seq 2048 x micro-batch 4, one checkpoint inside the timed steps; tokens/s, MFU (datasheet and
   measured peak), data wait and checkpoint blocking from the run's own metrics;
3. `bench_model`: `raytrain-fast bench model` at the same shape (bare, engine, engine_compiled): the full
   loop's tokens/s over the compiled engine's alone is one ratio from one machine;
4. `gpu_tests`: the suite's `gpu`-marked tests;
5. `drills`: a planted non-finite step and a planted hang through the loop on the GPU, each named and
   recovered from.

`--size cpu` runs the same stages at CPU sizes (llama-tiny, fp32): tools/rehearse_gpu_kit.sh uses it to
check this script and the wheelhouse here before a GPU node ever sees them.
"""

from __future__ import annotations

import argparse
import json
import os
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
    "loop_over_engine": 0.97,  # the full loop's tokens/s over the compiled engine's alone, same shape
    "mfu_datasheet": 0.45,  # llama-1b at seq 2048, against the datasheet's dense bf16 peak
    "checkpoint_blocked_s": 1.0,  # per save
    "data_wait_frac": 0.01,
}

SIZES: dict[str, dict[str, Any]] = {
    "gpu": {
        "preset": "llama-1b", "seq_len": 2048, "micro_batch": 4, "grad_accum": 8, "steps": 45, "checkpoint_every": 20,
        "log_every": 5, "compile": "on", "precision": "bf16", "use_gpu": "true", "cpus_per_worker": 8,
        "bench_steps": 2, "bench_rounds": 2, "drill_preset": "llama-tiny", "drill_seq": 128,
        "disk_gb": 45,  # two ZeRO-2 checkpoints of llama-1b (about 17 GB each) and the prepared corpus
        "timeouts": {"preflight": 60, "pretrain": 240, "bench_model": 150, "gpu_tests": 100, "drills": 150},
    },
    "cpu": {
        "preset": "llama-tiny", "seq_len": 128, "micro_batch": 8, "grad_accum": 2, "steps": 20, "checkpoint_every": 10,
        "log_every": 5, "compile": "off", "precision": "fp32", "use_gpu": "false", "cpus_per_worker": 1,
        "bench_steps": 4, "bench_rounds": 2, "drill_preset": "llama-tiny", "drill_seq": 64,
        "disk_gb": 1,
        "timeouts": {"preflight": 120, "pretrain": 600, "bench_model": 600, "gpu_tests": 300, "drills": 900},
    },
}
STAGES = ("preflight", "pretrain", "bench_model", "gpu_tests", "drills")


class Check:
    def __init__(self, out: Path, size: str) -> None:
        self.out, self.size, self.s = out, size, SIZES[size]
        self.work = Path(os.environ.get("GPU_CHECK_WORK") or _work_root(self.s["disk_gb"]))
        self.summary: dict[str, Any] = {"size": size, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "targets": TARGETS, "stages": {}}
        self.started = time.monotonic()

    # ------------------------------------------------------------------ plumbing
    def save(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.started, 1)
        tmp = self.out / "summary.json.tmp"
        tmp.write_text(json.dumps(self.summary, indent=1, default=str))
        tmp.replace(self.out / "summary.json")

    def run(self, name: str, argv: list[str], *, log: str, timeout: float, env: dict[str, str] | None = None,
            stdout_file: str | None = None) -> dict[str, Any]:
        """Run argv in its own process group, stdout+stderr to OUTDIR/log (stdout to stdout_file if given)."""
        print(f"[gpu_check] {name}: {' '.join(argv)}", flush=True)
        start = time.monotonic()
        with open(self.out / log, "a") as err, (open(self.out / stdout_file, "w") if stdout_file else open(os.devnull)) as std:  # noqa: E501
            err.write(f"$ {' '.join(argv)}\n")
            err.flush()
            process = subprocess.Popen(argv, stdout=std if stdout_file else err, stderr=err, cwd=self.work,
                                       env={**os.environ, **(env or {})}, start_new_session=True)
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
        result = {"rc": rc, "seconds": round(time.monotonic() - start, 1)}
        print(f"[gpu_check] {name}: rc={rc} in {result['seconds']} s", flush=True)
        return result

    def stage(self, name: str, fn) -> None:
        try:
            self.summary["stages"][name] = fn()
        except Exception as error:  # noqa: BLE001 - one stage's failure must not stop the check
            self.summary["stages"][name] = {"error": f"{type(error).__name__}: {error}"}
        if name in ("pretrain", "drills") and self.size == "gpu":
            # Nothing of a run (a worker holding GPU memory) outlives its stage. It stops every Ray
            # process of the node: the check assumes a node of its own (never on a shared CPU machine).
            subprocess.run(["ray", "stop", "--force"], capture_output=True, cwd=self.work, check=False)
        self.save()

    # ------------------------------------------------------------------ stages
    def preflight(self) -> dict[str, Any]:
        code = (
            "import json, torch, ray, deepspeed, raytrain_fast, sys\n"
            "out = {'python': sys.version.split()[0], 'torch': torch.__version__, 'ray': ray.__version__,"
            " 'deepspeed': deepspeed.__version__, 'cuda': torch.cuda.is_available()}\n"
            "if torch.cuda.is_available():\n"
            "    p = torch.cuda.get_device_properties(0)\n"
            "    out.update(gpu=p.name, gpu_gb=round(p.total_memory / 1e9, 1), gpus=torch.cuda.device_count(),"
            " sms=p.multi_processor_count)\n"
            "print(json.dumps(out))\n"
        )
        # Its output stays out of OUTDIR: what comes back from a GPU node is limited to 8 files.
        result = self.run("preflight", [sys.executable, "-c", code], log=str(self.work / "preflight.log"),
                          timeout=self.s["timeouts"]["preflight"], stdout_file=str(self.work / "preflight.json"))
        lines = (self.work / "preflight.json").read_text().strip().splitlines()  # DeepSpeed prints to stdout too
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
        result = self.run("pretrain", argv, log="pretrain.log", timeout=s["timeouts"]["pretrain"])
        records = _read_metrics(f"{storage}/{name}")
        _copy_metrics(records, self.out / "pretrain_metrics.jsonl")
        result.update(loop_figures(records, log_every=s["log_every"], tokens_per_step=s["micro_batch"] * s["grad_accum"] * s["seq_len"]))
        return result

    def bench_model(self) -> dict[str, Any]:
        s = self.s
        argv = [
            "raytrain-fast", "bench", "model", "--preset", s["preset"], "--seq-len", str(s["seq_len"]),
            "--micro-batch", str(s["micro_batch"]), "--grad-accum", str(s["grad_accum"]), "--variants", self._bench_variants(),
            "--warmup-steps", "2", "--steps", str(s["bench_steps"]), "--rounds", str(s["bench_rounds"]),
            "--precision", s["precision"], "--json",
        ]
        result = self.run("bench_model", argv, log="bench_model.log", timeout=s["timeouts"]["bench_model"], stdout_file="bench_model.json")
        text = (self.out / "bench_model.json").read_text()
        if text.strip():
            report = json.loads(text)
            result["variants"] = {k: {f: v.get(f) for f in ("tokens_per_sec", "mfu", "step_s", "round_tokens_per_sec", "peak_gb", "compile_s")}
                                  for k, v in report.get("variants", {}).items()}
            result["peak_tflops"] = report.get("peak_tflops")
            result["datasheet_peak_tflops"] = report.get("datasheet_peak_tflops")
        return result

    def _bench_variants(self) -> str:
        """Every variant's process holds its model, optimizer state and cached activations on the one GPU
        at once: at 1B all three need about 120 GB; with less, the compiled engine alone (the ratio's
        denominator)."""
        gpu_gb = self.summary["stages"].get("preflight", {}).get("gpu_gb")
        return "engine_compiled" if gpu_gb is not None and gpu_gb < 120 else "bare,engine,engine_compiled"

    def gpu_tests(self) -> dict[str, Any]:
        files = [str(ROOT / "tests" / f) for f in ("gpu", "test_autobatch.py", "test_document_masking.py", "test_checkpoint_snapshot.py")]
        argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-q", "-rA", "--rootdir", str(ROOT), *files]
        result = self.run("gpu_tests", argv, log="gpu_tests.log", timeout=self.s["timeouts"]["gpu_tests"],
                          env={"PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
        tail = (self.out / "gpu_tests.log").read_text().strip().splitlines()[-1:]
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
        result = self.run("drills", argv, log="drills.log", timeout=s["timeouts"]["drills"])
        records = _read_metrics(f"{storage}/{name}")
        log = (self.out / "drills.log").read_text(errors="replace")
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


def _read_metrics(run_uri: str) -> list[dict[str, Any]]:
    from raytrain_fast.metrics import read_metrics

    try:
        return read_metrics(run_uri)
    except Exception:  # noqa: BLE001 - no metrics is a finding, not a crash of the check
        return []


def _copy_metrics(records: list[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(r, default=str) + "\n" for r in records))


def loop_figures(records: list[dict[str, Any]], *, log_every: int, tokens_per_step: int) -> dict[str, Any]:
    """The loop's figures from its own log windows. `steady`: the windows without a checkpoint save or
    the compile step; `timed`: every window after the first, checkpoints included, as one rate
    (tokens over the summed window times)."""
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

    return {
        "windows": len(windows), "timed_windows": len(timed), "steady_windows": len(steady),
        "tokens_per_sec_steady_median": median("throughput/tokens_per_sec", steady),
        "tokens_per_sec_steady_range": [min(r["throughput/tokens_per_sec"] for r in steady), max(r["throughput/tokens_per_sec"] for r in steady)] if steady else None,
        "tokens_per_sec_timed": len(timed) * tokens / sum(seconds),
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


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    """Each target against what the stages measured (None where a stage gave no figure)."""
    loop = summary["stages"].get("pretrain", {})
    bench = summary["stages"].get("bench_model", {}).get("variants", {})
    engine = (bench.get("engine_compiled") or {}).get("tokens_per_sec")
    ratio = loop.get("tokens_per_sec_timed") / engine if engine and loop.get("tokens_per_sec_timed") else None
    ratio_steady = loop.get("tokens_per_sec_steady_median") / engine if engine and loop.get("tokens_per_sec_steady_median") else None
    blocked = loop.get("checkpoint_blocked_s") or []
    drills = summary["stages"].get("drills", {})
    return {
        "loop_over_engine_timed": ratio, "loop_over_engine_steady": ratio_steady,
        "loop_over_engine_met": ratio is not None and ratio >= TARGETS["loop_over_engine"],
        "mfu_datasheet": loop.get("mfu_datasheet_median"),
        "mfu_met": (loop.get("mfu_datasheet_median") or 0) >= TARGETS["mfu_datasheet"],
        "checkpoint_blocked_s_max": max(blocked) if blocked else None,
        "checkpoint_met": bool(blocked) and max(blocked) <= TARGETS["checkpoint_blocked_s"],
        "data_wait_frac_max": loop.get("data_wait_frac_max"),
        "data_wait_met": loop.get("data_wait_frac_max") is not None and loop["data_wait_frac_max"] <= TARGETS["data_wait_frac"],
        "drills_met": bool(drills.get("recovered")),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", help="where summary.json and the logs go")
    parser.add_argument("--size", choices=tuple(SIZES), default="gpu", help="gpu (default) or cpu (the rehearsal)")
    parser.add_argument("--only", default=",".join(STAGES), help=f"comma list of stages (default: all: {','.join(STAGES)})")
    args = parser.parse_args()
    out = Path(args.outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    check = Check(out, args.size)
    check.work.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        if name not in STAGES:
            sys.exit(f"error: unknown stage {name!r}; stages: {', '.join(STAGES)}")
        check.stage(name, getattr(check, name))
    check.summary["verdict"] = verdict(check.summary)
    check.save()
    print(json.dumps(check.summary["verdict"], indent=1), flush=True)


if __name__ == "__main__":
    main()
