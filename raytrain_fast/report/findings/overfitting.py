"""Overfitting: val/loss rising over evaluations while the train loss falls."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, more_data, setting_note
from raytrain_fast.report.load import RunMetrics


OVERFIT_RISES = 2
"""Evaluations in a row with a higher val/loss than the one before, ending at the last one."""
OVERFIT_MIN_RISE = 0.01
"""...and the last val/loss at least this much (relative) above the run's lowest."""


def find(run: RunMetrics) -> Finding | str | None:
    """val/loss rising over the last OVERFIT_RISES evaluations, above its minimum, while train/loss fell."""
    steps, val = run.series("val/loss")
    if len(val) < OVERFIT_RISES + 1:
        why = "no val/loss (evaluation off: prepare the data with a validation split and keep eval.enabled)" if not val else (
            f"{len(val)} evaluation(s), {OVERFIT_RISES + 1} needed (eval.every_steps)"
        )
        return f"overfitting: {why}"
    best = min(range(len(val)), key=val.__getitem__)
    rising = all(val[i] > val[i - 1] for i in range(len(val) - OVERFIT_RISES, len(val)))
    rise = val[-1] / val[best] - 1.0
    train = dict(zip(*run.series("train/loss")))
    train_then, train_now = train.get(steps[best]), train.get(steps[-1])
    if not (rising and rise >= OVERFIT_MIN_RISE and train_then is not None and train_now is not None and train_now < train_then):
        return None
    evidence = [
        f"val/loss rose over the last {OVERFIT_RISES} evaluations, from its lowest {val[best]:.4f} at step {steps[best]} "
        f"to {val[-1]:.4f} at step {steps[-1]} (+{rise:.1%})",
        f"while train/loss fell from {train_then:.4f} to {train_now:.4f}: the model is memorising its training data",
    ]
    advice = [
        f"more data: {more_data(run)}, or all of it (data.max_tokens=0" + setting_note(run, "data", "max_tokens") + ")",
        f"fewer epochs: train fewer steps (train.steps{setting_note(run, 'train', 'steps')}), or keep the best "
        f"checkpoint by val/loss (checkpoint.keep_best=1: the step-{steps[best]} one)",
        f"regularise: model.dropout{setting_note(run, 'model', 'dropout')} (e.g. 0.1), "
        f"optim.weight_decay{setting_note(run, 'optim', 'weight_decay')}",
    ]
    return Finding(
        key="overfitting", title=f"Overfitting: val/loss up {rise:.1%} since step {steps[best]} while train/loss fell",
        evidence=evidence, advice=advice,
        numbers={"best_step": float(steps[best]), "best_val_loss": val[best], "val_loss": val[-1], "rise": rise},
    )
