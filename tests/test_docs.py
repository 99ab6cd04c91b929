"""The docs' promises: the README's commands are what CI runs, every `raytrain-fast` command shown in
README.md and docs/*.md exists with those flags and passes validation, the generated config reference
and the metric table are current, and every link lands on a page and heading that exist."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import textwrap
from pathlib import Path

import pytest

from raytrain_fast.cli import build_parser, main
from raytrain_fast.config import presets, reference_markdown, resolve_config_path
from raytrain_fast.metrics.names import METRICS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_BYTES = 15 * 1024  # the first hour's path; everything else belongs in docs/
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", ""}

# Example values that stand for the reader's own files, and what the test puts in their place so
# that `show-config` can validate the example (it checks that data.source and --config files exist).
# s3:// URIs, endpoints and checkpoint paths need no stand-in: show-config never contacts storage.
PLACEHOLDERS = {
    "$PWD": str(ROOT),
    "/path/to/texts": "{texts}",  # a directory of text files
    "/path/to/prepared-or-texts": "{texts}",
    "./data/corpus-1024": "{texts}",  # prepare-data's output in docs/data.md
    "my.yaml": "{config_file}",  # the reader's own config file
}


def bash_blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", README, flags=re.S)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block, indented ones (inside list items) included."""
    blocks = re.findall(r"^( *)```(\w*)\n(.*?)^\1```", text, flags=re.S | re.M)
    return [(language, textwrap.dedent(body)) for _, language, body in blocks]


def shell_lines(body: str) -> list[str]:
    """Commands of a shell block: `\\` continuations joined, comments dropped."""
    lines = []
    for line in body.replace("\\\n", " ").splitlines():
        line = re.sub(r"(^|\s+)#\s.*$", "", line).strip()
        if line:
            lines.append(line)
    return lines


def cli_words(line: str) -> list[list[str]]:
    """The `raytrain-fast` argument lists in one shell line: `raytrain-fast ...` after any `&&`, `;`
    or `|`, with leading VAR=value assignments, and the `jobs/*.py` entry points (`ray job submit
    ... -- python jobs/pretrain.py ...` runs `raytrain-fast pretrain ...`)."""
    found = []
    segment: list[str] = []
    for word in [*shlex.split(line), ";"]:
        if word not in ("&&", "||", ";", "|", "&"):
            segment.append(word)
            continue
        while segment and re.match(r"^[A-Za-z_]\w*=", segment[0]):
            segment.pop(0)
        if segment[:1] == ["raytrain-fast"]:
            found.append(segment[1:])
        for job, command in (("jobs/pretrain.py", "pretrain"), ("jobs/sweep.py", "sweep")):
            if job in segment:
                found.append([command, *segment[segment.index(job) + 1:]])
        segment = []
    return found


def synopsis_lines(body: str) -> list[str]:
    """Usage lines of a text block (`raytrain-fast sweep --micro-batch ... [--steps N]`), with their
    indented continuation lines joined. Other lines of text blocks are output, not commands."""
    lines: list[str] = []
    continues = False
    for line in body.splitlines():
        if line.startswith("raytrain-fast "):
            lines.append(line)
            continues = True
        elif continues and line.startswith(" ") and line.strip().startswith("["):
            lines[-1] += " " + line.strip()
        else:
            continues = False
    return lines


def example_commands() -> list[tuple[str, list[str]]]:
    """(where, argument list) of every `raytrain-fast` command in a shell code block of the docs."""
    found = []
    for page in PAGES:
        for language, body in fenced_blocks(page.read_text()):
            if language not in SHELL_LANGUAGES:
                continue
            for line in shell_lines(body):
                for words in cli_words(line):
                    found.append((f"{page.relative_to(ROOT)}: {line}", words))
    return found


def example_synopses() -> list[tuple[str, str]]:
    return [
        (f"{page.relative_to(ROOT)}: {line}", line)
        for page in PAGES
        for language, body in fenced_blocks(page.read_text())
        if language == "text"
        for line in synopsis_lines(body)
    ]


COMMANDS = example_commands()
SYNOPSES = example_synopses()


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


