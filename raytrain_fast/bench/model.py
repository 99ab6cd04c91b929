"""`raytrain-fast bench model`: tokens/s, MFU and peak memory of one model size on this device, through
the worker's program (`engine.program.build_program`, as training and `micro_batch: auto` build it)
and through a bare PyTorch loop, with and without compile and activation checkpointing (`VARIANTS`).

Each variant runs in its own spawned process (model_worker.py), so each has its own memory high-water
mark; this process tells one at a time what to run, in rounds with the order rotated, and every
variant is timed with the same statistic. What each variant and each memory field is, and how they
are measured: docs/benchmarks.md#model-sizes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from raytrain_fast.bench.model_worker import COMPILED_VARIANTS, VariantProcess, stopped_by_sigterm
from raytrain_fast.console import say
from raytrain_fast.errors import ConfigError


VARIANTS = ("bare", "engine", "engine_ac", "engine_compiled", "engine_compiled_ac")
_CHECKPOINTED = {"engine_ac", "engine_compiled_ac"}
AC_PAIRS = {"eager": ("engine", "engine_ac"), "compiled": ("engine_compiled", "engine_compiled_ac")}
"""Per compile setting: (without, with) full activation checkpointing."""
_SETUP_TIMEOUT_S = 900.0


def parse_variants(text: str | list[str] | tuple[str, ...]) -> list[str]:
    """A comma list (or list) of variant names, checked, duplicates dropped, in the given order."""
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        what = "no variant given"
        if unknown:
            what = f"unknown variant{'s' if len(unknown) > 1 else ''} {', '.join(repr(n) for n in unknown)}"
        raise ConfigError(f"--variants: {what}; valid: {', '.join(VARIANTS)} (comma-separated)")
    return list(dict.fromkeys(names))


def _variants_arg(text: str) -> list[str]:
    import argparse

    try:
        return parse_variants(text)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(error.problems[0].removeprefix("--variants: ")) from None


def _option(default: Any, help: str, **argparse: Any) -> Any:
    """A field of the setup that is also the option of `bench model` named after it, with this help."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **argparse})
    return field(default=default, metadata={"help": help, **argparse})


