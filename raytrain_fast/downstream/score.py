"""Scoring on the device: the log-likelihood of every request with no host read; then, on the host,
from every request's log-likelihood, each item's choice and the counts per task.

`ScoringPlan` lays the requests out in rows once. Packed (our models, which take a
`DocumentLayout`): an item whose choices share a context is one row, the context once and then
every choice after it, each choice attending to the context and to itself only and positioned right
after the context, as if it were alone: the context is read once instead of once per choice. Unpacked
(any causal LM, e.g. through transformers): one row per choice. Each task's rows are sorted by
length and cut into batches of `micro_batch` rows, so a batch pads little, and index tensors made
once pick each continuation token's log-probability out of the logits: a batch costs one forward
pass and a few gathers, and no step reads a value back.

A batch's rows depend on the task's items and the micro-batch only, never on how many ranks share
the work (ranks take whole batches in turn) or on the other tasks scored with it, and a request's
sum runs in a fixed order: so the same weights at the same precision give every request the same
log-likelihood, bit for bit, in the loop (any worker count) and in `raytrain-fast evaluate` (any
--workers). A different micro-batch changes the padding and the kernels' shapes, and with them the
last bits.

A task's figures (`task_figures`): `acc` picks the choice with the highest log-likelihood,
`acc_norm` the highest log-likelihood per character of the continuation (leading whitespace not
counted), ties to the lower choice index; `loglikelihood` is the right choice's, averaged over the
items (it moves before acc leaves chance, and any item scored differently changes it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from raytrain_fast.downstream.encode import EncodedTask
from raytrain_fast.model.documents import DocumentLayout

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
    slots: tuple[torch.Tensor, torch.Tensor]
    """(N,) each of those positions' (request of the batch, token of its continuation)."""
    requests: torch.Tensor
    """(R,) the plan's number of each request of the batch."""
    longest: int
    """Tokens of the batch's longest continuation."""


class ScoringPlan:
    """The requests of `tasks` (every scored item), numbered task after task; rank `rank` of
    `world_size` holds every world_size-th batch, on `device`."""

    def __init__(
        self, tasks: list[EncodedTask], *, micro_batch: int, device: torch.device | str, packed: bool = True,
        rank: int = 0, world_size: int = 1,
    ) -> None:
        self.tasks, self.device, self.packed = tasks, torch.device(device), packed
        self.offsets = np.cumsum([0, *(len(task.sequences) for task in tasks)]).tolist()
        """Where each task's requests start in the plan's numbering (the last: the number of requests)."""
        self.num_requests = self.offsets[-1]
        groups = []
        for task, first in zip(tasks, self.offsets):
            starts = np.searchsorted(task.request_item, np.arange(task.num_items + 1))  # an item's requests are contiguous
            rows = [row for item in range(task.num_items)
                    for row in _rows(task, range(starts[item], starts[item + 1]), first, shared=packed and bool(task.shared[item]))]
            order = sorted(rows, key=lambda row: -row.length)  # longest first
            groups += [order[start:start + max(1, micro_batch)] for start in range(0, len(order), max(1, micro_batch))]
        self.batches = [_batch(rows, device=self.device, packed=packed) for rows in groups[rank::world_size]]

    def loglikelihoods(self, forward: Callable[..., torch.Tensor]) -> torch.Tensor:
        """(requests,) the summed log-probability of each request's continuation on the device; 0 for
        the requests of other ranks' batches, so a sum over the ranks holds every one exactly.
        `forward(tokens)` (unpacked) or `forward(tokens, layout=...)` (packed) returns (B, T, V) logits."""
        total = torch.zeros(self.num_requests, dtype=torch.float32, device=self.device)
        for batch in self.batches:
            logits = forward(batch.tokens) if batch.layout is None else forward(batch.tokens, layout=batch.layout)
            picked = logits.reshape(-1, logits.shape[-1]).index_select(0, batch.positions).float()
            logprobs = torch.log_softmax(picked, dim=-1).gather(1, batch.targets.unsqueeze(1)).squeeze(1)
            # A request's tokens summed along a row of a fixed shape: the same order on every run
            # (an index_add_ would add in whatever order a GPU's atomics land).
            table = torch.zeros(len(batch.requests), batch.longest, dtype=torch.float32, device=self.device)
            table[batch.slots] = logprobs
            total[batch.requests] = table.sum(dim=1)
        return total

    def figures(self, loglikelihoods: list[float]) -> list[dict[str, float]]:
        """Every task's figures (`task_figures`), from every request's log-likelihood (host values)."""
        return [task_figures(task, np.asarray(loglikelihoods[first:first + len(task.sequences)], dtype=np.float64))
                for task, first in zip(self.tasks, self.offsets)]


