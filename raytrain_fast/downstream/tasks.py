"""Multiple-choice tasks as data: the standard tasks shipped in this package (data/*.jsonl.gz) and a
user's own JSONL files, read into `Task`s of `Item`s, with a clear error for every bad input.

An item is one question with its choices: each choice is a (context, continuation) pair whose
continuation the model scores given the context. Most tasks share one context among the choices
(`{"context": ..., "choices": [...], "gold": i}`); winogrande-style tasks give each choice its own
context and score the same continuation (`{"contexts": [...], "continuation": ..., "gold": i}`).
Continuations are scored as written, so the space between context and continuation belongs to the
continuation (" Paris"); a context's trailing spaces are moved to the start of its continuation.
"""

from __future__ import annotations

import difflib
import gzip
import json
from dataclasses import dataclass
from importlib import resources as package_files
from pathlib import Path

from raytrain_fast.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")

STANDARD_TASKS: dict[str, str] = {
    "arc_easy": "ARC-Easy, validation split (grade-school science questions)",
    "arc_challenge": "ARC-Challenge, validation split (the harder ARC questions)",
    "boolq": "BoolQ, validation split (yes/no questions about a Wikipedia passage)",
    "csqa": "CommonsenseQA, validation split",
    "hellaswag": "HellaSwag, validation split (the most plausible continuation of an activity description)",
    "openbookqa": "OpenBookQA, validation split (elementary science, without the book)",
    "piqa": "PIQA, validation split (physical commonsense: which of two solutions reaches the goal)",
    "socialiqa": "Social IQa, validation split (social situations)",
    "winogrande": "WinoGrande (xl), validation split (pronoun resolution; each choice fills the blank, the rest of the sentence is scored)",
}
"""Shipped tasks: zero-shot, in OLMo's OLMES formats (docs/evaluation.md); name -> what it is."""


class TaskError(DataError):
    """A task cannot be used: unknown, unreadable, malformed, or not encodable by the tokenizer."""


@dataclass(frozen=True)
class Item:
    """One question: choice i is `continuations[i]` scored after `contexts[i]`; `gold` the right one."""

    contexts: tuple[str, ...]
    continuations: tuple[str, ...]
    gold: int
    index: int
    """Position in the task's file (items keep it when a limit picks some of them)."""


@dataclass(frozen=True)
class Task:
    name: str
    items: tuple[Item, ...]
    """The items evaluated (all, or the evenly spread `limit` of them)."""
    total: int
    """Items in the task's file."""
    source: str

    @property
    def chance(self) -> float:
        """Accuracy of a uniform random guess (the mean of 1 / choices over the items)."""
        return sum(1.0 / len(item.continuations) for item in self.items) / max(1, len(self.items))


def standard_task_path(name: str) -> Path:
    return Path(str(package_files.files("raytrain_fast.downstream") / "data" / f"{name}.jsonl.gz"))


def is_jsonl(spec: str) -> bool:
    return spec.endswith(JSONL_SUFFIXES)


def task_name(spec: str) -> str:
    """`arc_easy` for a standard task; a file's name without .jsonl / .jsonl.gz for a JSONL file."""
    if not is_jsonl(spec):
        return spec
    base = Path(spec).name
    return base[: -len(next(s for s in JSONL_SUFFIXES[::-1] if base.endswith(s)))]


