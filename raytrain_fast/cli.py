"""Fast, fault-tolerant pretraining of decoder-only language models (the GPT and Llama families) on Ray
Train + DeepSpeed ZeRO-2: train (resuming where a run stopped), list runs and their checkpoints, export
weights, evaluate on multiple-choice tasks, report on a run, prepare data, train a tokenizer, sweep
micro-batches and benchmark. `raytrain-fast <command> --help` shows a command's options."""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import traceback

from raytrain_fast.console import add_command
from raytrain_fast.errors import ConfigError, RaytrainFastError

EXIT_OK = 0
EXIT_FAILED = 1
"""An unexpected internal error (a bug: run with --debug and report the traceback), or a sweep with no finished trial."""
EXIT_ERROR = 2
"""Bad input or an unusable environment: the message names the problem and the fix."""
EXIT_INCOMPLETE_CHECKPOINTS = 3
"""`runs` listed at least one incomplete or corrupt checkpoint."""
EXIT_INTERRUPTED = 130
"""Ctrl-C outside a training run (the shell's 128 + SIGINT)."""


def _add_config_args(parser: argparse.ArgumentParser, *, name_help: str) -> None:
    parser.add_argument("--config", default=None, help="preset name (tiny, gpt-124m, gpt-350m, gpt-1.3b, llama-tiny, llama-150m, llama-1b, llama-3b, llama-8b) or YAML file; default: tiny")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="override one config value, e.g. --set train.steps=500 (repeatable)",
    )
    parser.add_argument("--name", default=None, help=name_help)


def _add_s3_args(parser: argparse.ArgumentParser, *, endpoint_help: str) -> None:
    parser.add_argument("--endpoint-url", default=None, help=endpoint_help)
    parser.add_argument("--region", default=None, help="S3 region (default: the AWS profile's or AWS_REGION)")
    parser.add_argument("--profile", default=None, help="named AWS profile for credentials (default: the usual AWS "
                        "chain: environment, ~/.aws, instance role)")


def _add_storage_args(parser: argparse.ArgumentParser, *, required: bool = True) -> None:
    parser.add_argument("--storage", required=required, help="storage URI: a local directory or s3://bucket/prefix")
    _add_s3_args(parser, endpoint_help="S3-compatible endpoint, e.g. http://127.0.0.1:9000")
    parser.add_argument(
        "--request-checksums", choices=("auto", "when_supported", "when_required"), default="auto",
        help="S3 upload checksums (storage.request_checksums); auto = when_required with --endpoint-url",
    )


DRILL_NAMES = ("fail_once_at", "record_sequences", "slow_data", "slow_step", "slow_sink", "slow_upload", "cpu_burn",
               "hold_memory", "hang", "nonfinite", "spike")
"""drills.specs.PARSERS' names, listed without importing the drills (tests/test_printed_commands.py checks the help lists them all)."""
PRETRAIN_EPILOG = """\
the data (data.source; default: stdlib, this Python's standard library source):
  --set data.source=./texts             a text, JSONL or Parquet file, directory or glob, prepared on the fly
  --set data.source=./prepared          a dataset made by `raytrain-fast prepare-data` (or an s3:// URI)
  --set data.text_field=content         the JSONL field or Parquet column of the text (default: text)
  --set 'data.sources=[{source: ./a, weight: 0.7}, {source: ./b, weight: 0.3}]'   a weighted mixture
config keys:
  raytrain-fast show-config --reference   every key, its default and what it does
  raytrain-fast show-config [--config PRESET] [--set ...]   the resolved config, validated, without running
  docs: docs/configuration.md (presets, --set), docs/data.md (data.source, prepare-data, mixtures)"""
TEXT_FIELD_HELP = ("the JSONL field or Parquet column that holds each document's text (default: text); several names, "
                   "comma-separated (content,text), take the first each record or file has")


def _storage_config(args: argparse.Namespace, uri: str):
    """The S3 options of a command, for storage at `uri`."""
    from raytrain_fast import StorageConfig

    return StorageConfig(
        uri=uri, endpoint_url=args.endpoint_url, region=args.region, profile=args.profile,
        request_checksums=getattr(args, "request_checksums", "auto"),
    )