@dataclass(kw_only=True)
class ModelBenchSetup:
    """What every variant trains, and for how long: the options of `raytrain-fast bench model`."""

    preset: str = _option("gpt-124m", "preset (or an alias such as gpt2-124m, or a YAML file) whose model, optimizer and "
                          "engine settings to measure (default: %(default)s)")
    seq_len: int = _option(256, "tokens per sequence (default: %(default)s)", type=int)
    micro_batch: int = _option(4, "sequences per micro-batch (default: %(default)s)", type=int)
    grad_accum: int = _option(1, "micro-batches per optimizer step, as train.grad_accum (default: %(default)s)", type=int)
    steps: int = _option(12, "timed steps per variant, spread over the rounds (default: %(default)s)", type=int)
    rounds: int = _option(6, "interleaved rounds, order rotated each round (default: %(default)s)", type=int)
    warmup_steps: int = _option(2, "untimed steps per variant first; compilation happens in the first (default: %(default)s)",
                                type=int)
    precision: str | None = _option(None, "default: the preset's engine.precision, resolved once, the same for every variant",
                                    choices=("auto", "bf16", "fp32"))
    threads: int = _option(0, "torch threads of every variant and the peak measurement (default: torch.get_num_threads())",
                           type=int)
    variants: list[str] = _option(list(VARIANTS), f"comma list of {', '.join(VARIANTS)} (default: all)", type=_variants_arg)
    peak_seconds: float | None = _option(
        None, "seconds of the matmul peak measurement (default: the preset's metrics.peak_measure_s)", type=float,
    )
    seed: int | None = _option(None, "model init and token seed (default: the preset's train.seed)", type=int)

    def steps_per_round(self) -> list[int]:
        base, extra = divmod(self.steps, self.rounds)
        return [base + (1 if r < extra else 0) for r in range(self.rounds)]

    def problems(self) -> list[str]:
        found = [f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}"
                 for name in ("seq_len", "micro_batch", "grad_accum", "steps", "rounds") if getattr(self, name) <= 0]
        if self.warmup_steps < 0:
            found.append(f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        if self.threads < 0:
            found.append(f"--threads must be >= 0, got {self.threads}")
        if self.rounds > 0 and self.steps < self.rounds:
            found.append(f"--steps ({self.steps}) must be at least --rounds ({self.rounds}): every round times one step or more")
        if self.precision not in (None, "auto", "bf16", "fp32"):
            found.append(f"--precision must be auto, bf16 or fp32, got {self.precision!r}")
        return found


def _say(message: str) -> None:
    say(f"[bench model] {message}", stderr=True)


class _LocalCoordinator:
    """What `metrics.setup.mfu_inputs` asks of the run's coordinator, for one process: each value
    measured here, once."""

    def flops_per_token(self, *, rank: int, count: Any, formula: float | None, fingerprint: str) -> Any:
        from raytrain_fast.coordinator import FlopsPerToken

        return FlopsPerToken(counted=float(count()), formula=formula)

    def achievable_peak(self, *, device_key: str, dtype: str, seconds: float, measure: Any) -> float:
        return float(measure())


def _resolve(setup: ModelBenchSetup) -> tuple[Any, str, str, int, int]:
    """(config with data.seq_len set and model.max_seq_len raised to fit, precision, why that
    precision, torch threads, seed)."""
    import torch

    from raytrain_fast.config import load_config
    from raytrain_fast.engine import resolve_precision

    try:
        config = load_config(setup.preset)
    except ConfigError as error:  # its messages name the option of `pretrain`: here it is --preset
        raise ConfigError([p.replace("--config ", "--preset ", 1) for p in error.problems], source=error.source) from None
    data = dataclasses.replace(config.data, seq_len=setup.seq_len)
    model = dataclasses.replace(config.model, max_seq_len=max(config.model.max_seq_len, setup.seq_len))
    config = dataclasses.replace(config, data=data, model=model)
    threads = setup.threads or torch.get_num_threads()
    torch.set_num_threads(threads)  # the precision probe and the peak with the variants' threads
    wanted = setup.precision or config.engine.precision
    precision, why = resolve_precision(wanted, use_gpu=torch.cuda.is_available())
    seed = config.train.seed if setup.seed is None else setup.seed
    return config, precision, why, threads, seed


def _mfu_inputs(config: Any, *, precision: str, seq_len: int, seed: int, peak_seconds: float) -> Any:
    """FLOPs per token (counted on the eager model, no recomputation) and the measured peak, here."""
    import torch

    from raytrain_fast.bench.model_worker import release_cached_memory
    from raytrain_fast.engine import training_device
    from raytrain_fast.metrics.setup import mfu_inputs
    from raytrain_fast.model import build_model

    device = training_device()
    torch.manual_seed(seed)
    model = build_model(config.model, device)
    sample = torch.randint(0, config.model.vocab_size, (1, seq_len), device=device)
    metrics = dataclasses.replace(config.metrics, peak_measure_s=peak_seconds)
    inputs = mfu_inputs(_LocalCoordinator(), metrics, rank=0, model=model, sample_tokens=sample, device=device,
                        precision=precision, measure_peak=True)
    del model, sample
    release_cached_memory(device)
    return inputs


def _machine() -> dict[str, Any]:
    import torch

    from raytrain_fast.metrics.peak import cpu_model_name

    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_model_name(), "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpu": torch.cuda.get_device_name() if cuda else None, "gpus": torch.cuda.device_count() if cuda else 0,
    }


def bench_model(setup: ModelBenchSetup) -> dict[str, Any]:
    """Run the bench; returns the report (see the module docstring). Progress goes to stderr."""
    import torch

    variants = parse_variants(setup.variants)
    problems = setup.problems()
    if problems:
        raise ConfigError(problems)
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):  # library chatter must not reach the JSON's stream
        config, precision, why, threads, seed = _resolve(setup)
        _say(f"{setup.preset}: seq_len {setup.seq_len}, micro-batch {setup.micro_batch}, precision {precision} ({why}), "
             f"{threads} torch threads; variants: {', '.join(variants)}")
        peak_seconds = config.metrics.peak_measure_s if setup.peak_seconds is None else setup.peak_seconds
        mfu = _mfu_inputs(config, precision=precision, seq_len=setup.seq_len, seed=seed, peak_seconds=peak_seconds)
        peak = mfu.measured_peak_flops
        _say(f"FLOPs/token {mfu.flops_per_token:.4g} (counted {mfu.counted_flops_per_token:.4g}); measured "
             f"{mfu.dtype} matmul peak {peak / 1e12 if peak else float('nan'):.3f} TFLOP/s on {mfu.device_name}")
        jobs = _jobs(setup, variants, config=config, precision=precision, threads=threads, seed=seed)
        with _cold_compile_caches(jobs):
            measured = _measure(setup, jobs)
    per_variant = {name: _variant_report(name, measured[name], mfu=mfu) for name in variants}
    bare = per_variant.get("bare")
    for entry in per_variant.values():
        entry["ratio_vs_bare"] = entry["tokens_per_sec"] / bare["tokens_per_sec"] if bare else None
    return {
        "device": "cuda" if torch.cuda.is_available() else "cpu", "device_name": mfu.device_name,
        "machine": _machine(), "preset": setup.preset, "seq_len": setup.seq_len, "micro_batch": setup.micro_batch,
        "grad_accum": setup.grad_accum, "precision": precision, "precision_reason": why, "threads": threads, "steps": setup.steps,
        "steps_per_round": setup.steps_per_round(), "rounds": setup.rounds, "warmup_steps": setup.warmup_steps,
        "order": measured["_order"]["order"], "load_avg_1m": measured["_order"]["load_avg_1m"],
        "peak_tflops": peak / 1e12 if peak else None, "peak_dtype": mfu.dtype,
        "datasheet_peak_tflops": mfu.datasheet_peak_flops / 1e12 if mfu.datasheet_peak_flops else None,
        "flops_per_token": mfu.flops_per_token, "counted_flops_per_token": mfu.counted_flops_per_token,
        "variants": per_variant, "ac_memory_cut": _ac_cut(per_variant), "wall_s": time.perf_counter() - started,
    }


