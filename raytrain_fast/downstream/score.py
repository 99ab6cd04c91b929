"""Scoring on the device: the log-likelihood of every request, then each item's choice and the counts
per task, with no host read (the caller reads the counts once, after summing them across ranks).

`ScoringPlan` lays one rank's share of the requests out in rows once. Packed (our models, which take
a `DocumentLayout`): an item whose choices share a context is one row, the context once and then
every choice after it, each choice attending to the context and to itself only and positioned right
after the context, as if it were alone: the context is read once instead of once per choice. Unpacked
(any causal LM, e.g. through transformers): one row per choice. Rows are sorted by length, so a
batch pads little, and index tensors made once pick each continuation token's log-probability out of
the logits: a batch costs one forward pass and a few gathers, and no step reads a value back.

The counts of a task are [correct, correct_norm, items, cut]: `acc` picks the choice with the highest
log-likelihood, `acc_norm` the highest log-likelihood per character of the continuation (leading
whitespace not counted); ties go to the lower choice index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from raytrain_fast.downstream.encode import EncodedTask
from raytrain_fast.model.documents import DocumentLayout

COUNTS = ("correct", "correct_norm", "items", "cut")
"""What a task's counts hold, in order."""


@dataclass
class Row:
    """One row of a batch: a context read once, then each continuation (all but its last token)."""

    context: np.ndarray
    continuations: list[np.ndarray]
    requests: list[int]
    """The request of each continuation."""

    @property
    def length(self) -> int:
        return len(self.context) + sum(len(c) - 1 for c in self.continuations)


@dataclass
class Batch:
    tokens: torch.Tensor
    """(B, T) the rows, right-padded."""
    layout: DocumentLayout | None
    """Positions and mask of packed rows; None: plain causal rows (each holds one choice)."""
    positions: torch.Tensor
    """(N,) flat positions (row * T + column) whose logits predict a continuation token."""
    targets: torch.Tensor
    """(N,) the continuation token each of those positions predicts."""
    requests: torch.Tensor
    """(N,) the request each of those positions belongs to."""