def _readable_storage(args: argparse.Namespace):
    """The --storage of runs / export / report, checked to exist and answer within seconds."""
    from raytrain_fast.storage import check_storage_readable

    storage = _storage_config(args, args.storage)
    check_storage_readable(args.storage, storage)
    return storage


def _resume_policy(value: str) -> str:
    if value in ("auto", "must", "never") or value.isdigit():
        return value
    raise argparse.ArgumentTypeError(f"expected auto, must, never or a checkpoint's step, got {value!r}")


def _add_export_args(export: argparse.ArgumentParser) -> None:
    export.add_argument("--name", required=True, help="run name")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    export.add_argument("--out", required=True, help="local output directory")
    export.add_argument("--dtype", choices=("float32", "fp32", "bfloat16", "bf16"), default="float32",
                        help="weights dtype (both spellings: the config's fp32/bf16 and torch's float32/bfloat16)")
    export.add_argument("--overwrite", action="store_true", help="replace an export already in --out")
    export.add_argument("--format", choices=("auto", "hf", "native"), default="auto",
                        help="hf: config.json, safetensors and tokenizer files for transformers' from_pretrained; "
                             "native: model.safetensors + config.yaml for load_exported; auto (default): hf for llama, native for gpt")
    export.add_argument("--tokenizer", default=None,
                        help="(hf) export this tokenizer.json instead of the one the run's data was tokenized with")
    export.add_argument("--max-shard-gb", type=float, default=5.0,
                        help="(hf) split the weights into shards of at most this many GB, with model.safetensors.index.json")


def _add_prepare_args(prepare: argparse.ArgumentParser) -> None:
    prepare.add_argument("--input", nargs="+", required=True, metavar="PATH_OR_GLOB", help="text, JSONL or Parquet files (.gz/.zst too), directories, globs or s3:// URIs")
    prepare.add_argument("--output", required=True, help="output directory or s3:// URI")
    prepare.add_argument("--seq-len", type=int, required=True, help="tokens per training sequence (rows hold seq_len + 1)")
    prepare.add_argument("--tokenizer", default="byte", help="'byte', a path to a HuggingFace tokenizer.json, or a directory holding one (an HF model dir, train-tokenizer's output)")
    prepare.add_argument("--overwrite", action="store_true", help="replace an output that was prepared from other inputs")
    prepare.add_argument(
        "--val-fraction", type=float, default=None, metavar="F",
        help="share of documents held out for validation, chosen by content hash, in (0, 0.5] (default 0.005; capped at ~8M tokens)",
    )
    prepare.add_argument("--val-input", nargs="+", default=None, metavar="PATH_OR_GLOB", help="a separate validation corpus instead of --val-fraction")
    prepare.add_argument("--text-field", default="text", metavar="NAME", help=TEXT_FIELD_HELP)
    _add_s3_args(prepare, endpoint_help="S3-compatible endpoint for s3:// inputs/outputs")


def _add_sweep_args(sweep: argparse.ArgumentParser) -> None:
    sweep.add_argument("--micro-batch", required=True, metavar="M1,M2,...", help="micro-batches per worker to try, e.g. 1,2,4,8,16")
    sweep.add_argument(
        "--activation-checkpointing", default=None, metavar="V1,V2,...",
        help="model.activation_checkpointing values to try with each micro-batch (none, full, every_n), e.g. none,full "
        "(default: the config's own)",
    )
    sweep.add_argument("--steps", type=int, default=30, help="optimizer steps per trial (default 30)")
    sweep.add_argument("--objective", choices=("tokens_per_sec", "loss", "val_loss"), default="tokens_per_sec", help="what the best trial maximises / minimises (val_loss: evaluates every window)")
    sweep.add_argument("--sweep-name", default=None, help="directory of the results under storage.uri (default: <run name>-sweep)")
    sweep.add_argument("--best-out", default=None, help="local file for the best config (default: in the results when storage is local, else ./<sweep>-best.yaml)")
    sweep.add_argument("--create-bucket", action="store_true", help="create the S3 bucket of storage.uri if it is missing")


