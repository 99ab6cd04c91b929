"""`raytrain-fast bench overhead`: tokens/s of the package's loop against loops that split the gap
to a bare PyTorch loop (`VARIANTS`; the variants and the statistic: docs/benchmarks.md#loop-overhead).

Each variant takes its own clock in its own training process (our loop by `bench/loop_clock.py`'s
hook on rank 0, so the window holds the same steps and whole log windows); `compare` interleaves
them, `overhead_report` adds the medians and ratios. The setup and sizes are in overhead_setup.py,
the two loops outside Ray in bare_loops.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from raytrain_fast._ray_compat import health_check_interval_s, worker_env_flags
from raytrain_fast.bench.bare_loops import (
    IN_PROCESS_VARIANTS, bare, build_bare, in_fresh_process, timed_steps,
)
from raytrain_fast.bench.overhead_setup import (
    TYPICAL_RAY_TRAIN_MAX_STEPS,
    VARIANTS,
    OverheadSetup,
    measurement,
    model_parameters,
    run_config,
)
from raytrain_fast.launch.ray_address import ensure_ray


def _typical(setup: OverheadSetup, *, report: bool, wandb_dir: str) -> dict[str, Any]:
    """The loop people usually write on Ray Train (runs in the TorchTrainer worker)."""
    import ray.train
    import torch
    import wandb
    from ray.train.torch import prepare_model
    from torch.utils.flop_counter import FlopCounterMode

    from raytrain_fast.engine.program import prepare_process

    # As in `bare`: the comparison is about the loop, not Ray's OMP_NUM_THREADS=1.
    device = prepare_process(threads=setup.threads, seed=setup.seed)
    plain, batches = build_bare(setup, device)  # a hand-written loop around the bare model and optimizer
    model, optimizer, autocast = prepare_model(plain.model), plain.optimizer, plain.autocast
    run = wandb.init(project="raytrain-fast-bench", mode="offline", dir=wandb_dir, reinit="create_new")
    flops_per_step = 0.0
    last = time.perf_counter()

    def step(i: int) -> Any:
        nonlocal flops_per_step, last
        tokens = batches[i % batches.shape[0]]
        counting = bool(setup.flops_every) and i % setup.flops_every == 0
        with FlopCounterMode(display=False) if counting else contextlib.nullcontext() as counter:
            with autocast():
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
        if counting:
            flops_per_step = counter.get_total_flops()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        now = time.perf_counter()
        step_s, last = now - last, now
        run.log(
            {
                "loss": loss_value, "lr": optimizer.param_groups[0]["lr"], "grad_norm": grad_norm.item(),
                "tokens_per_sec": setup.tokens_per_step / step_s, "step_time": step_s,
                "tflops": flops_per_step / step_s / 1e12,
            },
            step=i,
        )
        if report:
            ray.train.report({"loss": loss_value, "step": i})
        return loss

    seconds, threads, proc = timed_steps(setup, step, device)  # the clock of the bare loops
    run.finish()
    return measurement(setup, seconds=seconds, precision=setup.precision, threads=threads, niceness=os.nice(0), proc=proc)


def _worker_loop(config: dict[str, Any]) -> None:
    """The TorchTrainer worker of `bare_in_ray_worker`, `typical_no_report` and `typical_ray_train`."""
    setup = OverheadSetup(**config["setup"])
    variant = config["variant"]
    if variant == "bare_in_ray_worker":
        result = bare(setup)
    else:
        result = _typical(setup, report=variant == "typical_ray_train", wandb_dir=config["scratch"])
    import ray.train

    if ray.train.get_context().get_world_rank() == 0:
        with open(config["result_file"], "w") as out:
            json.dump(result, out)


RAY_WORKER_VARIANTS = ("bare_in_ray_worker", "typical_no_report", "typical_ray_train")


def in_ray_worker(variant: str, setup: OverheadSetup) -> dict[str, Any]:
    """Run `bare_in_ray_worker`, `typical_no_report` or `typical_ray_train` on a TorchTrainer with
    one worker (the bench runs on one machine: the worker writes its result to a local file)."""
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    ensure_ray()
    setup = setup.resolved()
    if variant == "typical_ray_train":  # one step per controller poll: see TYPICAL_RAY_TRAIN_MAX_STEPS
        setup = dataclasses.replace(setup, steps=min(setup.steps, TYPICAL_RAY_TRAIN_MAX_STEPS))
    use_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-") as scratch:
        result_file = os.path.join(scratch, "result.json")
        trainer = TorchTrainer(
            _worker_loop,
            train_loop_config={
                "setup": dataclasses.asdict(setup), "variant": variant, "scratch": scratch, "result_file": result_file,
            },
            scaling_config=ray.train.ScalingConfig(
                num_workers=1, use_gpu=use_gpu, resources_per_worker={"CPU": 1 if use_gpu else setup.threads}
            ),
            run_config=ray.train.RunConfig(
                name=f"bench-{variant.replace('_', '-')}-{uuid.uuid4().hex[:8]}",
                storage_path=os.path.join(scratch, "storage"),
                worker_runtime_env={"env_vars": {
                    "WANDB_SILENT": "true", **worker_env_flags(), "OMP_NUM_THREADS": str(setup.threads),
                }},
                logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            ),
        )
        trainer.fit()
        with open(result_file) as stream:
            return json.load(stream)


def raytrain_fast_loop(setup: OverheadSetup, *, storage_dir: str, memory: bool = False, keep_run: bool = False) -> dict[str, Any]:
    """Our loop (`launch.trainer.run`, 1 worker) timed by `loop_clock.ClockHooks`; `memory`: on
    in-memory batches instead of the Ray Data ingest. Adds the run's own window statistics and
    the checkpoints that fell inside the timed window. The run's directory is removed unless `keep_run`."""
    from raytrain_fast.bench.loop_clock import ClockHooks
    from raytrain_fast.loop.hooks import LoopHooks
    from raytrain_fast.checkpoint.layout import STATE_FILE
    from raytrain_fast.launch.trainer import run as run_training
    from raytrain_fast.metrics.sinks import read_metrics

    setup = setup.resolved()
    ensure_ray()
    name = f"bench-overhead-{uuid.uuid4().hex[:8]}"
    config = run_config(setup, storage_dir=storage_dir, name=name)
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-") as scratch:
        timing_file = os.path.join(scratch, "timing.json")
        hooks = LoopHooks(ClockHooks(
            timing_file=timing_file, start_step=setup.warmup_steps, end_step=setup.end_step,
            memory_batches=(setup.micro_batch, setup.seq_len, setup.seed) if memory else None,
        ))
        result = run_training(config, hooks=hooks)
        with open(timing_file) as stream:
            clock = json.load(stream)
    with open(os.path.join(result.checkpoint, STATE_FILE)) as stream:
        precision = json.load(stream)["precision"]  # what the run trained in
    window = _window_statistics(read_metrics(result.run_dir), setup)
    checkpoints = sorted(int(metrics["step"]) for _, metrics in result.checkpoints)
    if not keep_run and "://" not in result.run_dir:
        shutil.rmtree(result.run_dir, ignore_errors=True)  # checkpoints of a large model add up over the repeats
    return measurement(
        setup, seconds=clock["seconds"], precision=precision, threads=clock["threads"], niceness=clock["niceness"],
        **window, checkpoint_every=setup.checkpoint_every,
        checkpoints_in_window=[s for s in checkpoints if setup.warmup_steps < s <= setup.end_step],
        memory_batches=clock["memory_batches"], proc=clock.get("proc", {}),
    )


