"""Scoring on the device: the log-likelihood of every request, then each item's choice and the counts
per task, with no host read (the caller reads the counts once, after summing them across ranks).

`ScoringPlan` lays one rank's share of the requests out in batches once (sorted by length, so a
batch pads little), with the index tensors that pick each continuation token's log-probability out
of the logits: a batch costs one forward pass and a few gathers, and no step depends on a value
read back from the device.

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

COUNTS = ("correct", "correct_norm", "items", "cut")
"""What a task's counts hold, in order."""


@dataclass
class Batch:
    tokens: torch.Tensor
    """(B, T) the sequences without their last token, right-padded."""
    positions: torch.Tensor
    """(N,) flat positions (row * T + column) whose logits predict a continuation token."""
    targets: torch.Tensor
    """(N,) the continuation token each of those positions predicts."""
    requests: torch.Tensor
    """(N,) the request each of those positions belongs to."""


class ScoringPlan:
    """One rank's requests (the items `items[t]` of each task t), ready to score on `device`."""

    def __init__(self, tasks: list[EncodedTask], items: list[np.ndarray], *, micro_batch: int, device: torch.device | str) -> None:
        self.tasks, self.device = tasks, torch.device(device)
        sequences, continuation, chars, item_rows, task_of_item, gold, cut, index = [], [], [], [], [], [], [], []
        for task_id, (task, chosen) in enumerate(zip(tasks, items)):
            starts = np.searchsorted(task.request_item, np.arange(task.num_items + 1))  # an item's requests are contiguous
            for item in chosen:
                requests = range(starts[item], starts[item + 1])
                item_rows.append(list(range(len(sequences), len(sequences) + len(requests))))
                sequences += [task.sequences[r] for r in requests]
                continuation += [int(task.continuation_tokens[r]) for r in requests]
                chars += [float(task.characters[r]) for r in requests]
                task_of_item.append(task_id)
                gold.append(int(task.gold[item]))
                cut.append(int(task.cut[item]))
                index.append(int(task.item_index[item]))
        self.num_requests, self.num_items = len(sequences), len(item_rows)
        self.item_task, self.item_index = np.array(task_of_item, np.int64), np.array(index, np.int64)
        self.batches = _batches(sequences, continuation, micro_batch=micro_batch, device=self.device)
        width = max((len(rows) for rows in item_rows), default=1)
        choice = torch.full((self.num_items, width), -1, dtype=torch.long)
        for row, rows in enumerate(item_rows):
            choice[row, : len(rows)] = torch.tensor(rows, dtype=torch.long)
        self.choice = choice.to(self.device)
        self.padding = self.choice < 0
        self.characters = torch.tensor(chars or [1.0], dtype=torch.float32, device=self.device)
        self.gold = torch.tensor(gold, dtype=torch.long, device=self.device)
        self.cut = torch.tensor(cut, dtype=torch.float32, device=self.device)
        self.task_of_item = torch.tensor(task_of_item, dtype=torch.long, device=self.device)

    def loglikelihoods(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """(requests,) the summed log-probability of each request's continuation, on the device."""
        total = torch.zeros(self.num_requests, dtype=torch.float32, device=self.device)
        for batch in self.batches:
            logits = forward(batch.tokens)  # (B, T, V)
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

    def score(self, forward: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        return self.counts(self.loglikelihoods(forward))


def _batches(sequences: list[np.ndarray], continuation: list[int], *, micro_batch: int, device: torch.device) -> list[Batch]:
    """Longest first, micro_batch sequences per batch."""
    order = sorted(range(len(sequences)), key=lambda r: -len(sequences[r]))
    batches = []
    for start in range(0, len(order), max(1, micro_batch)):
        chosen = order[start:start + max(1, micro_batch)]
        width = max(len(sequences[r]) - 1 for r in chosen)
        tokens = np.zeros((len(chosen), width), np.int64)
        positions, targets, requests = [], [], []
        for row, r in enumerate(chosen):
            sequence = sequences[r]
            tokens[row, : len(sequence) - 1] = sequence[:-1]
            first = len(sequence) - 1 - continuation[r]  # the position whose logits predict the first continuation token
            columns = np.arange(first, len(sequence) - 1)
            positions.append(row * width + columns)
            targets.append(sequence[columns + 1])
            requests.append(np.full(len(columns), r))
        batches.append(Batch(
            tokens=torch.from_numpy(tokens).to(device), positions=torch.from_numpy(np.concatenate(positions)).to(device),
            targets=torch.from_numpy(np.concatenate(targets)).to(device), requests=torch.from_numpy(np.concatenate(requests)).to(device),
        ))
    return batches


__all__ = ["COUNTS", "ScoringPlan"]
