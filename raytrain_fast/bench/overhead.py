"""`raytrain-fast bench overhead`: tokens/s of the package's loop against loops that split the gap
to a bare PyTorch loop, all on the same model, batch, precision, thread count and machine.

One statistic for every variant: tokens trained in the timed steps over the wall time from the end
of the warm-up (step `warmup_steps` done) to the end of the last timed step (step `warmup_steps +
steps` done), everything the variant does for those steps included. Each variant takes the clock
in its own training process, once at each boundary, and reports the seconds with the thread count
torch used and the precision it trained in (read from the variant, not echoed from the setup).

Variants (precision and threads passed explicitly to each):

- `bare`: the plain single-process loop someone writes for speed, in a fresh subprocess: batches
  already in memory (8 random batches, cycled), AdamW (fused where torch has it, as our engine
  uses), gradient clipping, autocast only for bf16, no logging. The ceiling.
- `bare_deepspeed`: the same loop through our DeepSpeed engine (`engine.build_engine`, ZeRO-2, the
  run's engine and optim config), no Ray, in a fresh subprocess with its own one-rank gloo group.
- `bare_in_ray_worker`: the `bare` loop inside a Ray Train TorchTrainer worker (1 worker): the
  floor Ray itself sets.
- `raytrain_fast_memory`: our loop (`launch.trainer.run`) on the in-memory batches: the Ray Data
  pipeline is closed when the steps start (`bench/loop_clock.py`).
- `raytrain_fast`: our full loop: Ray worker, Ray Data ingest, metrics with the JSONL and offline
  W&B sinks, and one checkpoint per `steps` steps (`checkpoint.every_steps = checkpoint_every`,
  default `steps`: exactly one falls inside the timed window, async upload to local storage).
  Evaluation is off (none of the references evaluates) and so is torch.compile (none compiles).
- `typical_no_report`: the loop people usually write on Ray Train (`loss.item()` every step, FLOPs
  re-counted with FlopCounterMode every `flops_every` steps, six scalars to an offline W&B run every
  step) without `ray.train.report`.
- `typical_ray_train`: the same with `ray.train.report` every step. Ray Train v2 keeps one result
  per worker and its controller takes one per poll (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, default
  2 s), so this loop is capped at one step per poll interval: the JSON shows the interval in force.

For our loop the clock is `bench/loop_clock.py`'s hook: rank 0 notes the time when the loop asks
for the first batch of the step after the warm-up and of the step after the last timed one (the
run has one extra step), so the window holds the same steps and, with `warmup_steps` and `steps`
multiples of `log_every`, exactly steps / log_every log windows. The run's own JSONL windows give
`window_median_tokens_per_sec` (the old statistic) and `windows_tokens_per_sec` (tokens over the
summed wall time of the windows in the timed span) next to it.

`compare` runs the variants interleaved (round-robin, the order rotated every round so none always
runs first or last); `overhead_report` adds medians, the ratio of each to `bare` and the headline
ratios of `raytrain_fast`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "num_layers": 4, "num_heads": 4},  # the tiny preset
    "large": {"d_model": 512, "num_layers": 8, "num_heads": 8},
}
"""Model shapes by name (the rest of the model is the tiny preset's: 320-row vocabulary, learned positions, tied embeddings)."""

SIZE_DEFAULTS: dict[str, dict[str, int]] = {
    # log_every divides warmup_steps and steps: the window holds whole log windows.
    "tiny": {"warmup_steps": 10, "steps": 30, "log_every": 10, "repeats": 3},
    "large": {"warmup_steps": 5, "steps": 30, "log_every": 5, "repeats": 3},
}
"""`raytrain-fast bench overhead` defaults per size (a large step is ~20x a tiny one on 2 CPU cores).
The large window is 30 steps (about 45 s on 2 cores): with 10 its rounds spread as much as the gap
being measured, and the one 350 MB checkpoint inside it was 7% of the window."""

VARIANTS = (
    "bare", "bare_deepspeed", "bare_in_ray_worker", "raytrain_fast_memory", "raytrain_fast", "typical_no_report",
    "typical_ray_train",
)
"""Every variant, in the order of the first round."""


@dataclass(kw_only=True)
class OverheadSetup:
    """What every variant trains, and for how long."""

    size: str = "tiny"
    """Label of the model size in the JSON (`tiny`, `large` or `custom`)."""
    d_model: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch: int = 16
    """Sequences per step (one micro-batch per step: no accumulation)."""
    warmup_steps: int = 10
    """Steps run before the clock starts (allocator, kernel selection, W&B start-up)."""
    steps: int = 30
    """Steps timed after warm-up."""
    log_every: int = 10
    """Our loop's log window (train.log_every)."""
    checkpoint_every: int | None = None
    """Our loop's checkpoint.every_steps; None = `steps` (exactly one checkpoint inside the timed window); 0 = none in it."""
    flops_every: int | None = None
    """typical loops: re-count FLOPs with FlopCounterMode every this many steps; None = `steps` (one in the window)."""
    precision: str = "auto"
    """bf16 or fp32; auto = what the package's engine picks on this machine."""
    threads: int = 0
    """torch threads on CPU (the same in every variant); 0 = this process's torch.get_num_threads()."""
    lr: float = 1e-3
    """AdamW learning rate."""
    grad_clip: float = 1.0
    """Gradient-norm clipping."""
    seed: int = 0
    """Seed of the model init and the in-memory token batches."""
    data_source: str = "stdlib"
    """Our full loop's data.source (prepared once per bench into its scratch storage, or data_cache_dir)."""
    data_cache_dir: str | None = None
    """Our full loop's data.cache_dir (None: under the bench's scratch storage)."""

    @classmethod
    def for_size(cls, name: str, /, **changes: Any) -> OverheadSetup:
        """The setup of a named model size with its default step counts; `changes` win (a changed
        shape should come with size="custom")."""
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}: one of {', '.join(MODEL_SIZES)}")
        defaults = {k: v for k, v in SIZE_DEFAULTS[name].items() if k != "repeats"}
        return cls(**{"size": name, **MODEL_SIZES[name], **defaults, **changes})

    def resolved(self) -> OverheadSetup:
        """Concrete precision, thread count and cadences (so every variant, in every process, uses the same)."""
        import torch

        from raytrain_fast.engine import resolve_precision

        precision = self.precision
        if precision == "auto":
            precision, _ = resolve_precision("auto", use_gpu=torch.cuda.is_available())
        threads = self.threads or torch.get_num_threads()
        return dataclasses.replace(
            self, precision=precision, threads=threads,
            checkpoint_every=self.steps if self.checkpoint_every is None else self.checkpoint_every,
            flops_every=self.steps if self.flops_every is None else self.flops_every,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def end_step(self) -> int:
        return self.warmup_steps + self.steps


def run_config(setup: OverheadSetup, *, storage_dir: str = "/tmp/raytrain-fast-bench", name: str = "bench-overhead"):
    """The package Config every variant trains: the tiny preset with the setup's model, batch,
    precision, threads and cadences (our loop runs one step past the timed window: see loop_clock)."""
    from raytrain_fast.config import load_config

    overrides = [
        f"model.d_model={setup.d_model}", f"model.num_layers={setup.num_layers}", f"model.num_heads={setup.num_heads}",
        f"model.max_seq_len={max(128, setup.seq_len)}", f"data.seq_len={setup.seq_len}", f"data.source={setup.data_source}",
        f"train.steps={setup.end_step + 1}", f"train.log_every={setup.log_every}", f"train.micro_batch={setup.micro_batch}",
        f"train.global_batch={setup.micro_batch}", f"train.seed={setup.seed}",
        f"optim.lr={setup.lr}", "optim.warmup_steps=1", f"optim.grad_clip={setup.grad_clip}",
        f"engine.precision={setup.precision}", "engine.compile=off",
        f"checkpoint.every_steps={setup.checkpoint_every or 0}", "eval.enabled=false",
        "metrics.wandb=true", "metrics.wandb_mode=offline", "metrics.peak_measure_s=0",
        "resources.num_workers=1", f"resources.cpus_per_worker={setup.threads}", "resources.max_failures=0",
        f"storage.uri={storage_dir}",
    ]
    if setup.data_cache_dir:
        overrides.append(f"data.cache_dir={setup.data_cache_dir}")
    return load_config("tiny", overrides, name=name)


def model_parameters(setup: OverheadSetup) -> int:
    from raytrain_fast.model import build_model

    return sum(p.numel() for p in build_model(run_config(setup).model, "meta").parameters())


def _measurement(setup: OverheadSetup, *, seconds: float, precision: str, threads: int, niceness: int, **extra: Any) -> dict[str, Any]:
    tokens = setup.steps * setup.tokens_per_step
    return {
        "tokens_per_sec": tokens / seconds, "tokens": tokens, "seconds": seconds, "steps": setup.steps,
        "warmup_steps": setup.warmup_steps, "precision": precision, "threads": threads, "niceness": niceness, **extra,
    }


# --- the bare loops ---------------------------------------------------------------------------------

def set_threads(setup: OverheadSetup, device: Any) -> None:
    import torch

    if device.type == "cpu":
        torch.set_num_threads(setup.threads)
        os.environ["OMP_NUM_THREADS"] = str(setup.threads)


def _batches(setup: OverheadSetup, device: Any):
    import torch

    generator = torch.Generator().manual_seed(setup.seed)
    return torch.randint(0, 257, (8, setup.micro_batch, setup.seq_len + 1), generator=generator).to(device)


def build_bare(setup: OverheadSetup, device: Any):
    """Model (the run's model config), AdamW, in-memory batches and the autocast context."""
    import torch

    from raytrain_fast.engine.deepspeed_engine import fused_adamw_supported
    from raytrain_fast.model import build_model

    torch.manual_seed(setup.seed)
    model = build_model(run_config(setup).model, device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=setup.lr, betas=(0.9, 0.95), weight_decay=0.1,
        **({"fused": True} if fused_adamw_supported(device) else {"foreach": True}),
    )
    if setup.precision == "bf16":
        autocast: Callable[[], Any] = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    else:
        autocast = contextlib.nullcontext
    return model, optimizer, _batches(setup, device), autocast


def _timed(setup: OverheadSetup, step: Callable[[int], Any], device: Any) -> tuple[float, int]:
    """(seconds from the end of warm-up to the end of the last step, torch threads in use)."""
    import torch

    for i in range(setup.warmup_steps):
        step(i)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    threads = torch.get_num_threads()
    start = time.perf_counter()
    loss = None
    for i in range(setup.steps):
        loss = step(setup.warmup_steps + i)
    float(loss.detach())  # one host sync at the end: the clock stops when the device is done
    return time.perf_counter() - start, threads


def bare(setup: OverheadSetup) -> dict[str, Any]:
    """The plain loop, in this process (the bench runs it in a fresh one: `in_fresh_process`)."""
    import torch

    from raytrain_fast.engine import training_device

    setup = setup.resolved()
    device = training_device()
    set_threads(setup, device)
    model, optimizer, batches, autocast = build_bare(setup, device)

    def step(i: int) -> torch.Tensor:
        tokens = batches[i % batches.shape[0]]
        with autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setup.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    seconds, threads = _timed(setup, step, device)
    return _measurement(setup, seconds=seconds, precision=setup.precision, threads=threads, niceness=os.nice(0))


def bare_deepspeed(setup: OverheadSetup) -> dict[str, Any]:
    """The bare loop through our DeepSpeed engine (the run's engine and optim config), no Ray.
    Makes a process group: call it in a fresh process (`in_fresh_process`)."""
    import torch
    import torch.distributed as dist

    from raytrain_fast.engine.process_group import single_process_group
    from raytrain_fast.engine import build_engine, select_accelerator, training_device
    from raytrain_fast.model import build_model

    setup = setup.resolved()
    select_accelerator()
    device = training_device()
    set_threads(setup, device)
    config = run_config(setup)
    single_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        torch.manual_seed(setup.seed)
        model = build_model(config.model, device)
        engine = build_engine(
            model, engine=config.engine, optim=config.optim, micro_batch=setup.micro_batch, grad_accum=1, world_size=1,
            total_steps=config.train.steps,
        )
        batches = _batches(setup, device)

        def step(i: int) -> torch.Tensor:
            tokens = batches[i % batches.shape[0]]
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            return loss

        seconds, threads = _timed(setup, step, device)
        precision = "bf16" if engine.bfloat16_enabled() else "fp32"
    finally:
        dist.destroy_process_group()
    return _measurement(setup, seconds=seconds, precision=precision, threads=threads, niceness=os.nice(0))


_IN_PROCESS = {"bare": bare, "bare_deepspeed": bare_deepspeed}


def in_fresh_process(variant: str, setup: OverheadSetup, *, timeout_s: float = 1800) -> dict[str, Any]:
    """Run `bare` or `bare_deepspeed` in a new Python process (DeepSpeed and process groups are
    per process; no state of an earlier variant carries over)."""
    if variant not in _IN_PROCESS:
        raise ValueError(f"{variant!r} does not run in a subprocess: one of {', '.join(_IN_PROCESS)}")
    setup = setup.resolved()
    with tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-") as scratch:
        out = os.path.join(scratch, "result.json")
        env = {**os.environ, "OMP_NUM_THREADS": str(setup.threads)}
        code = "from raytrain_fast.bench.overhead import _process_main; _process_main()"
        done = subprocess.run(
            [sys.executable, "-c", code, variant, json.dumps(dataclasses.asdict(setup)), out],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout_s, check=False,
        )
        if done.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"bench variant {variant} failed (exit {done.returncode}):\n{done.stdout[-4000:]}")
        with open(out) as stream:
            return json.load(stream)


