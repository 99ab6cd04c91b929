"""Sink backlog: the metric sinks fall behind, drop records or fail."""

from __future__ import annotations

from raytrain_fast.report.finding import Finding, duration, setting_note
from raytrain_fast.report.load import RunMetrics, median


# Sink backlog: a healthy sink thread has written each record before the next log step, so the
# backlog at a log step is 0. Three or more records waiting in at least two steady windows means it
# is persistently several windows behind; any dropped record or sink error is a finding too.
SINK_BACKLOG_RECORDS = 3
SINK_BACKLOG_WINDOWS = 2


def find(run: RunMetrics) -> Finding | str | None:
    if not (run.has("sink/backlog") or run.has("sink/dropped")):
        return "metric sinks: sink/backlog and sink/dropped were not recorded"
    _, backlog = run.series("sink/backlog", steady=True)
    _, dropped = run.series("sink/dropped")
    _, errors = run.series("sink/errors")
    num_dropped, num_errors = int(max(dropped, default=0)), int(max(errors, default=0))
    behind = sum(b >= SINK_BACKLOG_RECORDS for b in backlog)
    if num_dropped == 0 and num_errors == 0 and behind < SINK_BACKLOG_WINDOWS:
        return None
    evidence = []
    if num_dropped:
        evidence.append(f"{num_dropped} metric records were dropped because the sink queue was full (sink/dropped)")
    if behind:
        evidence.append(
            f"the sink thread was {SINK_BACKLOG_RECORDS} or more records behind in {behind} of {len(backlog)} "
            f"steady windows, at most {int(max(backlog))} (sink/backlog; a healthy sink is at 0)"
        )
    if num_errors:
        evidence.append(f"{num_errors} sink calls raised (sink/errors; the first of each kind is in rank 0's log)")
    _, step_s = run.series("time/step_s", steady=True)
    log_every = run.setting("train", "log_every")
    if step_s and isinstance(log_every, int):
        evidence.append(f"a record is made every {duration(median(step_s) * log_every)} (train.log_every={log_every})")
    advice = [
        f"log less often: raise train.log_every{setting_note(run, 'train', 'log_every')}",
        f"make room for bursts: raise metrics.queue_size{setting_note(run, 'metrics', 'queue_size')}",
        "if W&B is on, use metrics.wandb_mode=offline and `wandb sync` later; with S3 storage, raise metrics.jsonl_flush_every_s",
    ]
    title = "Logging can't keep up: the metric sink " + ("dropped records" if num_dropped else "has a growing backlog" if behind else "raised errors")
    return Finding(
        key="sink_backlog", title=title, evidence=evidence, advice=advice,
        numbers={"dropped": num_dropped, "errors": num_errors, "max_backlog": max(backlog, default=0.0), "windows_behind": behind},
    )
