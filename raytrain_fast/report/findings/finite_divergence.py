"""Finite divergence: a loss that blew up without a NaN (loop/divergence.py): above a uniform guess
after warm-up (or twice it during warm-up), or a sustained climb far back from the run's best window."""

from __future__ import annotations

import math
import shlex
from typing import Any

from raytrain_fast.loop.divergence import DivergenceCheck
from raytrain_fast.report.finding import Finding
from raytrain_fast.report.load import RunMetrics


def episodes(run: RunMetrics) -> tuple[list[dict[str, float]], str]:
    """The episodes' first records ({"step", "health/divergence_loss", ...}) and where they come from:
    the health/divergence records the loop wrote, else (a run whose check was off, or older than it)
    the same check replayed over its train/loss, when its config gives the vocabulary."""
    recorded = [r for r in run.records if r.get("health/divergence")]
    if recorded:
        return recorded, "recorded"
    vocab = run.setting("model", "vocab_size")
    if not isinstance(vocab, int) or run.setting("health", "on_divergence") not in (None, "off"):
        return [], ""
    check = DivergenceCheck.for_vocabulary(
        vocab, warmup_steps=int(run.setting("optim", "warmup_steps", 0) or 0),
        windows=int(run.setting("health", "divergence_windows", 3)),
        climb=float(run.setting("health", "divergence_climb", 0.5)),
    )
    found = []
    for step, loss in zip(*run.series("train/loss")):
        if (hit := check.observe(step, loss)) is not None:
            found.append({"step": step, **hit.record()})
    return found, "replayed"


def find(run: RunMetrics) -> list[Finding]:
    """One finding per divergence episode the run went on from (health.on_divergence: warn; a rollback
    or a stop is the divergence finding's), with its steps, its losses and the best checkpoint kept."""
    found, source = episodes(run)
    acted = {int(r["detected_step"]) for r in run.rollbacks}
    if run.divergence_stop:
        acted.add(int(run.divergence_stop["step"]))
    return [_finding(run, record, source) for record in found if int(record["step"]) not in acted]


def _finding(run: RunMetrics, record: dict[str, Any], source: str) -> Finding:
    step, loss = int(record["step"]), float(record["health/divergence_loss"])
    best, bound = float(record["health/divergence_best"]), float(record["health/divergence_bound"])
    since = int(record.get("health/divergence_since", step))
    vocab = run.setting("model", "vocab_size")
    uniform = math.log(vocab) if isinstance(vocab, int) else bound
    steps, losses = run.series("train/loss")
    after = [(s, v) for s, v in zip(steps, losses) if s >= since]
    end = next((s for s, v in after if s > step and v <= bound), None)
    peak_step, peak = max(after, key=lambda point: point[1]) if after else (step, loss)
    what = (f"the windows ending at steps {since} to {step} had losses above {uniform:.4g}, what a uniform guess over "
            f"{vocab if isinstance(vocab, int) else 'the'} tokens scores (ln of model.vocab_size); "
            f"{loss:.4g} at step {step}"
            if loss > uniform else
            f"the loss stayed above {bound:.4g} from step {since} to step {step}: more than "
            f"{run.setting('health', 'divergence_climb', 0.5)} of the way back from the run's best window to a uniform guess ({uniform:.4g})")
    evidence = [
        what,
        f"the run's best window before it: loss {best:.4g}" if math.isfinite(best) else "no window before it was better",
        (f"it stayed above {bound:.4g} until step {end}" if end is not None else
         f"it stayed above {bound:.4g} to the last logged step ({run.last_step})") + f"; highest {peak:.4g} at step {peak_step}",
        ("health.on_divergence: warn: the run went on" if source == "recorded" else
         "found from the recorded train/loss (the run's divergence check was off or older than it)"),
    ]
    best_step = best_saved_step(run)
    advice = ["lower optim.lr, lengthen optim.warmup_steps or tighten optim.grad_clip, and train again from before the climb"]
    if best_step is not None:
        storage = run.uri[: -len(run.name)].rstrip("/") or "."
        evidence.append(f"checkpoints in the run now: steps {', '.join(map(str, run.saved_steps))}; the one with the "
                        f"lowest loss is step {best_step} (checkpoint.keep_best keeps it)")
        command = shlex.join(["raytrain-fast", "export", "--storage", storage, "--name", run.name, "--step", str(best_step),
                              "--out", f"{run.name}-step{best_step}"])
        advice.append(f"use the checkpoint from before it: `{command}`")
    title = (f"Training diverged without a NaN at step {step}: loss {loss:.4g}"
             + (f", above a uniform guess ({uniform:.4g})" if loss > uniform else f", up from a best of {best:.4g}"))
    return Finding(key="divergence", title=title, evidence=evidence, advice=advice, numbers={
        "step": float(step), "since": float(since), "loss": loss, "best": best, "bound": bound,
        "peak": float(peak), "peak_step": float(peak_step), **({"best_checkpoint": float(best_step)} if best_step else {}),
    })


def best_saved_step(run: RunMetrics) -> int | None:
    """The saved checkpoint with the lowest val/loss (train/loss when none has one) at its step, as
    checkpoint.keep_best ranks them; None when no saved step has a loss recorded."""
    for metric in ("val/loss", "train/loss"):
        values = dict(zip(*run.series(metric)))
        scored = [(values[s], s) for s in run.saved_steps if s in values and math.isfinite(values[s])]
        if scored:
            return min(scored)[1]
    return None