def task_figures(task: EncodedTask, loglikelihoods: np.ndarray) -> dict[str, float]:
    """acc, acc_norm, loglikelihood (the right choice's, mean per item), items and cut of a task, from
    its requests' log-likelihoods (the task's numbering): the loop and `evaluate` both make them here."""
    choice, choice_norm = choose(task, loglikelihoods)
    items = max(task.num_items, 1)
    gold = loglikelihoods[np.searchsorted(task.request_item, np.arange(task.num_items)) + task.gold]
    return {"acc": float((choice == task.gold).sum()) / items, "acc_norm": float((choice_norm == task.gold).sum()) / items,
            "loglikelihood": float(gold.sum()) / items, "items": float(task.num_items), "cut": float(task.cut.sum())}


def choose(task: EncodedTask, loglikelihoods: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each item's choice by log-likelihood and by log-likelihood per character, from its requests'
    values (the task's numbering); ties go to the lower choice index."""
    starts = np.searchsorted(task.request_item, np.arange(task.num_items + 1))
    per_char = loglikelihoods / task.characters
    pick = lambda values: np.array([int(np.argmax(values[a:b])) for a, b in zip(starts[:-1], starts[1:])], np.int64)  # noqa: E731
    return pick(loglikelihoods), pick(per_char)


def _rows(task: EncodedTask, requests: range, first: int, *, shared: bool) -> list[Row]:
    """An item's rows: one for all its choices when they share the context, else one per choice.
    `requests` are the task's numbers; the rows carry the plan's (`first` + the task's)."""
    split = [(task.sequences[r][: task.context_tokens[r]], task.sequences[r][task.context_tokens[r]:]) for r in requests]
    numbers = [first + r for r in requests]
    if shared:
        return [Row(context=split[0][0], continuations=[c for _, c in split], requests=numbers)]
    return [Row(context=context, continuations=[c], requests=[number]) for (context, c), number in zip(split, numbers)]


def _batch(rows: list[Row], *, device: torch.device, packed: bool) -> Batch:
    width = max(row.length for row in rows)
    tokens = np.zeros((len(rows), width), np.int64)
    positions = np.zeros((len(rows), width), np.int64)
    segment = np.full((len(rows), width), -1, np.int64)  # 0: context, k + 1: choice k, -1: padding
    picks, targets, slot_rows, slot_columns, requests = [], [], [], [], []
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
            slot_rows.append(np.full(len(continuation), len(requests)))
            slot_columns.append(np.arange(len(continuation)))
            requests.append(request)
            at += inputs
    layout = _layout(positions, segment, device) if packed and any(len(r.continuations) > 1 for r in rows) else None
    on = lambda parts: torch.from_numpy(np.concatenate(parts)).to(device)  # noqa: E731
    return Batch(
        tokens=torch.from_numpy(tokens).to(device), layout=layout, positions=on(picks), targets=on(targets),
        slots=(on(slot_rows), on(slot_columns)), requests=torch.tensor(requests, dtype=torch.long, device=device),
        longest=max(len(t) for t in targets),
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
