"""Tasks as token ids for one model: each choice's context and continuation encoded separately (so
a continuation's tokens are the same whatever its context), joined, and cut from the left to the
model's window. Done once, on the driver, before any worker starts: a tokenizer that cannot encode
an item is an error here, naming the item.

The scored sequence of a choice is context + continuation; the model reads all of it but its last
token and predicts each continuation token from the tokens before it. A context starts with the
beginning-of-text id where the tokenizer's documents start with one (Llama 3, Mistral); an empty
context is that id alone, or else the end-of-document id, so the first continuation token is
predicted too. When a sequence is longer than
the window + 1, the oldest context tokens are dropped (the item counts as cut): for choices that
share their context, the same ones for every choice (as many as the longest choice needs), so every
choice is scored after the same context, which the scorer then reads once for all of them. An item
with a continuation longer than the window cannot be scored and is left out (counted as skipped).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from raytrain_fast.downstream.tasks import Item, Task, TaskError


@dataclass(frozen=True, kw_only=True)
class Encoder:
    """A tokenizer as the scorer needs it."""

    encode: Callable[[str], list[int]]
    """Ids of one text, no special tokens added."""
    eod_id: int
    """What an empty context becomes."""
    vocab_size: int
    """The model's: a larger id cannot be scored."""
    window: int
    """Tokens the model reads at once (its maximum sequence length)."""
    unknown_id: int | None = None
    """The tokenizer's unknown-token id, if it has one: text that becomes it cannot be scored."""
    bos_id: int | None = None
    """The id each document starts with, if the tokenizer puts one there: every context starts with it."""
    name: str = "tokenizer"


@dataclass(kw_only=True)
class EncodedTask:
    """One task's requests (a request = one choice of one item), as numpy arrays (picklable)."""

    name: str
    total: int
    """Items in the task's file."""
    chance: float
    sequences: list[np.ndarray]
    """Per request: context + continuation ids after the cut (int64)."""
    continuation_tokens: np.ndarray
    """Per request: how many of the sequence's last ids are the continuation."""
    characters: np.ndarray
    """Per request: characters of the continuation, leading whitespace not counted (acc_norm's divisor)."""
    request_item: np.ndarray
    """Per request: its item's position in this task's scored items."""
    gold: np.ndarray
    """Per scored item: the right choice."""
    item_index: np.ndarray
    """Per scored item: its position in the task's file."""
    cut: np.ndarray
    """Per scored item: 1 where some choice's context was cut to fit the window."""
    context_tokens: np.ndarray
    """Per request: how many of the sequence's first ids are the context (after the cut)."""
    shared: np.ndarray
    """Per scored item: 1 where its choices share one context (the same ids), which is read once."""
    skipped: list[int]
    """Items left out (a continuation longer than the window): their positions in the file."""

    @property
    def num_items(self) -> int:
        return len(self.gold)


def encode_tasks(tasks: list[Task], encoder: Encoder) -> list[EncodedTask]:
    return [encode_task(task, encoder) for task in tasks]


def encode_task(task: Task, encoder: Encoder) -> EncodedTask:
    sequences, cont_tokens, characters, request_item, gold, index, cut, shared = [], [], [], [], [], [], [], []
    skipped: list[int] = []
    for item in task.items:
        encoded = _encode_item(item, encoder, task=task.name)
        if encoded is None:
            skipped.append(item.index)
            continue
        item_sequences, lengths, was_cut = encoded
        sequences += item_sequences
        cont_tokens += lengths
        characters += [max(1, len(c.lstrip())) for c in item.continuations]
        request_item += [len(gold)] * len(item_sequences)
        gold.append(item.gold)
        index.append(item.index)
        cut.append(int(was_cut))
        shared.append(int(len(set(item.contexts)) == 1))
    ints = functools.partial(np.array, dtype=np.int64)
    return EncodedTask(
        name=task.name, total=task.total, chance=task.chance, sequences=sequences, skipped=skipped,
        continuation_tokens=ints(cont_tokens), characters=np.array(characters, np.float64),
        request_item=ints(request_item), gold=ints(gold), item_index=ints(index), cut=ints(cut), shared=ints(shared),
        context_tokens=ints([len(s) - c for s, c in zip(sequences, cont_tokens)]),
    )


def _encode_item(item: Item, encoder: Encoder, *, task: str) -> tuple[list[np.ndarray], list[int], bool] | None:
    """(sequences, continuation lengths, whether a context was cut), or None when a continuation does
    not fit the window."""
    pairs = []
    for choice, (context, continuation) in enumerate(zip(item.contexts, item.continuations)):
        where = f"task {task}, item {item.index}, choice {choice}"
        start = [encoder.bos_id] if encoder.bos_id is not None else []
        context_ids = start + _ids(encoder, context, where=f"{where}, its context") if context else start or [encoder.eod_id]
        continuation_ids = _ids(encoder, continuation, where=f"{where}, {continuation[:40]!r}")
        if not continuation_ids:
            raise TaskError(f"{where}: the tokenizer ({encoder.name}) turns {continuation!r} into no tokens, so there is nothing to score")
        pairs.append((context_ids, continuation_ids))
    if max(len(c) for _, c in pairs) > encoder.window:
        return None
    longest = max(len(c) for _, c in pairs)
    shared = len(set(item.contexts)) == 1  # one context: cut once, to what the longest choice leaves
    keeps = [encoder.window + 1 - (longest if shared else len(continuation)) for _, continuation in pairs]
    was_cut = any(len(context) > keep for (context, _), keep in zip(pairs, keeps))
    return [np.array(c[-keep:] + k, np.int64) for (c, k), keep in zip(pairs, keeps)], [len(k) for _, k in pairs], was_cut


def _ids(encoder: Encoder, text: str, *, where: str) -> list[int]:
    try:
        ids = list(encoder.encode(text))
    except Exception as error:  # noqa: BLE001 - the tokenizer's own error, named with the item
        raise TaskError(f"{where}: the tokenizer ({encoder.name}) cannot encode it: {error}") from None
    if encoder.unknown_id is not None and encoder.unknown_id in ids:
        raise TaskError(
            f"{where}: the tokenizer ({encoder.name}) has no token for part of {text[:60]!r} (it becomes the unknown "
            "token): use a byte-level tokenizer, or leave this item out of the task"
        )
    if ids and max(ids) >= encoder.vocab_size:
        raise TaskError(
            f"{where}: the tokenizer ({encoder.name}) gives id {max(ids)}, but the model's vocabulary has "
            f"{encoder.vocab_size} ids: this tokenizer is not the model's"
        )
    return ids


def skipped_note(tasks: list[EncodedTask], window: int) -> list[str]:
    """One line per task that left items out."""
    return [
        f"Task {t.name}: {len(t.skipped)} of {t.num_items + len(t.skipped)} items left out: a choice is longer than the "
        f"model's window of {window} tokens by itself (items {', '.join(map(str, t.skipped[:5]))}{', ...' if len(t.skipped) > 5 else ''})."
        for t in tasks if t.skipped
    ]