def _add_train_tokenizer_args(train_tok: argparse.ArgumentParser) -> None:
    train_tok.add_argument("--input", nargs="+", required=True, metavar="PATH_OR_GLOB", help="text, JSONL or Parquet files, directories, globs or s3:// URIs (as prepare-data's)")
    train_tok.add_argument("--output", required=True, help="local directory for tokenizer.json, tokenizer_config.json and special_tokens_map.json")
    train_tok.add_argument("--vocab-size", type=int, default=32000, metavar="N",
                           help="tokens in the vocabulary, the end-of-document token included (default 32000; at least 258); "
                                "fewer when the corpus has fewer pairs to merge")
    train_tok.add_argument("--min-frequency", type=int, default=2, metavar="N", help="merge only pairs seen at least N times (default 2)")
    train_tok.add_argument("--eod-token", default="<|endoftext|>", metavar="TOKEN",
                           help="the end-of-document token, id 256 (default <|endoftext|>, as the byte tokenizer's export; also </s>, <eos>, ...)")
    train_tok.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --output")
    train_tok.add_argument("--text-field", default="text", metavar="NAME", help=TEXT_FIELD_HELP)
    _add_s3_args(train_tok, endpoint_help="S3-compatible endpoint for s3:// inputs")


def _version() -> str:
    """The installed version; a source tree on PYTHONPATH without `pip install` has no metadata, and
    every command would fail on it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("raytrain_fast")
    except PackageNotFoundError:
        return "(not installed: running from a source tree)"


def _add_pretrain(commands) -> None:
    pretrain = add_command(commands, "pretrain", "train a decoder-only LM (a GPT or Llama preset) on Ray (local by default; "
                           "resumes a run of the same name)")
    pretrain.epilog = PRETRAIN_EPILOG
    pretrain.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_config_args(pretrain, name_help="run name; the same name resumes the run (default: the preset's name)")
    pretrain.add_argument(
        "--resume", type=_resume_policy, default=None, metavar="{auto,must,never,STEP}",
        help="auto: continue the run if it has a complete checkpoint (default); must: fail if none; never: fail if one exists; "
        "STEP: continue from that step's checkpoint, the later ones set aside (checkpoint.resume)",
    )
    pretrain.add_argument("--create-bucket", action="store_true", help="create the S3 bucket of storage.uri if it is missing")
    pretrain.add_argument(
        "--drill", action="append", default=[], metavar="NAME=SPEC",
        help="plant a problem to see how metrics and the report name it, e.g. slow_data=0.2 or fail_once_at=50:/tmp/m "
        f"(names: {', '.join(DRILL_NAMES)}; see docs/development.md#drills)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-fast", description=__doc__)
    parser.add_argument("--version", action="version", version=f"raytrain-fast {_version()}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of an error (any position)")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_pretrain(commands)

    runs = add_command(commands, "runs", "list the runs under a storage URI, their checkpoints, steps and completeness")
    _add_storage_args(runs)
    runs.add_argument("--checksums", action="store_true", help="also verify every file's checksum (reads every byte)")

    export = add_command(commands, "export", "write a checkpoint's consolidated model weights (safetensors) and model config")
    _add_storage_args(export)
    _add_export_args(export)

    report = add_command(commands, "report", "plots, an HTML page and a plain-language diagnosis of a run's metrics")
    _add_storage_args(report)
    report.add_argument("--name", required=True, help="run name")
    report.add_argument("--out", default=None, help="local output directory (default: ./<name>-report)")

    from raytrain_fast.downstream.command import add_arguments as add_evaluate_arguments

    evaluate = add_command(commands, "evaluate", "score multiple-choice tasks (ARC, HellaSwag, your own JSONL) on a run's checkpoint or a Hugging Face model")
    _add_storage_args(evaluate, required=False)
    add_evaluate_arguments(evaluate)

    prepare = add_command(commands, "prepare-data", "tokenize and pack text files into Parquet shards plus a manifest")
    _add_prepare_args(prepare)

    train_tok = add_command(
        commands, "train-tokenizer", "train a byte-level BPE tokenizer on the inputs prepare-data takes; writes a Hugging Face tokenizer directory",
    )
    _add_train_tokenizer_args(train_tok)

    from raytrain_fast.bench.run import add_parser as add_bench_parser

    add_bench_parser(commands)
    sweep = add_command(
        commands, "sweep", "Ray Tune sweep of micro-batch x grad accumulation at the config's global batch; writes the best config",
    )
    _add_config_args(sweep, name_help="run name of the best config it writes; results go to <name>-sweep unless --sweep-name (default: the preset's name)")
    _add_sweep_args(sweep)
    show = add_command(commands, "show-config", "print the resolved config as YAML, without running")
    _add_config_args(show, name_help="run name to show in the config, as pretrain --name sets it (default: the preset's name)")
    show.add_argument("--reference", action="store_true", help="print the reference of every config key (Markdown) instead")
    return parser


def _settle_worker_output() -> None:
    """The workers' last lines before the closing block, not after it: Ray forwards them
    asynchronously and holds repeated lines back (log deduplication) until it disconnects, which
    would be at exit. So wait for the stream to go quiet, then disconnect now: that prints what was
    held back. Nothing to wait for where this process started no Ray."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return
    from raytrain_fast.console import wait_for_quiet

    wait_for_quiet()
    ray.shutdown()


