"""One self-contained HTML page: what the run was, the summary, the diagnosis and the plots, the
images embedded (data URIs), so the one file can be mailed or attached. The PNGs stay beside it too."""

from __future__ import annotations

import base64
import os
import re
from html import escape

from raytrain_fast.report.diagnose import Diagnosis
from raytrain_fast.report.summary import run_facts
from raytrain_fast.report.load import RunMetrics
from raytrain_fast.report.plots import PlotResult
from raytrain_fast.report.tasks import task_rows

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 960px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin-bottom: 1.5em; }
td, th { border: 1px solid #ccc; padding: 4px 10px; text-align: left; vertical-align: top; }
.finding { border-left: 4px solid #c0392b; padding: 0.2em 1em; margin: 1em 0; background: #fdf3f2; }
.clean { border-left: 4px solid #27ae60; padding: 0.5em 1em; background: #f1faf4; }
.note { color: #666; }
figure { margin: 1.5em 0; }
figcaption { color: #555; font-size: 0.9em; }
img { max-width: 100%; }
code { font-family: ui-monospace, monospace; background: #f3f3f3; padding: 0 0.2em; border-radius: 3px; }
"""


_CODE = re.compile(r"`([^`]+)`")


def inline(text: str) -> str:
    """`text` as HTML: escaped, and each `code` span (the terminal text's backticks) set as code."""
    return _CODE.sub(r"<code>\1</code>", escape(text))


def _table(rows: dict[str, str]) -> list[str]:
    return ["<table>", *(f"<tr><th>{inline(label)}</th><td>{inline(value)}</td></tr>" for label, value in rows.items()), "</table>"]


def render_html(run: RunMetrics, diagnosis: Diagnosis, plots: PlotResult, *, out_dir: str) -> str:
    """The page; the PNGs are read from `out_dir` and embedded."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>Run report: {escape(run.name)}</title>",
        f"<style>{_STYLE}</style></head><body>",
        f"<h1>Run report: {escape(run.name)}</h1>",
        f'<p class="note">{escape(run.uri)}</p>',
    ]
    facts = run_facts(run)
    if facts:
        parts += ["<h2>Run</h2>", *_table(facts)]
    parts += ["<h2>Summary</h2>", *_table(diagnosis.summary)]
    rows = task_rows(run)
    if rows:
        header = "".join(f"<th>{escape(k)}</th>" for k in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{escape(v)}</td>" for v in row.values()) + "</tr>" for row in rows)
        parts += ["<h2>Downstream tasks</h2>", f"<table><tr>{header}</tr>{body}</table>",
                  '<p class="note">acc at the first and last evaluation (last: acc / acc_norm) and the best acc of the run.</p>']

    parts.append("<h2>Diagnosis</h2>")
    if not diagnosis.findings:
        parts.append('<p class="clean">No problems found in the steady part of the run.</p>')
    for finding in diagnosis.findings:
        parts.append(f'<div class="finding" id="{escape(finding.key)}"><h3>{inline(finding.title)}</h3>')
        parts.append("<p>Based on:</p><ul>" + "".join(f"<li>{inline(e)}</li>" for e in finding.evidence) + "</ul>")
        parts.append("<p>What to change:</p><ul>" + "".join(f"<li>{inline(a)}</li>" for a in finding.advice) + "</ul></div>")
    if diagnosis.skipped:
        parts.append("<h3>Not checked</h3><ul>" + "".join(f'<li class="note">{inline(s)}</li>' for s in diagnosis.skipped) + "</ul>")

    parts.append("<h2>Plots</h2>")
    for plot in plots.plots:
        with open(os.path.join(out_dir, plot.file), "rb") as png:
            data_uri = "data:image/png;base64," + base64.b64encode(png.read()).decode("ascii")
        parts.append(
            f'<figure id="{escape(plot.file)}"><img src="{data_uri}" alt="{escape(plot.title)}">'
            f"<figcaption>{inline(plot.caption)}</figcaption></figure>"
        )
    if plots.skipped:
        parts.append("<h3>Plots not drawn</h3><ul>" + "".join(f'<li class="note">{inline(s)}</li>' for s in plots.skipped) + "</ul>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