def unknown_task_message(spec: str) -> str:
    close = difflib.get_close_matches(spec, list(STANDARD_TASKS), n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return (
        f"unknown task '{spec}' ({hint}standard tasks: {', '.join(STANDARD_TASKS)}); or give the path of a .jsonl "
        "file of your own items (docs/evaluation.md#your-own-tasks)"
    )


def check_task_specs(specs: list[str]) -> list[str]:
    """Problems with the task names or files (unknown name, missing file, the same name twice)."""
    problems, names = [], {}
    for spec in specs:
        if is_jsonl(spec):
            if not Path(spec).expanduser().is_file():
                problems.append(f"task file {spec} does not exist (looked in {Path(spec).expanduser().resolve().parent})")
        elif spec not in STANDARD_TASKS:
            problems.append(unknown_task_message(spec))
        name = task_name(spec)
        if name in names:
            problems.append(f"two tasks are named '{name}' ({names[name]} and {spec}): rename one of the files")
        names[name] = spec
    return problems


def load_tasks(specs: list[str], *, limit: int | None) -> list[Task]:
    """Each task of `specs` (standard names or JSONL paths), with at most `limit` items each."""
    problems = check_task_specs(specs)
    if problems:
        raise TaskError("; ".join(problems))
    return [load_task(spec, limit=limit) for spec in specs]


def load_task(spec: str, *, limit: int | None) -> Task:
    if is_jsonl(spec):
        path, source = Path(spec).expanduser(), spec
    else:
        path, source = standard_task_path(spec), f"standard task {spec}"
    items = read_items(path, shown=spec)
    return Task(name=task_name(spec), items=tuple(select(items, limit)), total=len(items), source=source)


def select(items: list[Item], limit: int | None) -> list[Item]:
    """`limit` items spread evenly over the task (the same ones every time), or all of them."""
    if limit is None or limit >= len(items):
        return items
    return [items[i * len(items) // limit] for i in range(limit)]


def read_items(path: Path, *, shown: str) -> list[Item]:
    opener = gzip.open if path.name.endswith(".gz") else open
    items: list[Item] = []
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, 1):
                if line.strip():
                    items.append(parse_item(line, index=len(items), where=f"{shown} line {number}"))
    except (OSError, UnicodeDecodeError, EOFError) as error:
        raise TaskError(f"task file {shown} cannot be read: {error}") from None
    if not items:
        raise TaskError(f"task file {shown} holds no items: write one JSON object per line (docs/evaluation.md#your-own-tasks)")
    return items


ITEM_SHAPES = (
    '{"context": "Question: ...\\nAnswer:", "choices": [" yes", " no"], "gold": 0} or '
    '{"contexts": ["... Sarah", "... Maria"], "continuation": " always got the easier cases.", "gold": 1}'
)


def parse_item(line: str, *, index: int, where: str) -> Item:
    """One JSONL line as an Item; TaskError naming the line and what is wrong."""
    try:
        data = json.loads(line)
    except ValueError as error:
        raise TaskError(f"{where}: not valid JSON ({error.args[0] if error.args else error}); each line is one item: {ITEM_SHAPES}") from None
    if not isinstance(data, dict):
        raise TaskError(f"{where}: an item is a JSON object, got {type(data).__name__}: {ITEM_SHAPES}")
    if "choices" in data:
        contexts, continuations = _shared_context(data, where)
    elif "contexts" in data:
        contexts, continuations = _own_contexts(data, where)
    else:
        raise TaskError(f"{where}: an item needs \"context\" and \"choices\" (or \"contexts\" and \"continuation\"): {ITEM_SHAPES}")
    gold = data.get("gold")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(continuations):
        raise TaskError(f"{where}: \"gold\" must be the index of the right choice, 0 to {len(continuations) - 1}; got {gold!r}")
    moved = [(c.rstrip(" "), " " * (len(c) - len(c.rstrip(" "))) + cont) for c, cont in zip(contexts, continuations)]
    return Item(contexts=tuple(c for c, _ in moved), continuations=tuple(c for _, c in moved), gold=gold, index=index)


def _strings(value: object, key: str, where: str, *, at_least: int) -> list[str]:
    if not isinstance(value, list) or len(value) < at_least or not all(isinstance(v, str) for v in value):
        raise TaskError(f"{where}: \"{key}\" must be a list of at least {at_least} strings; got {json.dumps(value)[:80]}")
    return value


def _shared_context(data: dict, where: str) -> tuple[list[str], list[str]]:
    context = data.get("context", "")
    if not isinstance(context, str):
        raise TaskError(f"{where}: \"context\" must be a string; got {json.dumps(context)[:80]}")
    choices = _strings(data["choices"], "choices", where, at_least=2)
    if any(not choice.strip() for choice in choices):
        raise TaskError(f"{where}: choice {next(i for i, c in enumerate(choices) if not c.strip())} is empty: every choice needs text to score")
    return [context] * len(choices), choices


def _own_contexts(data: dict, where: str) -> tuple[list[str], list[str]]:
    contexts = _strings(data["contexts"], "contexts", where, at_least=2)
    continuation = data.get("continuation")
    if not isinstance(continuation, str) or not continuation.strip():
        raise TaskError(f"{where}: \"continuation\" must be a non-empty string (the text scored after each context)")
    return contexts, [continuation] * len(contexts)