@pytest.fixture(scope="module")
def placeholder_values(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("doc-placeholders")
    texts = tmp / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("Some text to train on.\n")
    config_file = tmp / "my.yaml"
    shutil.copy(presets()["tiny"], config_file)
    return {"texts": str(texts), "config_file": str(config_file)}


def substitute(words: list[str], values: dict[str, str]) -> list[str]:
    def one(word: str) -> str:
        for placeholder, stand_in in PLACEHOLDERS.items():
            value = stand_in.format(**values)
            word = re.sub(rf"(?<![\w/.-]){re.escape(placeholder)}(?![\w.-])", lambda _: value, word)
        return word

    return [one(word) for word in words]


def test_readme_starts_with_the_run_and_the_test_command():
    run_command, test_command = (block.strip() for block in bash_blocks()[:2])
    assert run_command.endswith("raytrain-fast pretrain") and "constraints-cpu.txt" in run_command
    assert test_command.endswith("pytest") and '".[test]"' in test_command


def test_ci_runs_the_readme_test_command():
    test_command = bash_blocks()[1].strip()
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines


def test_readme_stays_a_first_hour_page():
    size = len(README.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes (limit {README_MAX_BYTES}): move detail into docs/"


def test_config_reference_in_docs_is_current():
    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text.split("<!-- config-reference:start", 1)[1].split("<!-- config-reference:end -->", 1)[0]
    table = section.split("\n", 1)[1]
    assert table == reference_markdown(), "regenerate with: raytrain-fast show-config --reference"


def test_every_metric_is_in_the_metric_table():
    text = (ROOT / "docs" / "metrics.md").read_text()
    missing = [name for name in METRICS if f"| `{name}` |" not in text]
    assert not missing, f"docs/metrics.md has no table row for {missing}"


def test_docs_show_commands():
    # Guards the collectors below: a change in the fence or line format must not make them vacuous.
    commands = {words[0] for _, words in COMMANDS}
    assert {"pretrain", "runs", "export", "report", "prepare-data", "sweep", "bench", "show-config"} <= commands
    assert any(words[0] == "pretrain" and "jobs/pretrain.py" in where for where, words in COMMANDS)
    assert {line.split()[1] for _, line in SYNOPSES} >= {"pretrain", "sweep", "runs", "export", "report"}


@pytest.mark.parametrize("where, words", COMMANDS, ids=[where for where, _ in COMMANDS])
def test_doc_command_parses_and_validates(where, words, placeholder_values, capsys):
    words = substitute(words, placeholder_values)
    unknown = [word for word in words if re.search(r"<[\w ]+>", word)]
    assert not unknown, f"{where}: placeholder {unknown}: add a stand-in to PLACEHOLDERS"
    try:
        args = build_parser().parse_args(words)
    except SystemExit:
        pytest.fail(f"{where}: argparse rejected it: {capsys.readouterr().err.strip()}")
    if getattr(args, "config", None) is not None:
        resolve_config_path(args.config)  # a preset or a file that exists (ConfigError otherwise)
    if args.command in ("pretrain", "sweep"):
        # The same config arguments through `show-config`, which validates without running;
        # pretrain's --resume is the config key it stands for.
        shown = ["show-config", *([] if args.config is None else ["--config", args.config])]
        shown += [part for override in args.overrides for part in ("--set", override)]
        if getattr(args, "resume", None):
            shown += ["--set", f"checkpoint.resume={args.resume}"]
        shown += [] if args.name is None else ["--name", args.name]
        status = main(shown)
        assert status == 0, f"{where}: fails validation: {capsys.readouterr().err.strip()}"


@pytest.mark.parametrize("where, line", SYNOPSES, ids=[where for where, _ in SYNOPSES])
def test_doc_synopsis_names_real_subcommands_and_flags(where, line):
    words = line.split()
    parser = subparsers(build_parser())[words[1]]
    if words[1] == "bench":
        parser = subparsers(parser)[words[2]]
    flags = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", line))
    unknown = flags - option_strings(parser)
    assert not unknown, f"{where}: `raytrain-fast {words[1]}` has no {sorted(unknown)}"


def test_readme_command_table_lists_every_subcommand():
    section = README.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `raytrain-fast ([\w-]+)` \|", section, flags=re.M)
    assert sorted(listed) == sorted(subparsers(build_parser())), "one row per subcommand, in README's ## Commands"


def test_readme_links_every_docs_page():
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)(?:#[\w-]+)?\)", README))
    pages = {str(page.relative_to(ROOT)) for page in PAGES[1:]}
    assert pages <= linked, f"README does not link {sorted(pages - linked)}"


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', '-1' on repeats."""
    outside_code = re.sub(r"^( *)```.*?^\1```", "", text, flags=re.S | re.M)
    seen: dict[str, int] = {}
    result = set()
    for heading in re.findall(r"^#{1,6} (.+)$", outside_code, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_land_on_pages_and_headings_that_exist(page):
    text = page.read_text()
    outside_code = re.sub(r"^( *)```.*?^\1```", "", text, flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", outside_code):
        if re.match(r"^[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert anchor in anchors(linked.read_text()), f"{page.name}: link to {target}: no such heading"


def test_constraints_pin_the_cpu_torch():
    assert "torch==2.13.0" in (ROOT / "constraints-cpu.txt").read_text()