def _jobs(setup: ModelBenchSetup, variants: list[str], *, config: Any, precision: str, threads: int, seed: int) -> list[dict[str, Any]]:
    from raytrain_fast.engine.program import one_process

    one = one_process(config, micro_batch=setup.micro_batch, grad_accum=setup.grad_accum, steps=setup.warmup_steps + setup.steps)
    jobs = []
    for name in variants:
        variant = dataclasses.replace(
            one, model=dataclasses.replace(one.model, activation_checkpointing="full" if name in _CHECKPOINTED else "none"),
            engine=dataclasses.replace(one.engine, precision=precision, compile="on" if name in COMPILED_VARIANTS else "off"),
        )
        jobs.append({
            # A plain dict: unpickling a dataclass of the package in the new process would import torch
            # before `env` is in place.
            "name": name, "config": variant.to_dict(), "threads": threads, "seed": seed,
            "env": {"OMP_NUM_THREADS": str(threads)},
        })
    return jobs


@contextlib.contextmanager
def _cold_compile_caches(jobs: list[dict[str, Any]]) -> Any:
    """Each compiled variant compiles into its own new, empty inductor (and Triton) cache, deleted
    afterwards: compile_s is what a first compile costs, whatever earlier runs left in the user's
    cache, and one compiled variant does not reuse the other's kernels."""
    import shutil
    import tempfile

    made = []
    try:
        for job in jobs:
            if job["name"] in COMPILED_VARIANTS:
                folder = tempfile.mkdtemp(prefix=f"raytrain-fast-bench-{job['name']}-")
                made.append(folder)
                job["env"].update(TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, "inductor"),
                                  TRITON_CACHE_DIR=os.path.join(folder, "triton"))
        yield jobs
    finally:
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def _measure(setup: ModelBenchSetup, jobs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Start every variant's process, warm each up in turn, then the timed rounds, one run at a time."""
    context = multiprocessing.get_context("spawn")
    workers: list[VariantProcess] = []
    with stopped_by_sigterm() as stopped:
        try:
            _say(f"setting up {len(jobs)} variant process(es) at once...")
            workers = [VariantProcess(context, job) for job in jobs]
            results: dict[str, dict[str, Any]] = {}
            for worker in workers:
                results[worker.name] = {"info": worker.answer(timeout_s=_SETUP_TIMEOUT_S), "rounds": []}
                info = results[worker.name]["info"]
                note = f"; {info['compile_note']}" if info["compile_note"] else ""
                _say(f"{worker.name}: set up in {info['setup_s']:.1f} s, {info['built_gb']:.2f} GB{note}")
            for worker in workers:
                if setup.warmup_steps:
                    _say(f"{worker.name}: {setup.warmup_steps} warm-up step(s)...")
                warm = results[worker.name]["warmup"] = worker.ask("warmup", setup.warmup_steps)
                first = ""
                if warm["step_s"]:
                    compiled = " (compilation included)" if results[worker.name]["info"]["compiled"] else ""
                    first = f", first step {warm['step_s'][0]:.2f} s{compiled}"
                _say(f"{worker.name}: warmed up{first}; setup memory {warm['setup_gb']:.2f} GB")
            per_round = setup.steps_per_round()
            load = {"before": os.getloadavg()[0]}
            order: list[list[str]] = []
            for r, count in enumerate(per_round):
                turn = workers[r % len(workers):] + workers[:r % len(workers)]
                order.append([w.name for w in turn])
                for worker in turn:
                    done = worker.ask("run", count)
                    results[worker.name]["rounds"].append(done)
                    tps = count * setup.grad_accum * setup.micro_batch * setup.seq_len / done["elapsed_s"]
                    _say(f"round {r + 1}/{len(per_round)}: {worker.name}: {count} step(s) in {done['elapsed_s']:.2f} s, "
                         f"{tps:,.0f} tokens/s")
            for worker in workers:
                results[worker.name]["memory"] = worker.ask("memory")
            load["after"] = os.getloadavg()[0]
            results["_order"] = {"order": order, "load_avg_1m": load}
            return results
        finally:
            for worker in workers:
                worker.stop(now=bool(stopped))


def _variant_report(name: str, result: dict[str, Any], *, mfu: Any) -> dict[str, Any]:
    from raytrain_fast.metrics.peak import mfu as compute_mfu

    info, warm, rounds, memory = result["info"], result["warmup"], result["rounds"], result["memory"]
    tokens_per_step = info["grad_accum"] * info["micro_batch"] * info["seq_len"]
    steps = sum(r["steps"] for r in rounds)
    elapsed = sum(r["elapsed_s"] for r in rounds)
    tokens_per_sec = steps * tokens_per_step / elapsed
    cpu_s = sum(r["cpu_s"] for r in rounds)
    entry: dict[str, Any] = {
        "tokens_per_sec": tokens_per_sec,
        "mfu": compute_mfu(tokens_per_sec=tokens_per_sec, flops_per_token=mfu.flops_per_token,
                           peak_flops=mfu.measured_peak_flops, num_devices=1),
        "step_s": elapsed / steps,
        "round_tokens_per_sec": [r["steps"] * tokens_per_step / r["elapsed_s"] for r in rounds],
        "timed_steps": steps, "timed_s": elapsed, "warmup_steps": len(warm["step_s"]),
        # CPU time of this process over the timed steps / (wall time x threads): well below 1 on a CPU
        # device when other processes took cores from it (on GPU only the launching thread's share).
        "cpu_share": cpu_s / (elapsed * info["threads"]),
        "peak_gb": memory["peak_gb"], "setup_gb": warm["setup_gb"], "above_setup_gb": memory["peak_gb"] - warm["setup_gb"],
        "built_gb": info["built_gb"], "warmup_peak_gb": warm["warmup_peak_gb"],
        "precision": info["precision"], "threads": info["threads"], "seq_len": info["seq_len"], "micro_batch": info["micro_batch"],
        "grad_accum": info["grad_accum"], "activation_checkpointing": info["activation_checkpointing"], "setup_s": info["setup_s"],
        "first_step_s": warm["step_s"][0] if warm["step_s"] else None, "final_loss": rounds[-1]["loss"],
    }
    if name in COMPILED_VARIANTS:
        entry["compiled"] = info["compiled"]
        entry["compile_s"] = entry["first_step_s"] if info["compiled"] else None
        if info["compile_note"]:
            entry["compile_note"] = info["compile_note"]
    return entry


def _ac_cut(variants: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per compile setting with both variants: what full activation checkpointing saves and costs."""
    cuts = {}
    for setting, (plain, checkpointed) in AC_PAIRS.items():
        if plain not in variants or checkpointed not in variants:
            continue
        a, b = variants[checkpointed], variants[plain]
        cuts[setting] = {
            "compares": f"{checkpointed} vs {plain}",
            "peak_gb_cut": 1 - a["peak_gb"] / b["peak_gb"],
            "above_setup_gb_cut": 1 - a["above_setup_gb"] / b["above_setup_gb"] if b["above_setup_gb"] > 0 else None,
            "peak_gb_saved": b["peak_gb"] - a["peak_gb"],
            "tokens_per_sec_ratio": a["tokens_per_sec"] / b["tokens_per_sec"],
            "step_time_cost": b["tokens_per_sec"] / a["tokens_per_sec"] - 1,
        }
    return cuts


def add_arguments(parser: Any) -> None:
    """The options of `raytrain-fast bench model`: one per field of ModelBenchSetup."""
    for option in dataclasses.fields(ModelBenchSetup):
        default = option.default_factory() if option.default is dataclasses.MISSING else option.default
        parser.add_argument(f"--{option.name.replace('_', '-')}", default=default, **option.metadata)


def from_args(args: Any) -> ModelBenchSetup:
    """The setup `add_arguments`' options give (each option is named after its field)."""
    return ModelBenchSetup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ModelBenchSetup)})