class ScoringPlan:
    """One rank's requests (the items `items[t]` of each task t), ready to score on `device`."""

    def __init__(
        self, tasks: list[EncodedTask], items: list[np.ndarray], *, micro_batch: int, device: torch.device | str, packed: bool = True,
    ) -> None:
        self.tasks, self.device, self.packed = tasks, torch.device(device), packed
        rows, item_requests, chars, task_of_item, gold, cut = [], [], [], [], [], []
        for task_id, (task, chosen) in enumerate(zip(tasks, items)):
            starts = np.searchsorted(task.request_item, np.arange(task.num_items + 1))  # an item's requests are contiguous
            for item in chosen:
                first = len(chars)
                requests = list(range(starts[item], starts[item + 1]))
                item_requests.append(list(range(first, first + len(requests))))
                chars += [float(task.characters[r]) for r in requests]
                rows += _rows(task, requests, first, shared=packed and bool(task.shared[item]))
                task_of_item.append(task_id)
                gold.append(int(task.gold[item]))
                cut.append(int(task.cut[item]))
        self.num_requests, self.num_items = len(chars), len(item_requests)
        self.batches = _batches(rows, micro_batch=micro_batch, device=self.device, packed=packed)
        width = max((len(r) for r in item_requests), default=1)
        choice = torch.full((self.num_items, width), -1, dtype=torch.long)
        for row, requests in enumerate(item_requests):
            choice[row, : len(requests)] = torch.tensor(requests, dtype=torch.long)
        self.choice = choice.to(self.device)
        self.padding = self.choice < 0
        self.characters = torch.tensor(chars or [1.0], dtype=torch.float32, device=self.device)
        self.gold = torch.tensor(gold, dtype=torch.long, device=self.device)
        self.cut = torch.tensor(cut, dtype=torch.float32, device=self.device)
        self.task_of_item = torch.tensor(task_of_item, dtype=torch.long, device=self.device)

    def loglikelihoods(self, forward: Callable[..., torch.Tensor]) -> torch.Tensor:
        """(requests,) the summed log-probability of each request's continuation, on the device.
        `forward(tokens)` (unpacked) or `forward(tokens, layout=...)` (packed) returns (B, T, V) logits."""
        total = torch.zeros(self.num_requests, dtype=torch.float32, device=self.device)
        for batch in self.batches:
            logits = forward(batch.tokens) if batch.layout is None else forward(batch.tokens, layout=batch.layout)
            picked = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.positions).float()
            logprobs = torch.log_softmax(picked, dim=-1).gather(1, batch.targets.unsqueeze(1)).squeeze(1)
            total.index_add_(0, batch.requests, logprobs)
        return total

    def choose(self, loglikelihoods: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(item choice by log-likelihood, by log-likelihood per character), on the device."""
        safe = self.choice.clamp(min=0)
        lls = loglikelihoods[safe].masked_fill(self.padding, float("-inf"))
        per_char = (loglikelihoods / self.characters)[safe].masked_fill(self.padding, float("-inf"))
        return lls.argmax(dim=1), per_char.argmax(dim=1)

    def counts(self, loglikelihoods: torch.Tensor) -> torch.Tensor:
        """(tasks x 4,) float counts on the device, in the order of COUNTS."""
        choice, choice_norm = self.choose(loglikelihoods)
        rows = torch.stack([
            (choice == self.gold).float(), (choice_norm == self.gold).float(), torch.ones_like(self.cut), self.cut,
        ], dim=1)
        out = torch.zeros(len(self.tasks), len(COUNTS), dtype=torch.float32, device=self.device)
        out.index_add_(0, self.task_of_item, rows)
        return out.flatten()

    def score(self, forward: Callable[..., torch.Tensor]) -> torch.Tensor:
        return self.counts(self.loglikelihoods(forward))


def _rows(task: EncodedTask, requests: list[int], first: int, *, shared: bool) -> list[Row]:
    """An item's rows: one for all its choices when they share the context, else one per choice.
    Request numbers in the rows count from `first` (this plan's numbering)."""
    split = [(task.sequences[r][: task.context_tokens[r]], task.sequences[r][task.context_tokens[r]:]) for r in requests]
    if shared:
        return [Row(context=split[0][0], continuations=[c for _, c in split], requests=[first + i for i in range(len(split))])]
    return [Row(context=context, continuations=[c], requests=[first + i]) for i, (context, c) in enumerate(split)]


def _batches(rows: list[Row], *, micro_batch: int, device: torch.device, packed: bool) -> list[Batch]:
    """Longest first, micro_batch rows per batch."""
    order = sorted(rows, key=lambda row: -row.length)
    step = max(1, micro_batch)
    return [_batch(order[start:start + step], device=device, packed=packed) for start in range(0, len(order), step)]


def _batch(rows: list[Row], *, device: torch.device, packed: bool) -> Batch:
    width = max(row.length for row in rows)
    tokens = np.zeros((len(rows), width), np.int64)
    positions = np.zeros((len(rows), width), np.int64)
    segment = np.full((len(rows), width), -1, np.int64)  # 0: context, k + 1: choice k, -1: padding
    picks, targets, requests = [], [], []
    for b, row in enumerate(rows):
        n = len(row.context)
        tokens[b, :n], positions[b, :n], segment[b, :n] = row.context, np.arange(n), 0
        at = n
        for k, (continuation, request) in enumerate(zip(row.continuations, row.requests)):
            inputs = len(continuation) - 1  # its last token is only predicted, never read
            tokens[b, at:at + inputs] = continuation[:-1]
            positions[b, at:at + inputs] = n + np.arange(inputs)
            segment[b, at:at + inputs] = k + 1
            reads = np.concatenate([[n - 1], at + np.arange(inputs)])  # the context's last token predicts its first
            picks.append(b * width + reads)
            targets.append(continuation)
            requests.append(np.full(len(continuation), request))
            at += inputs
    layout = _layout(positions, segment, device) if packed and any(len(r.continuations) > 1 for r in rows) else None
    return Batch(
        tokens=torch.from_numpy(tokens).to(device), layout=layout, positions=torch.from_numpy(np.concatenate(picks)).to(device),
        targets=torch.from_numpy(np.concatenate(targets)).to(device), requests=torch.from_numpy(np.concatenate(requests)).to(device),
    )


def _layout(positions: np.ndarray, segment: np.ndarray, device: torch.device) -> DocumentLayout:
    """A query sees the keys at or before it that are context or of its own choice; padding sees itself."""
    width = segment.shape[1]
    causal = np.tril(np.ones((width, width), dtype=bool))
    query, key = segment[:, :, None], segment[:, None, :]
    allowed = causal & ((key == 0) | (key == query)) & (query >= 0)
    allowed |= np.eye(width, dtype=bool)  # a padding query must see something: no row of -inf
    mask = torch.from_numpy(allowed).unsqueeze(1).to(device)  # (B, 1, T, T) bool
    return DocumentLayout(positions=torch.from_numpy(positions).to(device), mask=mask)
