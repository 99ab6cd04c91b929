"""A finding of the diagnosis (what is wrong, the numbers, what to change) and the words its rules share."""

from __future__ import annotations

from dataclasses import dataclass, field

from raytrain_fast.report.load import RunMetrics, median


@dataclass(kw_only=True)
class Finding:
    key: str
    """data_bound, sink_backlog, memory_underused, slowdown, checkpoint_stall, straggler, stall,
    host_contention, memory_pressure, overfitting, corpus_repeated, hang, divergence or spike."""
    title: str
    evidence: list[str]
    """The numbers the finding rests on, in words."""
    advice: list[str]
    """What to change."""
    numbers: dict[str, float] = field(default_factory=dict)


def pct(value: float) -> str:
    return f"{value:.1%}" if value < 0.1 else f"{value:.0%}"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def steady_note(run: RunMetrics, count: int) -> str:
    return f"{count} log windows after warm-up (steps {run.warmup_steps + 1}-{run.last_step})"


def setting_note(run: RunMetrics, section: str, key: str) -> str:
    value = run.setting(section, key)
    return f" (now {value})" if value is not None else ""


def more_data(run: RunMetrics) -> str:
    """Where more training text goes: data.sources for a mixture, else data.source."""
    if run.setting("data", "sources"):
        return "more or larger sources in data.sources"
    return "a larger corpus (data.source)"


def median_step_s(run: RunMetrics) -> float:
    """The median time/step_s over every record (NaN without one): what the time lost is priced at."""
    return median([r["time/step_s"] for r in run.records if "time/step_s" in r])