def _window_statistics(records: list[dict[str, Any]], setup: OverheadSetup) -> dict[str, Any]:
    """From the run's JSONL: the median of the windows' tokens/s ending in the timed span, and their
    tokens over their summed wall time."""
    windows, previous = [], None
    for record in records:
        if "throughput/tokens_per_sec" not in record:
            continue
        step = int(record["step"])
        if previous is not None and setup.warmup_steps < step <= setup.end_step and previous >= setup.warmup_steps:
            windows.append((step - previous, record["throughput/tokens_per_sec"], record["time/step_s"], record))
        previous = step
    if not windows:
        raise RuntimeError("the run logged no window inside the timed steps")
    steps = sum(n for n, _, _, _ in windows)
    wall = sum(n * step_s for n, _, step_s, _ in windows)
    return {
        "window_median_tokens_per_sec": statistics.median(tps for _, tps, _, _ in windows),
        "windows_tokens_per_sec": steps * setup.tokens_per_step / wall,
        "windows": len(windows),
        "window_steps": steps,
        "checkpoint_blocked_s": [r["checkpoint/blocked_s"] for _, _, _, r in windows if "checkpoint/blocked_s" in r],
    }


def variant_runners(setup: OverheadSetup, names: Sequence[str], *, storage_dir: str) -> dict[str, Callable[[], dict[str, Any]]]:
    runners: dict[str, Callable[[], dict[str, Any]]] = {}
    for name in names:
        if name in IN_PROCESS_VARIANTS:
            runners[name] = lambda name=name: in_fresh_process(name, setup)
        elif name in RAY_WORKER_VARIANTS:
            runners[name] = lambda name=name: in_ray_worker(name, setup)
        elif name in ("raytrain_fast", "raytrain_fast_memory"):
            runners[name] = lambda name=name: raytrain_fast_loop(setup, storage_dir=storage_dir, memory=name.endswith("_memory"))
        else:
            raise ValueError(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")
    return runners


def _relative_spread(values: Sequence[float]) -> float:
    """(max - min) / median; 0 where the median is 0."""
    median = statistics.median(values)
    return (max(values) - min(values)) / median if median else 0.0


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    values = [run["tokens_per_sec"] for run in runs]
    return {
        "tokens_per_sec": values, "median": statistics.median(values), "min": min(values), "max": max(values),
        "spread": _relative_spread(values), "runs": runs,
    }


def compare(variants: Mapping[str, Callable[[], dict[str, Any]]], *, repeats: int = 3) -> dict[str, Any]:
    """Run every variant `repeats` times, interleaved, the order rotated each round. A variant
    returns a measurement dict with at least `tokens_per_sec`.

    Returns {"repeats", "order": [[names of round 1], ...], "variants": {name: {tokens_per_sec: [...],
    median, min, max, spread, runs: [measurements]}}}, spread = (max - min) / median.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    names = list(variants)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    order = []
    for round_index in range(repeats):
        shift = round_index % len(names)
        this_round = names[shift:] + names[:shift]
        order.append(this_round)
        for name in this_round:
            measurement = dict(variants[name]())
            measurement["loadavg_1m"] = os.getloadavg()[0]
            runs[name].append(measurement)
    return {"repeats": repeats, "order": order, "variants": {name: _summary(values) for name, values in runs.items()}}


def proc_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over a variant's runs of each /proc counter (bench/proc_counters.py), and the
    largest other processes and the per-thread counters of its median-speed run; {} where no run
    has counters."""
    counted = [run["proc"] for run in runs if run.get("proc")]
    if not counted:
        return {}
    out: dict[str, Any] = {
        key: statistics.median(proc[key] for proc in counted)
        for key, value in counted[0].items() if isinstance(value, (int, float))
    }
    middle = sorted(runs, key=lambda run: run["tokens_per_sec"])[len(runs) // 2]
    for key in ("other_processes_largest", "by_thread"):
        out[key] = middle.get("proc", {}).get(key, {})
    return out


def round_ratios(detail: dict[str, Any], *, ours: str) -> dict[str, dict[str, Any]]:
    """Per reference variant: our variant's tokens/s over the reference's in each round (the two ran
    in the same round, minutes apart at most), and their spread (max - min). Two runs of the bench
    agree when their medians differ by less than these spreads; a spread wider than the gap being
    claimed says the window is too short to resolve it."""
    variants = detail["variants"]
    mine = variants[ours]["tokens_per_sec"]
    out = {}
    for name, summary in variants.items():
        if name == ours:
            continue
        per_round = [a / b for a, b in zip(mine, summary["tokens_per_sec"])]
        out[name] = {"per_round": per_round, "median": statistics.median(per_round), "spread": max(per_round) - min(per_round)}
    return out


DRIFT_REFERENCES = ("bare", "bare_deepspeed", "bare_in_ray_worker")
"""Variants whose work is identical in every round (in-memory batches, no checkpoint), the first
one present measuring the machine's drift."""
DRIFT_WARNING = 0.03
"""The bench's reproducibility bar (two runs agree within 0.03): a machine that drifts more than
this between rounds cannot show it."""


def machine_drift(detail: dict[str, Any]) -> dict[str, Any] | None:
    """How much this machine's own speed moved between the rounds: the CPU seconds per step of a
    reference variant that does the same work in every round (`DRIFT_REFERENCES`), per round, and
    their spread, (max - min) / median. On a quiet machine it is a few percent; on a VM whose host
    is busy the same steps take more CPU seconds, and every variant's tokens/s moves with it, so
    ratios closer than this spread are not resolved (docs/benchmarks.md#machine-drift). None with
    fewer than two rounds or no reference variant."""
    for name in DRIFT_REFERENCES:
        runs = detail["variants"].get(name, {}).get("runs", [])
        per_round = [run["proc"]["cpu_s_per_step"] for run in runs if run.get("proc", {}).get("cpu_s_per_step")]
        if len(per_round) >= 2:
            spread = _relative_spread(per_round)
            return {"reference": name, "cpu_s_per_step_per_round": per_round, "spread": spread, "resolves_0_03": spread <= DRIFT_WARNING}
    return None


def drift_warning(drift: dict[str, Any] | None) -> str | None:
    """One line for the console (`bench overhead` prints it on stderr) when the machine drifted more than the bench can resolve."""
    if drift is None or drift["resolves_0_03"]:
        return None
    return (
        f"This machine's own speed moved by {drift['spread']:.0%} between rounds ({drift['reference']}'s CPU seconds per step, "
        f"the same work every round): ratios closer than that are not resolved here. Run on a quiet machine "
        f"(nothing else running, no busy VM host), or with more --repeats and compare the medians of round_ratios."
    )


def overhead_report(
    *, setup: OverheadSetup, storage_dir: str, variants: Sequence[str] = VARIANTS, repeats: int = 3,
) -> dict[str, Any]:
    """The JSON of `raytrain-fast bench overhead --json`; our loop's runs go under `storage_dir`."""
    setup = setup.resolved()
    load_before = os.getloadavg()
    report = compare(variant_runners(setup, variants, storage_dir=storage_dir), repeats=repeats)
    medians = {name: summary["median"] for name, summary in report["variants"].items()}
    head: dict[str, Any] = {
        "size": setup.size,
        "model": {"d_model": setup.d_model, "num_layers": setup.num_layers, "num_heads": setup.num_heads,
                  "parameters": model_parameters(setup)},
        "precision": setup.precision, "threads": setup.threads, "steps": setup.steps, "warmup_steps": setup.warmup_steps,
        "tokens_per_step": setup.tokens_per_step,
        "statistic": "tokens of the timed steps / wall seconds from the end of the warm-up step to the end of the last timed step",
        "checkpoint_every": setup.checkpoint_every,
        # Ray Train's controller polls each worker (and takes one reported result) this often.
        "ray_train_poll_interval_s": health_check_interval_s(),
        "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "tokens_per_sec": medians,
        "proc": {name: proc_summary(summary["runs"]) for name, summary in report["variants"].items()},
    }
    if "bare" in medians:
        head["ratio_to_bare"] = {name: value / medians["bare"] for name, value in medians.items()}
    if "raytrain_fast" in medians:
        ours = medians["raytrain_fast"]
        for key, reference in (
            ("ratio_vs_bare", "bare"), ("ratio_vs_bare_in_ray_worker", "bare_in_ray_worker"),
            ("ratio_vs_typical_no_report", "typical_no_report"), ("ratio_vs_typical", "typical_ray_train"),
        ):
            if reference in medians:
                head[key] = ours / medians[reference]
        runs = report["variants"]["raytrain_fast"]["runs"]
        head["raytrain_fast_window_median_tokens_per_sec"] = statistics.median(r["window_median_tokens_per_sec"] for r in runs)
        # The bench's figure against what the run printed (its log windows): they should agree within a few percent.
        head["raytrain_fast_over_window_median"] = ours / head["raytrain_fast_window_median_tokens_per_sec"]
        head["round_ratios"] = round_ratios(report, ours="raytrain_fast")
    head["machine_drift"] = machine_drift(report)
    report["setup"] = dataclasses.asdict(setup)
    return {**head, "detail": report}
