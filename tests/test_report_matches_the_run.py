"""The report must not contradict the run: advice the run already follows, saves
it miscounts or leaves off a plot, a resume it does not shade, a threshold it draws wrong, no duration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_fast.report import diagnose, from_records, load_run, report_for
from raytrain_fast.report.plots import draw_plots
from tests.test_report import CONFIG, records

pytestmark = pytest.mark.unit


def _underused(i, r):
    r["memory/peak_frac"] = 0.05


def test_memory_advice_does_not_recommend_auto_when_auto_chose_the_setting(tmp_path):
    config = {**CONFIG, "train": {**CONFIG["train"], "global_batch": 16}, "data": {"seq_len": 64},
              "model": {"d_model": 64, "num_layers": 2}, "resources": {"num_workers": 2}, "engine": {"zero_stage": 2, "precision": "fp32"}}
    recs = records(tweak=_underused)
    by_hand = diagnose(from_records(recs, config=config)).findings
    assert any("micro_batch: auto" in a for f in by_hand if f.key == "memory_underused" for a in f.advice)

    # The run's storage holds auto's choice for exactly these inputs (as autobatch caches it), and
    # the run's checkpoint and metrics are there too: the report reads both.
    (tmp_path / "_autobatch").mkdir()
    inputs = {"model": {"d_model": 64, "num_layers": 2, "activation_checkpointing": "none"}, "seq_len": 64, "device": "cpu",
              "world_size": 2, "zero_stage": 2, "precision": "fp32", "global_batch": 16, "memory_budget_gb": None, "cpus_per_worker": None}
    (tmp_path / "_autobatch" / "k.json").write_text(json.dumps({"micro_batch": 4, "grad_accum": 2, "key_inputs": inputs}))
    _write_run(tmp_path, "r", recs, config)
    run = load_run(str(tmp_path), "r")
    assert run.auto_micro_batch == 4
    finding = next(f for f in diagnose(run).findings if f.key == "memory_underused")
    assert not any("micro_batch: auto" in a and "set" in a for a in finding.advice), finding.advice
    assert any("auto" in e for e in finding.evidence)


def _write_run(root: Path, name: str, recs: list[dict], config: dict, *, checkpoints: tuple[int, ...] = ()) -> None:
    import yaml

    metrics = root / name / "metrics"
    metrics.mkdir(parents=True)
    header = {"_segment": {"restart": 0, "start_step": 0, "time": recs[0]["time"] - 1, "host": "h"}}
    (metrics / "metrics-r0000-p0000.jsonl").write_text("\n".join(json.dumps(r) for r in [header, *recs]) + "\n")
    for step in checkpoints or (recs[-1]["step"],):
        directory = root / name / f"checkpoint_{step:08d}"
        directory.mkdir()
        (directory / "config.yaml").write_text(yaml.safe_dump(config))


def _with_saves(i, r):
    if r["step"] in (25, 45):  # windows after the saves at 20 and 40 (every 20 steps, log every 5)
        r["checkpoint/blocked_s"] = 0.2


def test_saves_are_counted_and_plotted_including_the_last_one(tmp_path):
    config = {**CONFIG, "checkpoint": {"every_steps": 20, "upload": "sync"}, "train": {**CONFIG["train"], "steps": 60}}
    recs = records(num_windows=12, tweak=_with_saves)  # steps 5..60: saves at 20, 40 and the final 60
    run = from_records(recs, config=config)
    assert run.planned_saves() == [20, 40, 60]
    summary = diagnose(run).summary["checkpoint blocked"]
    assert "3 saves" in summary and "2 window(s)" in summary and "step 60" in summary, summary
    # A run stopped by a signal saved at 57, off the cadence: the directory holds it, the plot shows it.
    _write_run(tmp_path, "s", recs[:-1] + [{**recs[-1], "step": 57}], {**config, "train": {**config["train"], "steps": 100}},
               checkpoints=(40, 57))
    stopped = load_run(str(tmp_path), "s")
    assert stopped.planned_saves() == [20, 40, 57]
    draw_plots(stopped, str(tmp_path / "plots"))
    assert (tmp_path / "plots" / "checkpoint.png").exists()


def _axes_of(run, tmp_path, file: str):
    """The matplotlib axis draw_plots made for `file`, kept open to inspect what it drew."""
    import matplotlib.pyplot as plt

    from raytrain_fast.report import plots

    captured = {}
    original_close = plt.close

    def keep(figure):
        captured.setdefault(figure.axes[0].get_title(), figure)

    plt.close = keep
    try:
        plots.draw_plots(run, str(tmp_path))
    finally:
        plt.close = original_close
    title = next(spec.title for spec in plots._SPECS if spec.file == file)
    return captured[title].axes[0]


def test_first_window_after_a_resume_is_shaded_and_the_stall_threshold_follows_the_windows(tmp_path):
    def resumed_and_slowing(i, r):
        r["time/step_s"] = 0.1 * (1 + 0.1 * i)  # slower and slower: the threshold must rise with it
        if i >= 8:
            r["time"] += 600.0  # down for 10 minutes before step 45

    run = from_records(records(num_windows=14, tweak=resumed_and_slowing), config=CONFIG)
    assert run.restart_steps == [45]
    axis = _axes_of(run, tmp_path, "step_time.png")
    labels = [h.get_label() for h in axis.get_legend_handles_labels()[0]]
    assert any("after a resume" in label for label in labels), labels
    threshold = next(line for line in axis.get_lines() if "stall threshold" in line.get_label())
    values = list(threshold.get_ydata())
    assert "windows before" in threshold.get_label() and len(set(values)) > 1 and values[-1] > values[0], values


def test_report_gives_the_run_duration(tmp_path):
    recs = records(num_windows=10)  # 50 steps of 0.1 s: 5 s from the first step to the last record
    report = report_for(from_records(recs, config=CONFIG), out_dir=str(tmp_path))
    html = Path(report.html_path).read_text()
    assert "<th>duration</th><td>5.0 s from the first step" in html, html[:2000]
