"""Divergence: non-finite windows, the rollbacks they caused and the steps they cost."""

from __future__ import annotations

import math

from raytrain_fast.report.finding import Finding, duration, median_step_s
from raytrain_fast.report.load import RunMetrics


def find(run: RunMetrics) -> list[Finding]:
    """One finding per divergence (loop/health.py): each rollback from `<run>/health.json` (the step,
    what it was, the checkpoint it went back to, the data it skipped, the time lost), and a non-finite
    window the run did not roll back from (health.on_nonfinite stop or warn, or max_rollbacks spent)."""
    step_s = median_step_s(run)
    findings = []
    for number, record in enumerate(run.rollbacks, 1):
        redone = int(record["detected_step"]) - int(record["to_step"])
        lost = redone * step_s if not math.isnan(step_s) else math.nan
        position = record.get("position") or {}
        evidence = [
            f"{record['what']} in the window ending at step {record['detected_step']} (loss {record['loss']:.4g}, grad norm {record['grad_norm']:.4g})",
            f"rolled back to the checkpoint at step {record['to_step']} and skipped the {int(record['skip_sequences']):,} sequences "
            f"read since it (from epoch {position.get('epoch', 0)}, sequence {position.get('consumed', 0):,}); a resume skips them again",
            f"rollback {number} of at most {run.setting('health', 'max_rollbacks', '?')} (health.max_rollbacks)",
        ]
        if not math.isnan(lost):
            evidence.append(f"time lost: about {duration(lost)} ({redone} steps trained again)")
        findings.append(Finding(
            key="divergence", title=f"Divergence at step {record['detected_step']}: rolled back to step {record['to_step']}",
            evidence=evidence, advice=_DIVERGENCE_ADVICE,
            numbers={"step": float(record["detected_step"]), "to_step": float(record["to_step"]),
                     "skipped_sequences": float(record["skip_sequences"]), "lost_s": lost},
        ))
    stop = run.divergence_stop
    if stop:
        evidence = [
            f"{stop['what']} in the window ending at step {stop['step']} (loss {stop['loss']:.4g}, grad norm {stop['grad_norm']:.4g})",
            f"the run stopped there ({_policy(run, stop)}" + (f", after {len(run.rollbacks)} rollback(s)" if run.rollbacks else "") + ")",
            ("every checkpoint saved holds finite weights, and checkpoint.keep_best keeps the one with the lowest loss: "
             if "finite divergence" in str(stop.get("what", "")) else
             "the update of a non-finite step never reached the weights, and every checkpoint saved is healthy: ")
            + (f"the newest is at step {max(run.saved_steps)}" if run.saved_steps else "none was saved"),
        ]
        findings.append(Finding(key="divergence", title=f"Training diverged at step {stop['step']} and stopped",
                                evidence=evidence, advice=_DIVERGENCE_ADVICE, numbers={"step": float(stop["step"])}))
    # Non-finite windows the run went on from (health.on_nonfinite: warn).
    acted = {int(r["detected_step"]) for r in run.rollbacks} | ({int(stop["step"])} if stop else set())
    warned = [s for s, v in zip(*run.series("health/nonfinite")) if v >= 1 and s not in acted]
    if warned:
        findings.append(Finding(
            key="divergence", title=f"Non-finite training windows at {len(warned)} log step(s), first at step {warned[0]}",
            evidence=[
                "non-finite loss or gradient norm in the windows ending at step"
                + ("s " if len(warned) > 1 else " ") + ", ".join(map(str, warned[:12])) + (" ..." if len(warned) > 12 else "") + " (health/nonfinite)",
                f"the run went on (health.on_nonfinite: {run.setting('health', 'on_nonfinite', '?')}); the updates of non-finite steps "
                "never reached the weights, and no checkpoint was saved while the state was not healthy",
            ],
            advice=_DIVERGENCE_ADVICE, numbers={"step": float(warned[0]), "windows": float(len(warned))},
        ))
    return findings


def _policy(run: RunMetrics, stop: dict) -> str:
    """The setting that stopped the run and its value, as health.json recorded them (a record without
    them: the setting its kind of divergence follows, with the value the run's config gives, if any)."""
    what = str(stop.get("what", ""))
    setting = stop.get("setting") or (
        "health.on_spike" if "spike" in what else "health.on_divergence" if "finite divergence" in what else "health.on_nonfinite"
    )
    policy = stop.get("policy") or run.setting("health", setting.split(".", 1)[1])
    if policy == "rollback":
        limit = run.setting("health", "max_rollbacks")
        why = (f"health.max_rollbacks={limit if limit is not None else len(run.rollbacks)} spent" if run.rollbacks else
               "health.max_rollbacks=0" if limit == 0 else "no checkpoint to roll back to")
        return f"{setting}: rollback, {why}"
    return f"{setting}: {policy}" if policy else setting


_DIVERGENCE_ADVICE = [
    "lower optim.lr, lengthen optim.warmup_steps or tighten optim.grad_clip; a resume from the newest healthy checkpoint can change them",
    "if it recurs at the same data, look at the sequences of that window: a rollback skips them, a rerun from an earlier checkpoint reads them again",
]
