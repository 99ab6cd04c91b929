"""`raytrain-fast` command line."""

from __future__ import annotations

import argparse
import sys

from raytrain_fast.errors import RaytrainFastError


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="preset name (tiny, gpt2-124m, gpt-350m, gpt-1.3b) or YAML file; default: tiny")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
        help="override one config value, e.g. --set train.steps=500 (repeatable)",
    )
    parser.add_argument("--name", default=None, help="run name; the same name resumes the run (default: the preset's name)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raytrain-fast", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    pretrain = commands.add_parser("pretrain", help="train a GPT on Ray (local by default; resumes a run of the same name)")
    _add_config_args(pretrain)
    show = commands.add_parser("show-config", help="print the resolved config as YAML, without running")
    _add_config_args(show)
    show.add_argument("--reference", action="store_true", help="print the reference of every config key (Markdown) instead")
    return parser


def pretrain(args: argparse.Namespace) -> int:
    from raytrain_fast.config import load_config
    from raytrain_fast.launch.trainer import run

    config = load_config(args.config, args.overrides, name=args.name)
    result = run(config)
    print(f"\nDone. Run directory: {result.run_dir}")
    print(f"Latest checkpoint: {result.checkpoint or 'none'}")
    print(f"Continue this run: same command with --name {result.name} (raise train.steps to train further)")
    return 0


def show_config(args: argparse.Namespace) -> int:
    from raytrain_fast.config import load_config, reference_markdown, validate

    if args.reference:
        print(reference_markdown(), end="")
        return 0
    config = load_config(args.config, args.overrides, name=args.name)
    validate(config)
    print(config.to_yaml(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    handlers = {"pretrain": pretrain, "show-config": show_config}
    try:
        return handlers[args.command](args)
    except RaytrainFastError as error:
        print(f"raytrain-fast: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
