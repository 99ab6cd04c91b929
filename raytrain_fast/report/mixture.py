"""The realised mixture against the weights (data.sources), from the run's metrics records.

Each record holds `data/tokens/<name>`: the tokens of each source trained on up to its step (a
function of the data position: exact, and continued across resumes). So the report can say, for the
whole run and for every log window, what share each source actually had, and how far that is from
its weight. The stream's schedule holds every window of G sequences within 2 sequences of G x weight
(docs/data.md#mixtures); a window here is a log window of many sequences, so its share sits within
2 / (sequences in the window) of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrain_fast.report.finding import pct
from raytrain_fast.report.load import RunMetrics

PREFIX = "data/tokens/"


@dataclass(kw_only=True)
class SourceShare:
    name: str
    weight: float
    """Configured weight, normalised to sum 1 (None-free: sources without a weight in the config get 0)."""
    tokens: float
    """Tokens of this source trained on by the last record."""
    share: float
    """Realised share of the whole run: tokens / all sources' tokens."""
    worst_window_share: float
    """The log window whose share was furthest from the weight: its share."""
    worst_window_step: int | None
    """The step that closed that window (None with a single record)."""


def configured_weights(run: RunMetrics, names: list[str]) -> dict[str, float]:
    """Each source's weight from the run's config (data.sources), normalised; 0 for a source it lacks."""
    raw: dict[str, float] = {}
    for item in run.setting("data", "sources", []) or []:
        if isinstance(item, dict):
            source = str(item.get("source", ""))
            name = item.get("name") or source.rstrip("/").rsplit("/", 1)[-1] or source
            raw[name] = float(item.get("weight", 0.0))
    total = sum(raw.get(n, 0.0) for n in names) or 1.0
    return {n: raw.get(n, 0.0) / total for n in names}


def realised_mixture(run: RunMetrics) -> list[SourceShare]:
    """The realised share of each source, for the run and for its worst log window (empty: no mixture)."""
    names = run.names_under(PREFIX)  # the mixture's sources
    rows = [r for r in run.records if all(f"{PREFIX}{n}" in r for n in names)]
    if not names or not rows:
        return []
    weights = configured_weights(run, names)
    tokens = [(int(r["step"]), {n: float(r[f"{PREFIX}{n}"]) for n in names}) for r in rows]
    last = tokens[-1][1]
    total = sum(last.values()) or 1.0
    shares = []
    for name in names:
        worst, worst_step = last[name] / total, None
        for (_, before), (step, after) in zip(tokens, tokens[1:]):
            window = sum(after[n] - before[n] for n in names)
            if window <= 0:
                continue  # a rollback or a resume from an earlier checkpoint: the counts went back
            share = (after[name] - before[name]) / window
            if worst_step is None or abs(share - weights[name]) > abs(worst - weights[name]):
                worst, worst_step = share, step
        shares.append(SourceShare(
            name=name, weight=weights[name], tokens=last[name], share=last[name] / total,
            worst_window_share=worst, worst_window_step=worst_step,
        ))
    return shares


def mixture_lines(run: RunMetrics) -> list[str]:
    """The report's text: one line per source (weight, realised share, worst window), or none."""
    shares = realised_mixture(run)
    if not shares:
        return []
    lines = [f"Mixture (realised to step {run.last_step:,} against data.sources' weights):"]
    for s in shares:
        window = f"; worst log window {pct(s.worst_window_share)} (step {s.worst_window_step:,})" if s.worst_window_step else ""
        lines.append(f"  {s.name}: weight {pct(s.weight)}, realised {pct(s.share)} of {s.tokens:,.0f} tokens{window}")
    if note := evaluated_sources_note(run, [s.name for s in shares]):
        lines.append(f"  {note}")
    return lines


def evaluated_sources_note(run: RunMetrics, names: list[str]) -> str | None:
    """What val/loss covers when only some sources were evaluated (val/loss/<name> is recorded for those)."""
    evaluated = [n for n in names if run.has(f"val/loss/{n}")]
    left_out = [n for n in names if n not in evaluated]
    if not evaluated or not left_out:
        return None
    return (f"val/loss covers {', '.join(evaluated)} only: {', '.join(left_out)} had no validation split "
            "(its text is not evaluated)")


def mixture_facts(run: RunMetrics) -> dict[str, Any]:
    """{source: 'weight W, realised R'} for the report's facts table (empty: not a mixture)."""
    return {f"mixture: {s.name}": f"weight {pct(s.weight)}, realised {pct(s.share)}" for s in realised_mixture(run)}