def pretrain(args: argparse.Namespace) -> int:
    from raytrain_fast import load_config, parse_drills
    from raytrain_fast import pretrain as run

    overrides = list(args.overrides) + ([f"checkpoint.resume={args.resume}"] if args.resume else [])
    config = load_config(args.config, overrides, name=args.name)
    try:
        hooks = parse_drills(args.drill)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if hooks.active():
        print(f"Drills on: {', '.join(hooks.active())}", flush=True)
    result = run(config, create_bucket=args.create_bucket, hooks=hooks)
    _settle_worker_output()
    stopped = result.stopped_by
    print(f"\n{f'Stopped by {stopped}' if stopped else 'Done'}. Run directory: {result.run_dir}")
    print(f"Latest checkpoint: {result.checkpoint or 'none'}")
    if stopped:
        print(f"Continue this run: the same command with --name {result.name}")
        return 128 + int(getattr(signal, stopped))  # the shell's convention for "ended by a signal"
    print(f"Continue this run: same command with --name {result.name} (raise train.steps to train further)")
    return 0


def sweep(args: argparse.Namespace) -> int:
    from raytrain_fast import SweepSpec, load_config, run_sweep

    try:
        micro_batches = [int(v) for v in args.micro_batch.replace(" ", "").split(",") if v]
    except ValueError:
        raise ConfigError(f"--micro-batch '{args.micro_batch}': expected comma-separated integers, e.g. 1,2,4,8") from None
    checkpointing = None
    if args.activation_checkpointing is not None:  # checked by run_sweep, before Ray starts
        checkpointing = [v for v in args.activation_checkpointing.replace(" ", "").split(",") if v]
    config = load_config(args.config, args.overrides, name=args.name)
    spec = SweepSpec(
        micro_batches=micro_batches, activation_checkpointing=checkpointing, steps=args.steps, objective=args.objective,
        name=args.sweep_name, best_config_out=args.best_out,
    )
    result = run_sweep(config, spec, create_bucket=args.create_bucket)
    _settle_worker_output()
    print(f"\nSweep '{result.name}' ({result.max_concurrent_trials} trial(s) at a time):\n{result.table}")
    print(f"Results: {', '.join(result.files.values())}")
    if result.best is None:
        print("No trial ran to the end: see the reasons above.")
        return 1
    swept = f", activation_checkpointing={result.best.activation_checkpointing}" if checkpointing is not None else ""
    print(f"Best: micro_batch={result.best.micro_batch}, grad_accum={result.best.grad_accum}{swept}"
          + (f" ({result.unresolved})" if result.unresolved else "") + ".")
    print(f"Train with: raytrain-fast pretrain --config {shlex.quote(result.best_config_path)}")
    return 0


