"""A plain-language diagnosis of a run from its metrics: each finding says what is wrong, the numbers
it rests on, and what to change. One module per finding under report/findings/, each with its
thresholds and a `find(run)`; this module runs them in order.

Every rule judges the steady part of the run (warm-up and the first window after a resume left out,
see load.py) with medians, so one noisy log window on a busy machine never makes a finding. A rule
whose metrics the run does not have is skipped and the diagnosis says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from raytrain_fast.report.finding import Finding
from raytrain_fast.report.findings import (
    checkpoint_stall,
    corpus_repeated,
    data_bound,
    divergence,
    finite_divergence,
    hang,
    host_contention,
    memory_pressure,
    memory_underused,
    overfitting,
    sink_backlog,
    slowdown,
    spike,
    stall,
    straggler,
)
from raytrain_fast.report.load import RunMetrics
from raytrain_fast.report.mixture import mixture_lines
from raytrain_fast.report.summary import summarize
from raytrain_fast.report.tasks import task_lines

# A hang, a divergence or a spike is a finding however short the run: each returns a list.
EVENT_FINDINGS = (hang.find, divergence.find, finite_divergence.find, spike.find)
# The rest judge the steady windows; each returns a Finding, the reason it was skipped, or None.
STEADY_FINDINGS = (
    data_bound.find, sink_backlog.find, memory_underused.find, slowdown.find, checkpoint_stall.find, straggler.find,
    stall.find, host_contention.find, memory_pressure.find, overfitting.find, corpus_repeated.find,
)


@dataclass(kw_only=True)
class Diagnosis:
    findings: list[Finding]
    skipped: list[str]
    """Checks that could not run, and why (missing metrics, a single rank...)."""
    summary: dict[str, str]
    """Headline numbers of the run (label -> formatted value), for the terminal and the HTML table."""

    def keys(self) -> list[str]:
        return [f.key for f in self.findings]

    def to_text(self, run: RunMetrics) -> str:
        lines = [f"Run '{run.name}' ({run.uri}):"]
        width = max(len(k) for k in self.summary) if self.summary else 0
        lines += [f"  {label:<{width}}  {value}" for label, value in self.summary.items()]
        if mixture := mixture_lines(run):
            lines += ["", *mixture]
        if tasks := task_lines(run):
            lines += ["", *tasks]
        lines.append("")
        if not self.findings:
            lines.append("Diagnosis: no problems found in the steady part of the run.")
        else:
            lines.append(f"Diagnosis: {len(self.findings)} finding{'s' if len(self.findings) > 1 else ''}.")
        for number, finding in enumerate(self.findings, 1):
            lines += ["", f"{number}. {finding.title}", *(f"   - {item}" for item in finding.evidence)]
            lines += [f"   Change: {item}" for item in finding.advice]
        if self.skipped:
            lines += ["", "Not checked:", *(f"  - {item}" for item in self.skipped)]
        return "\n".join(lines)


def diagnose(run: RunMetrics) -> Diagnosis:
    findings: list[Finding] = [finding for find in EVENT_FINDINGS for finding in find(run)]
    skipped: list[str] = []
    if not run.steady:
        skipped.append(
            f"everything: the run logged {len(run.records)} record(s), all within warm-up (up to step "
            f"{run.warmup_steps}); train longer or log more often (train.log_every)"
        )
        return Diagnosis(findings=findings, skipped=skipped, summary=summarize(run))
    for find in STEADY_FINDINGS:
        result = find(run)
        if isinstance(result, Finding):
            findings.append(result)
        elif isinstance(result, str):
            skipped.append(result)
    return Diagnosis(findings=findings, skipped=skipped, summary=summarize(run))