def _process_main() -> None:
    variant, setup_json, out = sys.argv[1:4]
    result = _IN_PROCESS[variant](OverheadSetup(**json.loads(setup_json)))
    with open(out, "w") as stream:
        json.dump(result, stream)


# --- loops in a Ray Train worker ------------------------------------------------------------------

def _typical(setup: OverheadSetup, *, report: bool, wandb_dir: str) -> dict[str, Any]:
    """The loop people usually write on Ray Train (runs in the TorchTrainer worker)."""
    import ray.train
    import torch
    import wandb
    from ray.train.torch import prepare_model
    from torch.utils.flop_counter import FlopCounterMode

    from raytrain_fast.engine import training_device

    device = training_device()
    set_threads(setup, device)  # as in `bare`: the comparison is about the loop, not Ray's OMP_NUM_THREADS=1
    model, optimizer, batches, autocast = build_bare(setup, device)
    model = prepare_model(model)
    run = wandb.init(project="raytrain-fast-bench", mode="offline", dir=wandb_dir, reinit="create_new")
    flops_per_step = 0.0
    start = threads = None
    last = time.perf_counter()
    for i in range(setup.end_step):
        if i == setup.warmup_steps:  # step warmup_steps is done, its report included
            threads, start = torch.get_num_threads(), time.perf_counter()
        tokens = batches[i % batches.shape[0]]
        if setup.flops_every and i % setup.flops_every == 0:
            with FlopCounterMode(display=False) as counter:
                with autocast():
                    loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
            flops_per_step = counter.get_total_flops()
        else:
            with autocast():
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
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
    assert start is not None and threads is not None
    seconds = time.perf_counter() - start
    run.finish()
    return _measurement(setup, seconds=seconds, precision=setup.precision, threads=threads, niceness=os.nice(0))


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