def show_config(args: argparse.Namespace) -> int:
    from raytrain_fast import load_config, validate
    from raytrain_fast.config import reference_markdown

    if args.reference:
        print(reference_markdown(), end="")
        return 0
    import yaml

    from raytrain_fast.storage import redact

    config = load_config(args.config, args.overrides, name=args.name)
    validate(config)
    print(yaml.safe_dump(redact(config.to_dict()), sort_keys=False), end="")  # as stored with checkpoints
    return 0


def runs(args: argparse.Namespace) -> int:
    from raytrain_fast import format_runs_table, list_runs

    found = list_runs(args.storage, _readable_storage(args), checksums=args.checksums)
    print(format_runs_table(found, storage_uri=args.storage))
    bad = [c for run in found for c in run.checkpoints if not c.complete]
    if bad:
        _error(f"{len(bad)} checkpoint(s) incomplete or corrupt (exit code {EXIT_INCOMPLETE_CHECKPOINTS}): a run "
               "resumes from its newest complete one; delete the others once no run is writing them.")
        return EXIT_INCOMPLETE_CHECKPOINTS
    return EXIT_OK


def export(args: argparse.Namespace) -> int:
    from pathlib import Path

    import yaml

    from raytrain_fast import export_checkpoint

    out = export_checkpoint(
        storage_uri=args.storage, storage=_readable_storage(args), name=args.name, step=args.step,
        out_dir=args.out, dtype=args.dtype, overwrite=args.overwrite, format=args.format,
        tokenizer=args.tokenizer, max_shard_bytes=int(args.max_shard_gb * 10**9),
    )
    info = yaml.safe_load(Path(out, "config.yaml").read_text())["export"]
    files = ", ".join(info.get("files", ["model.safetensors", "config.yaml"]))
    print(f"Exported run '{args.name}' at step {info['step']} to {out} ({files}).")
    for skipped in info.get("skipped", []):
        print(f"Skipped the newer {skipped['checkpoint']}: {skipped['reason']}")
    if info.get("format") == "hf":
        print(f"Load it with: from transformers import AutoModelForCausalLM, AutoTokenizer; "
              f"model = AutoModelForCausalLM.from_pretrained({out!r}); tokenizer = AutoTokenizer.from_pretrained({out!r})")
    else:
        print("Load it with: from raytrain_fast import load_exported; model = load_exported(" + repr(out) + ")")
    return 0


def report(args: argparse.Namespace) -> int:
    from raytrain_fast import make_report

    result = make_report(args.storage, args.name, out_dir=args.out or f"{args.name}-report", storage=_readable_storage(args))
    print(result.text)
    print(f"\nReport: {result.html_path} ({len(result.pngs)} plots in {result.out_dir})")
    return 0


def evaluate(args: argparse.Namespace) -> int:
    from raytrain_fast.downstream.command import run_evaluate
    from raytrain_fast.launch.ray_address import ensure_ray

    print(run_evaluate(args, storage=_readable_storage(args) if args.storage else None, connect_ray=ensure_ray))
    return 0


def prepare_data(args: argparse.Namespace) -> int:
    from raytrain_fast import prepare_data as prepare
    from raytrain_fast.storage import check_uri

    if args.seq_len < 1:
        raise ConfigError(f"--seq-len must be >= 1 (tokens per training sequence), got {args.seq_len}; e.g. --seq-len 128")
    for uri, setting in [(args.output, "--output"), *((item, "--input") for item in args.input)]:
        check_uri(uri, setting=setting)
    storage = _storage_config(args, args.output)
    manifest = prepare(
        inputs=args.input, output=args.output, seq_len=args.seq_len, tokenizer=args.tokenizer,
        storage=storage, overwrite=args.overwrite, val_fraction=args.val_fraction, val_inputs=args.val_input,
        text_field=args.text_field,
    )
    from raytrain_fast.next_steps import train_command

    held_out = f" (+ {manifest.validation.num_sequences:,} held out for validation)" if manifest.validation else " (no validation split)"
    print(f"Prepared {manifest.num_sequences:,} sequences of {args.seq_len + 1} tokens in {args.output}{held_out}")
    s3 = {"endpoint_url": args.endpoint_url, "region": args.region, "profile": args.profile}
    print(f"Train on it: {train_command(data=args.output, seq_len=args.seq_len, vocab_size=manifest.tokenizer.vocab_size, num_sequences=manifest.num_sequences, storage=s3)}")
    return 0


