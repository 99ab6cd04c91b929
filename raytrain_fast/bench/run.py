"""`raytrain-fast bench {data,overhead,checkpoint}`: each prints one JSON object (with --json) of
ratios measured against a baseline in the same run, on this machine."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import uuid
from typing import Any


def add_parser(commands: Any) -> None:
    bench = commands.add_parser("bench", help="measure speed against a baseline in the same run (prints JSON with --json)")
    kinds = bench.add_subparsers(dest="bench", required=True)
    data = kinds.add_parser("data", help="data wait of the Ray Data ingest path vs a DataLoader(num_workers=0)")
    data.add_argument("--steps", type=int, default=300)
    data.add_argument("--rounds", type=int, default=3)
    overhead = kinds.add_parser("overhead", help="tokens/s of the full loop vs a bare PyTorch loop and a typical Ray Train loop")
    overhead.add_argument("--steps", type=int, default=60, help="timed steps per variant and repeat")
    overhead.add_argument("--repeats", type=int, default=3)
    checkpoint = kinds.add_parser("checkpoint", help="time training is blocked per checkpoint, async vs sync upload")
    checkpoint.add_argument("--storage", default=None, help="s3://bucket/prefix (default: a loopback S3 server started here)")
    checkpoint.add_argument("--endpoint-url", default=None)
    checkpoint.add_argument("--checkpoint-mb", type=float, default=200.0)
    checkpoint.add_argument("--num-workers", type=int, default=2)
    checkpoint.add_argument("--checkpoints", type=int, default=3, help="checkpoints per mode (the median is reported)")
    checkpoint.add_argument(
        "--seconds-between", type=float, default=20.0,
        help="training time between checkpoints; async only helps when the upload fits into it",
    )
    for parser in (data, overhead, checkpoint):
        parser.add_argument("--json", action="store_true", help="print only the JSON object")


def run(args: argparse.Namespace) -> int:
    if args.bench == "data":
        from raytrain_fast.bench.data import bench_data

        report = bench_data(steps=args.steps, rounds=args.rounds, verbose=not args.json)
    elif args.bench == "overhead":
        report = bench_overhead(steps=args.steps, repeats=args.repeats)
    else:
        report = bench_checkpoint(args)
    print(json.dumps(report, indent=None if args.json else 2, default=str))
    return 0


def raytrain_fast_tokens_per_sec(*, steps: int, warmup_steps: int, micro_batch: int, seq_len: int, storage_dir: str) -> float:
    """The package's full loop (Ray worker, ingest, metrics with JSONL + W&B offline sinks,
    checkpoints at the default cadence) on the tiny preset, 1 worker; tokens/s after warm-up,
    read back from the run's own JSONL metrics."""
    from raytrain_fast.config import load_config
    from raytrain_fast.launch.trainer import run as run_training
    from raytrain_fast.metrics.sinks import read_metrics

    log_every = 10
    total = warmup_steps + steps
    name = f"bench-overhead-{uuid.uuid4().hex[:8]}"
    config = load_config("tiny", [
        f"train.steps={total}", f"train.log_every={log_every}", f"train.micro_batch={micro_batch}",
        f"train.global_batch={micro_batch}", f"data.seq_len={seq_len}", f"storage.uri={storage_dir}",
        "metrics.wandb=true", "metrics.wandb_mode=offline", "optim.warmup_steps=1",
    ], name=name)
    os.environ.setdefault("WANDB_SILENT", "true")
    run_training(config)
    records = [r for r in read_metrics(f"{storage_dir}/{name}") if r.get("step", 0) > warmup_steps and "throughput/tokens_per_sec" in r]
    if not records:
        raise RuntimeError("the run logged no throughput after warm-up")
    # Windows are log_every steps long; the checkpoint at the end falls inside the last one.
    return statistics.median(r["throughput/tokens_per_sec"] for r in records)


def bench_overhead(*, steps: int, repeats: int) -> dict[str, Any]:
    import ray

    from raytrain_fast.bench.overhead import OverheadSetup, overhead_report

    setup = OverheadSetup(steps=steps).resolved()
    scratch = tempfile.mkdtemp(prefix="raytrain-fast-bench-")
    try:
        if not ray.is_initialized():
            ray.init(configure_logging=False, include_dashboard=False)
        report = overhead_report(
            setup=setup, repeats=repeats,
            raytrain_fast=lambda: raytrain_fast_tokens_per_sec(
                steps=setup.steps, warmup_steps=setup.warmup_steps, micro_batch=setup.micro_batch,
                seq_len=setup.seq_len, storage_dir=scratch,
            ),
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    flat = {f"tokens_per_sec_{name}": summary["median"] for name, summary in report["variants"].items()}
    flat["tokens_per_sec_typical_ray_train"] = flat.pop("tokens_per_sec_typical_ray_train", None)
    return {**flat, **report["ratios"], "detail": report}


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
