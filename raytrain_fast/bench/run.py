"""`raytrain-fast bench {data,overhead,checkpoint,model,health}`: each returns one report of ratios
measured against a baseline in the same run, on this machine, which the CLI prints as JSON."""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from typing import Any

from raytrain_fast.console import add_command, say
from raytrain_fast.errors import ConfigError


def add_parser(commands: Any) -> None:
    bench = add_command(commands, "bench", "measure speed against a baseline in the same run (prints JSON with --json)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    data = add_command(kinds, "data", "data wait of the Ray Data ingest path vs a DataLoader(num_workers=0)")
    data.add_argument("--steps", type=int, default=300, help="steps per path and round (default: 300)")
    data.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both paths (default: 3)")
    data.add_argument("--warmup-steps", type=int, default=20, help="untimed steps per path first (default: 20)")
    overhead = add_command(
        kinds, "overhead", "tokens/s of the full loop vs a bare PyTorch loop, the loops between them and a typical Ray Train loop",
    )
    overhead.add_argument(
        "--model", default="tiny", choices=["tiny", "medium", "large"],
        help="model size: tiny (the tiny preset, d_model 128, 4 layers), medium (d_model 384, 6 layers, seq 256, "
        "micro-batch 8) or large (d_model 512, 8 layers)",
    )
    overhead.add_argument("--d-model", type=int, default=None, help="override the model width (the size becomes `custom`)")
    overhead.add_argument("--layers", type=int, default=None, help="override the number of layers (the size becomes `custom`)")
    overhead.add_argument("--heads", type=int, default=None, help="override the attention heads (the size becomes `custom`)")
    overhead.add_argument("--steps", type=int, default=None, help="timed steps per variant and repeat (default: tiny 200, medium 40, large 30)")
    overhead.add_argument("--warmup-steps", type=int, default=None, help="untimed steps first (default: tiny 50, medium 10, large 5)")
    overhead.add_argument("--log-every", type=int, default=None, help="our loop's log window (default: tiny 50, medium 10, large 5)")
    overhead.add_argument("--repeats", type=int, default=None, help="rounds of all variants (default: 3)")
    overhead.add_argument(
        "--checkpoint-every", type=int, default=None,
        help="our loop's checkpoint.every_steps (default: the timed steps, so one checkpoint falls in the window; 0: none in it)",
    )
    overhead.add_argument(
        "--variants", default=None,
        help="comma-separated subset of bare,bare_deepspeed,bare_in_ray_worker,raytrain_fast_memory,raytrain_fast,"
        "typical_no_report,typical_ray_train (default: all)",
    )
    checkpoint = add_command(kinds, "checkpoint", "time training is blocked per checkpoint, async vs sync upload")
    checkpoint.add_argument("--storage", default=None, help="s3://bucket/prefix (default: a loopback S3 server started here)")
    checkpoint.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint of --storage")
    checkpoint.add_argument("--checkpoint-mb", type=float, default=200.0, help="size of each checkpoint in MB (default: 200)")
    checkpoint.add_argument("--num-workers", type=int, default=2, help="ranks that each write their part (default: 2)")
    checkpoint.add_argument("--checkpoints", type=int, default=3, help="checkpoints per mode (the median is reported)")
    checkpoint.add_argument(
        "--seconds-between", type=float, default=20.0,
        help="training time between checkpoints; async only helps when the upload fits into it",
    )
    model = add_command(
        kinds, "model", "tokens/s, MFU and peak memory of the engine (eager/compiled x AC off/full) vs a bare PyTorch loop",
    )
    from raytrain_fast.bench.model import add_arguments as add_model_arguments

    add_model_arguments(model)
    health = add_command(kinds, "health", "what the divergence checks cost a training step: with vs without, interleaved")
    health.add_argument("--model", default="tiny", choices=["tiny", "large"], help="model size, as for `bench overhead` (default: tiny)")
    health.add_argument("--steps", type=int, default=20, help="timed steps per variant and round (default: 20)")
    health.add_argument("--rounds", type=int, default=10, help="interleaved rounds of both variants (default: 10)")
    health.add_argument("--warmup-steps", type=int, default=5, help="untimed steps first (default: 5)")
    health.add_argument("--ops-calls", type=int, default=5000, help="calls per round when timing the checks' ops alone (default: 5000)")
    for parser in (overhead, health):
        parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"], help="auto: what the engine picks here")
        parser.add_argument("--threads", type=int, default=0, help="torch threads in every variant (0: this process's count)")
    for parser in (data, overhead, checkpoint, model, health):
        parser.add_argument("--json", action="store_true", help="print only the JSON object")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The report of the bench `args.bench` names."""
    if args.bench == "data":
        from raytrain_fast.bench.data import bench_data

        return bench_data(steps=args.steps, warmup_steps=args.warmup_steps, rounds=args.rounds, verbose=not args.json)
    if args.bench == "overhead":
        return bench_overhead(args)
    if args.bench == "health":
        from raytrain_fast.bench.health import bench_health

        return bench_health(size=args.model, steps=args.steps, rounds=args.rounds, warmup_steps=args.warmup_steps,
                            precision=args.precision, threads=args.threads, ops_calls=args.ops_calls)
    if args.bench == "model":
        from raytrain_fast.bench.model import bench_model, from_args

        return bench_model(from_args(args))
    return bench_checkpoint(args)


def overhead_argument_problems(setup: Any, variants: list[str], known: Any) -> list[str]:
    """What is wrong with `bench overhead`'s arguments, each with its fix (before any run starts)."""
    problems = [f"--variants: unknown {name!r}; valid: {', '.join(known)} (comma-separated)" for name in variants if name not in known]
    every = setup.log_every
    if setup.steps < every or setup.steps % every or setup.warmup_steps % every:
        problems.append(
            f"--steps ({setup.steps}) and --warmup-steps ({setup.warmup_steps}) must be multiples of --log-every ({every}), "
            "--steps at least one window: the loop's log windows are what is timed (e.g. --steps "
            f"{max(every, setup.steps // every * every)} --warmup-steps {setup.warmup_steps // every * every})"
        )
    return problems


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    """`raytrain-fast bench overhead`: every variant timed the same way (bench/overhead.py)."""
    import contextlib
    import sys

    from raytrain_fast.bench.overhead import drift_warning, overhead_report
    from raytrain_fast.bench.overhead_setup import SIZE_DEFAULTS, VARIANTS, OverheadSetup
    from raytrain_fast.launch.ray_address import ensure_ray

    shape = {"d_model": args.d_model, "num_layers": args.layers, "num_heads": args.heads}
    given = {**shape, "steps": args.steps or None, "warmup_steps": args.warmup_steps, "log_every": args.log_every or None}
    changes = {key: value for key, value in given.items() if value is not None}  # the size's defaults for the rest
    if any(value is not None for value in shape.values()):
        changes["size"] = "custom"
    setup = OverheadSetup.for_size(
        args.model, precision=args.precision, threads=args.threads, checkpoint_every=args.checkpoint_every, **changes,
    )
    variants = VARIANTS if not args.variants else [name.strip() for name in args.variants.split(",") if name.strip()]
    problems = overhead_argument_problems(setup, variants, VARIANTS)
    if problems:
        raise ConfigError(problems)
    scratch = tempfile.mkdtemp(prefix="raytrain-fast-bench-")
    try:
        # The runs print their progress: to stderr, so that with --json stdout holds only the JSON.
        with contextlib.redirect_stdout(sys.stderr):
            ensure_ray()  # before round 1, so every round's variants run beside the same Ray processes
            repeats = args.repeats or SIZE_DEFAULTS[args.model]["repeats"]
            report = overhead_report(setup=setup, variants=variants, repeats=repeats, storage_dir=scratch)
        warning = drift_warning(report["machine_drift"])
        if warning:
            say(warning, stderr=True)
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def bench_checkpoint(args: argparse.Namespace) -> dict[str, Any]:
    from raytrain_fast.bench.checkpoint import measure_checkpoint_blocking
    from raytrain_fast.storage import StorageConfig

    server = None
    try:
        if args.storage is None:
            from raytrain_fast.bench.s3_server import S3Server

            server = S3Server().start()
            os.environ.update(server.env)
            bucket = server.make_bucket("raytrain-fast-bench")
            storage = StorageConfig(uri=f"s3://{bucket}/bench", endpoint_url=server.endpoint_url)
        else:
            storage = StorageConfig(uri=args.storage, endpoint_url=args.endpoint_url)
        return measure_checkpoint_blocking(
            storage=storage, checkpoint_mb=args.checkpoint_mb, num_workers=args.num_workers,
            num_checkpoints=args.checkpoints, seconds_between=args.seconds_between,
        )
    finally:
        if server is not None:
            server.stop()
