"""`raytrain-fast report`: a run's metrics from storage as PNG plots, one HTML page and a plain-language
diagnosis (data-bound, sink backlog, memory under-used, progressive slowdown, checkpoint stalls,
stragglers, stalls, host contention, host memory pressure), each finding with the numbers it rests on and what to change."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from raytrain_fast.report.diagnose import Diagnosis, Finding, diagnose
from raytrain_fast.report.load import ReportError, RunMetrics, from_records, load_run

if TYPE_CHECKING:
    from raytrain_fast.storage import StorageConfig

HTML_FILE = "report.html"


@dataclass(kw_only=True)
class Report:
    run: RunMetrics
    diagnosis: Diagnosis
    out_dir: str
    html_path: str
    pngs: list[str]
    """Paths of the PNG files written."""

    @property
    def text(self) -> str:
        """The diagnosis as printed to the terminal."""
        return self.diagnosis.to_text(self.run)


def make_report(storage_uri: str, name: str, *, out_dir: str, storage: StorageConfig | None = None) -> Report:
    """Read run `name` under `storage_uri`, write its plots and `report.html` to `out_dir`, diagnose it."""
    return report_for(load_run(storage_uri, name, storage=storage), out_dir=out_dir)


def report_for(run: RunMetrics, *, out_dir: str) -> Report:
    from raytrain_fast.report.html import render_html
    from raytrain_fast.report.plots import draw_plots

    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    diagnosis = diagnose(run)
    plots = draw_plots(run, out_dir)
    html_path = os.path.join(out_dir, HTML_FILE)
    with open(html_path, "w", encoding="utf-8") as out:
        out.write(render_html(run, diagnosis, plots, out_dir=out_dir))
    return Report(
        run=run, diagnosis=diagnosis, out_dir=out_dir, html_path=html_path,
        pngs=[os.path.join(out_dir, p.file) for p in plots.plots],
    )