def in_ray_worker(variant: str, setup: OverheadSetup, *, num_workers: int = 1) -> dict[str, Any]:
    """Run `bare_in_ray_worker`, `typical_no_report` or `typical_ray_train` on a TorchTrainer with
    one worker (the bench runs on one machine: the worker writes its result to a local file).
    num_workers=0 is Ray Train's local mode (the loop runs in this process): for tests only."""
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    if variant not in RAY_WORKER_VARIANTS:
        raise ValueError(f"{variant!r} is not a Ray worker variant: one of {', '.join(RAY_WORKER_VARIANTS)}")
    ensure_ray()
    setup = setup.resolved()
    use_gpu = torch.cuda.is_available()
    with tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-") as scratch:
        result_file = os.path.join(scratch, "result.json")
        trainer = TorchTrainer(
            _worker_loop,
            train_loop_config={
                "setup": dataclasses.asdict(setup), "variant": variant, "scratch": scratch, "result_file": result_file,
            },
            scaling_config=ray.train.ScalingConfig(
                num_workers=num_workers, use_gpu=use_gpu, resources_per_worker={"CPU": 1 if use_gpu else setup.threads}
            ),
            run_config=ray.train.RunConfig(
                name=f"bench-{variant.replace('_', '-')}-{uuid.uuid4().hex[:8]}",
                storage_path=os.path.join(scratch, "storage"),
                worker_runtime_env={"env_vars": {
                    "WANDB_SILENT": "true", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "OMP_NUM_THREADS": str(setup.threads),
                }},
                logging_config=ray.train.LoggingConfig(log_level="WARNING"),
            ),
        )
        trainer.fit()
        with open(result_file) as stream:
            return json.load(stream)


