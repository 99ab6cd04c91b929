"""A corpus repeated many times: the run sees the same data over many epochs."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, more_data
from raytrain_fast.report.load import RunMetrics


def find(run: RunMetrics) -> Finding | str | None:
    """The run went through its corpus more than MANY_EPOCHS times (train/epoch at its last record)."""
    from raytrain_fast.data.corpus import MANY_EPOCHS

    _, epochs = run.series("train/epoch")
    if not epochs:
        return "corpus repetition: train/epoch was not recorded"
    if epochs[-1] <= MANY_EPOCHS:
        return None
    evidence = [f"the run took {epochs[-1]:,.1f} epochs of its training data by step {run.last_step:,} (train/epoch; threshold {MANY_EPOCHS:g})"]
    _, val = run.series("val/loss")
    if not val:
        evidence.append("no val/loss was recorded, so nothing shows whether the falling loss is memorisation")
    return Finding(
        key="corpus_repeated", title=f"Small corpus: every sequence was seen about {epochs[-1]:,.0f} times",
        evidence=evidence,
        advice=[
            f"train on more data ({more_data(run)}) or for fewer steps; a loss reached by repeating a small corpus is memorisation",
            *([] if val else ["keep a validation split (prepare-data --val-fraction) so val/loss shows when the model stops generalising"]),
        ],
        numbers={"epochs": epochs[-1]},
    )
