"""`raytrain-fast evaluate`: multiple-choice tasks on a run's checkpoint (--storage, --name, --step) or
on a Hugging Face model directory (--hf), printed as a table or as JSON (--json, with every item's
choice and log-likelihoods). Everything that can be wrong with the input is found before the model
is built or a worker starts."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from raytrain_fast.console import say
from raytrain_fast.downstream.encode import encode_tasks, skipped_note
from raytrain_fast.downstream.tasks import STANDARD_TASKS, TaskError, load_tasks

DEFAULT_MICRO_BATCH = 16
"""Sequences per forward pass where the model has no run of its own to take it from (--hf)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags besides the storage ones (cli.py adds those, --storage optional here)."""
    parser.add_argument("--name", default=None, help="run name (with --storage)")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    parser.add_argument("--hf", default=None, metavar="DIR", help="a Hugging Face model directory instead of a run (read offline through transformers)")
    parser.add_argument(
        "--tasks", nargs="+", default=None, metavar="TASK",
        help=f"standard tasks ({', '.join(STANDARD_TASKS)}) and .jsonl files of your own, space- or comma-separated "
        "(default: the run's eval.tasks, also for --hf of its export, else every standard task)",
    )
    parser.add_argument("--limit", type=int, default=None, metavar="N",
                        help="items per task, spread evenly over it (default: the run's eval.task_limit for its own tasks, else all)")
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="score on N Ray workers, each every N-th batch (default 1: this process)")
    parser.add_argument("--micro-batch", type=int, default=None, metavar="N",
                        help="sequences per forward pass (default: the run's evaluation micro-batch, else 16)")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default=None,
                        help="score in bf16 or fp32 (default: the run's training precision, as its loop scored; fp32 for --hf)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to score (auto: a GPU when there is one)")
    parser.add_argument("--tokenizer", default=None, help="(a run) the tokenizer.json to encode with instead of the one the run's data was made with")
    parser.add_argument("--json", action="store_true", help="print one JSON document: per-task results and every item's record")


def _checked(args: argparse.Namespace) -> None:
    if bool(args.hf) == bool(args.storage):
        raise TaskError("evaluate needs either --storage and --name (a run's checkpoint) or --hf DIR (a Hugging Face model directory)")
    if args.storage and not args.name:
        raise TaskError("evaluate --storage needs --name (the run); `raytrain-fast runs --storage ...` lists them")
    if args.hf and (args.step is not None or args.tokenizer):
        raise TaskError("--step and --tokenizer apply to a run's checkpoint, not to --hf")
    for flag, value in (("--limit", args.limit), ("--workers", args.workers), ("--micro-batch", args.micro_batch)):
        if value is not None and value < 1:
            raise TaskError(f"{flag} must be >= 1, got {value}")


def _task_specs(args: argparse.Namespace, run_eval: dict[str, Any]) -> tuple[list[str], int | None]:
    """(task specs, limit): --tasks, else the run's eval.tasks with its task_limit, else every standard task."""
    if args.tasks:
        return [t.strip() for spec in args.tasks for t in spec.split(",") if t.strip()], args.limit
    own = run_eval.get("tasks") or []
    if own:
        return list(own), args.limit if args.limit is not None else run_eval.get("task_limit")
    return list(STANDARD_TASKS), args.limit


def run_evaluate(args: argparse.Namespace, *, storage: Any, connect_ray: Callable[[], None]) -> str:
    """Evaluate as `args` asks; returns the results for the CLI to print (the table, or the JSON with --json)."""
    from raytrain_fast.downstream.evaluate import evaluate
    from raytrain_fast.downstream.models import from_checkpoint, from_hf_dir

    _checked(args)
    specs, limit = _task_specs(args, _run_eval_section(args, storage))
    tasks = load_tasks(specs, limit=limit)  # unknown names, missing or malformed files: before anything is loaded
    if args.hf:
        (source, encoder), step = from_hf_dir(args.hf, precision=args.precision), None
    else:
        source, encoder, step = from_checkpoint(
            storage_uri=args.storage, storage=storage, name=args.name, step=args.step, tokenizer=args.tokenizer,
            precision=args.precision,
        )
    encoded = encode_tasks(tasks, encoder)
    empty = [t.name for t in encoded if t.num_items == 0]
    if empty:
        raise TaskError(
            f"no item of {', '.join(empty)} fits the model's window of {encoder.window} tokens: leave the task out"
        )
    for note in skipped_note(encoded, encoder.window):
        say(note, stderr=args.json)  # with --json, stdout holds the JSON alone
    where = f"on {args.workers} Ray workers" if args.workers > 1 else "in this process"
    micro_batch = args.micro_batch or source.micro_batch or DEFAULT_MICRO_BATCH
    say(f"Evaluating {source.description} on {', '.join(t.name for t in encoded)} ({sum(t.num_items for t in encoded):,} items) {where}, "
        f"in {source.precision}, {micro_batch} sequences per forward pass.", stderr=args.json)
    result = evaluate(
        source, encoded, window=encoder.window, step=step, workers=args.workers, micro_batch=micro_batch,
        device=None if args.device == "auto" else args.device, connect_ray=connect_ray,
    )
    if args.json:
        return json.dumps(result.to_json(), indent=1)
    return (f"{result.table()}\nacc: the choice with the highest log-likelihood; acc_norm: per character; loglik: the right "
            f"choice's log-likelihood, mean per item; cut: contexts "
            f"cut from the left to the {encoder.window}-token window. --json adds every item's log-likelihoods.")


def _run_eval_section(args: argparse.Namespace, storage: Any) -> dict[str, Any]:
    """The run's eval section (for its own tasks): from its newest run config, or for --hf from the
    config.yaml `raytrain-fast export` wrote beside the weights; {} for none."""
    if args.tasks:
        return {}
    if args.hf:
        from raytrain_fast.checkpoint.export import exported_eval_section

        return exported_eval_section(args.hf)
    from raytrain_fast.report.load import newest_config

    config = newest_config(f"{args.storage.rstrip('/')}/{args.name}", storage) or {}
    section = config.get("eval")
    return section if isinstance(section, dict) else {}