def train_tokenizer(args: argparse.Namespace) -> int:
    from raytrain_fast import train_tokenizer as train
    from raytrain_fast.storage import check_uri

    for uri in args.input:
        check_uri(uri, setting="--input")
    storage = _storage_config(args, args.output)
    result = train(
        inputs=args.input, output=args.output, vocab_size=args.vocab_size, min_frequency=args.min_frequency,
        eod_token=args.eod_token, storage=storage, overwrite=args.overwrite, text_field=args.text_field,
    )
    from raytrain_fast.next_steps import model_vocab_size, prepare_command

    command = prepare_command(inputs=args.input, output=args.output.rstrip("/") + "-data", tokenizer=args.output,
                              text_field=args.text_field)
    print(f"Prepare data with it: {command}")
    print(f"(--seq-len 128 is the tiny preset's window; give your model's data.seq_len for another. prepare-data then "
          f"prints the command that trains on it, with model.vocab_size={model_vocab_size(result.vocab_size)}: "
          f"the {result.vocab_size:,} tokens, padded to a multiple of 64.)")
    return 0


def bench(args: argparse.Namespace) -> int:
    import json

    from raytrain_fast.bench.run import run as run_bench

    print(json.dumps(run_bench(args), indent=None if args.json else 2, default=str))
    return 0


def _error(message: str) -> None:
    sys.stdout.flush()  # what stdout holds (a pipe's buffer) comes before the error, as it happened
    print(f"raytrain-fast: error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """The command line. argv None = this process's arguments (the `raytrain-fast` program): a
    storage probe still blocked after an error or Ctrl-C then ends the process at once."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # accepted anywhere, also after the subcommand
    argv = [a for a in argv if a != "--debug"]
    from raytrain_fast.console import ConsoleStream

    streams = sys.stdout, sys.stderr  # every printout below is redacted; colour only on a terminal
    sys.stdout, sys.stderr = ConsoleStream(sys.stdout), ConsoleStream(sys.stderr)
    try:
        code = _run(argv, debug=debug)
    finally:
        sys.stdout, sys.stderr = streams
    from raytrain_fast.storage.probe import probe_still_running

    if as_program and probe_still_running():
        if debug:
            print("raytrain-fast: a storage probe was still waiting; ended without waiting for it", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # pyarrow's exit handler would wait for the abandoned request
    return code


def _run(argv: list[str], *, debug: bool) -> int:
    from raytrain_fast.console import configure_console

    args = build_parser().parse_args(argv)
    configure_console()
    handlers = {
        "pretrain": pretrain, "show-config": show_config, "runs": runs, "export": export,
        "prepare-data": prepare_data, "train-tokenizer": train_tokenizer, "bench": bench, "sweep": sweep,
        "report": report, "evaluate": evaluate,
    }
    try:
        return handlers[args.command](args)
    except KeyboardInterrupt:
        _error("interrupted")
        return EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - one line, the traceback on request
        if debug:
            traceback.print_exc()
        if isinstance(error, RaytrainFastError):
            _settle_worker_output()  # a worker's error: its last lines before this one
            _error(str(error))
            return EXIT_ERROR
        if isinstance(error, OSError):  # storage or files, past the checks: still the user's environment
            _error(f"{error.strerror or error}{f': {error.filename}' if error.filename else ''} "
                   "(run with --debug for the traceback)")
            return EXIT_ERROR
        _error(f"unexpected {type(error).__name__}: {error}. Run again with --debug for the traceback and report it.")
        return EXIT_FAILED  # a bug


if __name__ == "__main__":
    sys.exit(main())