# --- our loop ------------------------------------------------------------------------------------

def raytrain_fast_loop(setup: OverheadSetup, *, storage_dir: str, memory: bool = False, keep_run: bool = False) -> dict[str, Any]:
    """Our loop (`launch.trainer.run`, 1 worker) timed by `loop_clock.ClockHooks`; `memory`: on
    in-memory batches instead of the Ray Data ingest. Adds the run's own window statistics and
    the checkpoints that fell inside the timed window. The run's directory is removed unless `keep_run`."""
    from raytrain_fast.bench.loop_clock import ClockHooks
    from raytrain_fast.checkpoint.layout import STATE_FILE
    from raytrain_fast.launch.trainer import run as run_training
    from raytrain_fast.metrics.sinks import read_metrics

    setup = setup.resolved()
    ensure_ray()
    name = f"bench-overhead-{uuid.uuid4().hex[:8]}"
    config = run_config(setup, storage_dir=storage_dir, name=name)
    timing_file = os.path.join(tempfile.mkdtemp(prefix="raytrain-fast-bench-"), "timing.json")
    hooks = ClockHooks(
        timing_file=timing_file, start_step=setup.warmup_steps, end_step=setup.end_step,
        memory_batches=(setup.micro_batch, setup.seq_len, setup.seed) if memory else None,
    )
    os.environ.setdefault("WANDB_SILENT", "true")
    result = run_training(config, hooks=hooks)
    with open(timing_file) as stream:
        clock = json.load(stream)
    os.remove(timing_file)
    os.rmdir(os.path.dirname(timing_file))
    with open(os.path.join(result.checkpoint, STATE_FILE)) as stream:
        precision = json.load(stream)["precision"]  # what the run trained in
    window = _window_statistics(read_metrics(result.run_dir), setup)
    checkpoints = sorted(int(metrics["step"]) for _, metrics in result.checkpoints)
    if not keep_run and "://" not in result.run_dir:
        shutil.rmtree(result.run_dir, ignore_errors=True)  # checkpoints of a large model add up over the repeats
    return _measurement(
        setup, seconds=clock["seconds"], precision=precision, threads=clock["threads"], niceness=clock["niceness"],
        **window, checkpoint_every=setup.checkpoint_every,
        checkpoints_in_window=[s for s in checkpoints if setup.warmup_steps < s <= setup.end_step],
        memory_batches=clock["memory_batches"],
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


# --- the bench -------------------------------------------------------------------------------------

def ensure_ray() -> None:
    """A local Ray instance if none: workers at niceness 0 (Ray's default 15 would hand the CPU to
    any other process), as `launch.trainer` starts it."""
    import ray

    if not ray.is_initialized():
        os.environ.setdefault("RAY_worker_niceness", "0")
        ray.init(configure_logging=False, include_dashboard=False, log_to_driver=True)


def ray_train_poll_interval_s() -> float:
    """Ray Train's controller polls each worker (and takes one reported result) this often: the
    health-check interval, as the driver's environment sets it for this fit (Ray passes the
    variable to the controller)."""
    from raytrain_fast._ray_compat import health_check_interval_s

    return health_check_interval_s()


def variant_runners(setup: OverheadSetup, names: Sequence[str], *, storage_dir: str) -> dict[str, Callable[[], dict[str, Any]]]:
    runners: dict[str, Callable[[], dict[str, Any]]] = {}
    for name in names:
        if name in _IN_PROCESS:
            runners[name] = lambda name=name: in_fresh_process(name, setup)
        elif name in RAY_WORKER_VARIANTS:
            runners[name] = lambda name=name: in_ray_worker(name, setup)
        elif name in ("raytrain_fast", "raytrain_fast_memory"):
            runners[name] = lambda name=name: raytrain_fast_loop(setup, storage_dir=storage_dir, memory=name.endswith("_memory"))
        else:
            raise ValueError(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")
    return runners


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    values = [run["tokens_per_sec"] for run in runs]
    median = statistics.median(values)
    return {
        "tokens_per_sec": values, "median": median, "min": min(values), "max": max(values),
        "spread": (max(values) - min(values)) / median if median else 0.0, "runs": runs,
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


def overhead_report(
    *, setup: OverheadSetup | None = None, variants: Sequence[str] = VARIANTS, repeats: int = 3,
    storage_dir: str | None = None,
) -> dict[str, Any]:
    """The JSON of `raytrain-fast bench overhead --json`."""
    setup = (setup or OverheadSetup()).resolved()
    load_before = os.getloadavg()
    scratch = None
    if storage_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="raytrain-fast-bench-")
        storage_dir = scratch.name
    try:
        report = compare(variant_runners(setup, variants, storage_dir=storage_dir), repeats=repeats)
    finally:
        if scratch is not None:
            scratch.cleanup()
    medians = {name: summary["median"] for name, summary in report["variants"].items()}
    head: dict[str, Any] = {
        "size": setup.size,
        "model": {"d_model": setup.d_model, "num_layers": setup.num_layers, "num_heads": setup.num_heads,
                  "parameters": model_parameters(setup)},
        "precision": setup.precision, "threads": setup.threads, "steps": setup.steps, "warmup_steps": setup.warmup_steps,
        "tokens_per_step": setup.tokens_per_step,
        "statistic": "tokens of the timed steps / wall seconds from the end of the warm-up step to the end of the last timed step",
        "checkpoint_every": setup.checkpoint_every,
        "ray_train_poll_interval_s": ray_train_poll_interval_s(),
        "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]},
        "tokens_per_sec": medians,
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
    report["setup"] = dataclasses.asdict(setup)
    return {**head, "detail": report}


__all__ = [
    "MODEL_SIZES", "OverheadSetup", "VARIANTS", "bare", "bare_deepspeed", "compare", "in_fresh_process", "in_ray_worker",
    "overhead_report", "raytrain_fast_loop", "ray_train_poll_interval_s", "run_config",
]
