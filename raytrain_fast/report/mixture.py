"""The realised mixture against its weights (data.sources), from the run's metrics records.

Each record holds `data/tokens/<name>` (the tokens of each source trained on up to its step: a
function of the data position, exact and continued across resumes) and `data/weight/<name>` (the
weights in force). So the report can say, for each stretch of the run with one set of weights (a
resume may change them: checkpoint.allow_changes=data) and for every log window in it, what share
each source actually had, and how far that is from its weight. The stream's schedule holds every
window of G sequences within 2 sequences of G x weight (docs/data.md#mixtures); a window here is a
log window of many sequences, so its share sits within 2 / (sequences in the window) of the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raytrain_fast.report.finding import pct
from raytrain_fast.report.load import RunMetrics

PREFIX, WEIGHT = "data/tokens/", "data/weight/"


@dataclass(kw_only=True)
class SourceShare:
    name: str
    weight: float
    """Its weight in this stretch, normalised to sum 1 (0: not in the mixture then)."""
    tokens: float
    """Tokens of this source trained on in the stretch."""
    share: float
    """Realised share of the stretch: tokens / all sources' tokens."""
    worst_window_share: float
    """The log window whose share was furthest from the weight: its share."""
    worst_window_step: int
    """The step that closed that window."""


@dataclass(kw_only=True)
class MixtureStretch:
    """Steps first..last of the run, trained on one set of weights."""

    first: int
    last: int
    shares: list[SourceShare]

    @property
    def steps(self) -> str:
        """How the report names the stretch: 'steps 1-40'."""
        return f"steps {self.first:,}-{self.last:,}"


def configured_weights(run: RunMetrics, names: list[str]) -> dict[str, float]:
    """Each source's weight from the run's config (data.sources), normalised; 0 for a source it lacks:
    for records written without `data/weight/<name>`."""
    raw: dict[str, float] = {}
    for item in run.setting("data", "sources", []) or []:
        if isinstance(item, dict):
            source = str(item.get("source", ""))
            name = item.get("name") or source.rstrip("/").rsplit("/", 1)[-1] or source
            raw[name] = float(item.get("weight", 0.0))
    total = sum(raw.get(n, 0.0) for n in names) or 1.0
    return {n: raw.get(n, 0.0) / total for n in names}


def mixture_stretches(run: RunMetrics) -> list[MixtureStretch]:
    """The realised share of each source in every stretch of the run with one set of weights (empty:
    no record counts tokens per source). A stretch of one source has nothing to compare and is left out."""
    names = run.names_under(PREFIX)
    timeline = {r["step"]: r for r in run.records if any(f"{PREFIX}{n}" in r for n in names)}  # a resume's own records last
    if not timeline:
        return []
    configured = configured_weights(run, names)
    windows: list[tuple[int, dict[str, float], dict[str, float]]] = []  # (step, tokens in the window, weights)
    before = dict.fromkeys(names, 0.0)
    for step, record in sorted(timeline.items()):
        tokens = {n: float(record.get(f"{PREFIX}{n}", before[n])) for n in names}
        recorded = any(f"{WEIGHT}{n}" in record for n in names)  # the weights in force (records without them: the config's)
        weights = {n: float(record.get(f"{WEIGHT}{n}", 0.0)) for n in names} if recorded else configured
        if sum(tokens.values()) > sum(before.values()):  # a rollback to an earlier checkpoint: the counts went back
            windows.append((step, {n: tokens[n] - before[n] for n in names}, weights))
        before = tokens
    stretches: list[MixtureStretch] = []
    start = 0
    for index, (step, _, weights) in enumerate(windows):
        if index + 1 == len(windows) or windows[index + 1][2] != weights:
            stretches.append(_stretch(names, windows[start:index + 1], first=windows[start - 1][0] if start else 0))
            start = index + 1
    return [s for s in stretches if sum(share.weight > 0 for share in s.shares) > 1]


def _stretch(names: list[str], windows: list[tuple[int, dict[str, float], dict[str, float]]], *, first: int) -> MixtureStretch:
    weights = windows[0][2]
    total = sum(sum(given.values()) for _, given, _ in windows) or 1.0
    shares = []
    for name in names:
        tokens = sum(given[name] for _, given, _ in windows)
        worst, worst_step = max(((given[name] / sum(given.values()), step) for step, given, _ in windows),
                                key=lambda window: abs(window[0] - weights[name]))
        shares.append(SourceShare(name=name, weight=weights[name], tokens=tokens, share=tokens / total,
                                  worst_window_share=worst, worst_window_step=worst_step))
    return MixtureStretch(first=first, last=windows[-1][0], shares=shares)


def mixture_lines(run: RunMetrics) -> list[str]:
    """The report's text: per stretch of one set of weights, one line per source (weight, realised
    share, worst window), or none."""
    stretches = mixture_stretches(run)
    lines = []
    for i, stretch in enumerate(stretches):
        changed = f", {stretch.steps}" if len(stretches) > 1 else ""
        changed += ": weights changed on resume" if i > 0 else ""
        lines.append(f"Mixture (realised to step {stretch.last:,} against data.sources' weights{changed}):")
        for s in stretch.shares:
            window = f"; worst log window {pct(s.worst_window_share)} (step {s.worst_window_step:,})"
            lines.append(f"  {s.name}: weight {pct(s.weight)}, realised {pct(s.share)} of {s.tokens:,.0f} tokens{window}")
    if stretches and (note := evaluated_sources_note(run, [s.name for s in stretches[-1].shares])):
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
    """{source: 'weight W, realised R'} for the report's facts table (empty: not a mixture); one
    entry per stretch and source, named by its steps, when a resume changed the weights."""
    stretches = mixture_stretches(run)
    facts = {}
    for stretch in stretches:
        steps = f" ({stretch.steps})" if len(stretches) > 1 else ""
        facts.update({f"mixture: {s.name}{steps}": f"weight {pct(s.weight)}, realised {pct(s.share)}" for s in stretch.shares})
    return facts
