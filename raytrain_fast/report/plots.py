"""PNG plots of a run's metrics, drawn with matplotlib's Agg backend (no display, never a window).

Each plot is skipped, with the reason, when the run lacks its metrics.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.metrics.slowdown import STALL_WINDOWS
from raytrain_fast.report.findings.checkpoint_stall import CHECKPOINT_MAX_BLOCK_S
from raytrain_fast.report.findings.data_bound import DATA_WAIT_FRAC
from raytrain_fast.report.findings.memory_underused import MEMORY_UNDERUSED_FRAC
from raytrain_fast.report.findings.stall import replay_stalls, stall_factor
from raytrain_fast.report import tasks
from raytrain_fast.report.load import RunMetrics, median


@dataclass(kw_only=True)
class Plot:
    file: str
    """File name inside the output directory."""
    title: str
    caption: str


@dataclass(kw_only=True)
class PlotResult:
    plots: list[Plot]
    skipped: list[str]
    """'<title>: <why>' for each plot that was not drawn."""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only: no display, no window, works on headless nodes
    import matplotlib.pyplot as plt

    return plt


def draw_plots(run: RunMetrics, out_dir: str) -> PlotResult:
    os.makedirs(out_dir, exist_ok=True)
    plt = _pyplot()
    plots, skipped = [], []
    for spec in _SPECS:
        figure, axis = plt.subplots(figsize=(8, 3.6), dpi=100)
        try:
            why_not = spec.draw(run, axis)
            if why_not:
                skipped.append(f"{spec.title}: {why_not}")
                continue
            axis.set_title(spec.title)
            axis.grid(True, alpha=0.3)
            if spec.over_steps:
                axis.set_xlabel("step")
                if run.warmup_steps > run.records[0]["step"]:
                    axis.axvspan(run.records[0]["step"], run.warmup_steps, color="0.85", alpha=0.5, zorder=0, label="warm-up (left out)")
                _resume_spans(run, axis)
                _resize_markers(run, axis)
            entries = [ax.get_legend_handles_labels() for ax in figure.axes]  # a twin axis's lines too
            handles, labels = [h for hs, _ in entries for h in hs], [label for _, ls in entries for label in ls]
            if labels:
                if spec.legend_loc == "below":  # nothing on the axes to cover: spikes, band and lines stay visible
                    columns = _legend_columns(labels)
                    axis.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=columns,
                                fontsize="small", frameon=False)
                    # Taller by the legend's rows, so the axes keep their height (tight_layout fits the legend in).
                    figure.set_size_inches(8, 3.6 + _LEGEND_ROW_IN * -(-len(labels) // columns))
                else:
                    axis.legend(handles, labels, loc=spec.legend_loc, fontsize="small")
            figure.tight_layout()
            figure.savefig(os.path.join(out_dir, spec.file), bbox_inches="tight")
            plots.append(spec)
        finally:
            plt.close(figure)
    return PlotResult(plots=plots, skipped=skipped)


_FIGURE_PX, _CHAR_PX, _ENTRY_PX, _LEGEND_ROW_IN = 760, 6.0, 45, 0.2
"""The plot's width and, at fontsize small, a label character's and a legend entry's handle and gaps (pixels at dpi 100)."""


def _legend_columns(labels: list[str]) -> int:
    """Columns of a legend below the axes that fit in the figure's width: a wider legend would widen the
    saved image (bbox_inches="tight") and squeeze the plot into part of it."""
    widest = max(len(label) for label in labels) * _CHAR_PX + _ENTRY_PX
    return max(1, min(3, len(labels), int(_FIGURE_PX // widest)))


def _resume_spans(run: RunMetrics, axis) -> None:
    """The first window after each resume, shaded: a warm-up again, left out of the judgements."""
    steps = [r["step"] for r in run.records]
    for i, step in enumerate(run.restart_steps):
        before = max((s for s in steps if s < step), default=step - run.log_every)
        axis.axvspan(before, step, color="tab:blue", alpha=0.12, zorder=0, label="first window after a resume (left out)" if i == 0 else None)


def _resize_markers(run: RunMetrics, axis) -> None:
    """A dashed line at each resize of an elastic run, labelled with the worker counts."""
    for i, (step, before, after) in enumerate(run.resizes()):
        axis.axvline(step, color="tab:red", linestyle="--", linewidth=1, label="resize (workers)" if i == 0 else None)
        axis.annotate(f"{before}→{after}", (step, 0.98), xycoords=("data", "axes fraction"), ha="left", va="top",
                      fontsize="small", color="tab:red")


@dataclass(kw_only=True)
class _Spec(Plot):
    draw: Callable[[RunMetrics, object], str | None]
    """Draws on the axis; returns why it could not (missing metrics), or None."""
    legend_loc: str = "best"
    over_steps: bool = True
    """The x axis is the step: warm-up, resumes and resizes are marked on it."""


def _loss(run: RunMetrics, axis) -> str | None:
    steps, loss = run.series("train/loss")
    if not loss:
        return "train/loss was not recorded"
    axis.plot(steps, loss, marker=".", label="train/loss")
    _val_loss(run, axis)
    _divergence_marks(run, axis, dict(zip(steps, loss)))
    axis.set_ylabel("loss")
    return None


def _divergence_marks(run: RunMetrics, axis, loss_at: dict[int, float]) -> None:
    """The uniform-guess loss once the run's loss has come near it, and each divergence episode's start."""
    import math

    from raytrain_fast.report.findings.finite_divergence import episodes

    vocab = run.setting("model", "vocab_size")
    if isinstance(vocab, int) and loss_at and max(loss_at.values()) > 0.5 * math.log(vocab):
        axis.axhline(math.log(vocab), color="tab:red", linestyle=":", linewidth=1,
                     label=f"uniform guess, ln({vocab}) = {math.log(vocab):.2f}")
    starts = [int(r["step"]) for r in episodes(run)[0] if int(r["step"]) in loss_at]
    if starts:
        axis.scatter(starts, [loss_at[s] for s in starts], color="tab:red", marker="x", s=60, zorder=4, label="divergence")


def _val_loss(run: RunMetrics, axis) -> None:
    """val/loss on the loss plot, where the run evaluated (a wide gap below train/loss that grows
    while train/loss falls is memorisation: see the overfitting finding); a mixture's val/loss of
    each source beside it, dashed."""
    steps, val = run.series("val/loss")
    if val:
        axis.plot(steps, val, marker="o", label="val/loss (held out)")
    for name in run.names_under("val/loss/"):
        axis.plot(*run.series(f"val/loss/{name}"), marker=".", linestyle="--", label=f"val/loss/{name}")


def _throughput(run: RunMetrics, axis) -> str | None:
    from matplotlib.ticker import FuncFormatter

    steps, tps = run.series("throughput/tokens_per_sec")
    if not tps:
        return "throughput/tokens_per_sec was not recorded"
    axis.plot(steps, tps, marker=".", color="tab:blue", label="tokens/s")
    axis.set_ylabel("tokens/s")
    axis.set_ylim(0, 1.1 * max(tps))
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))  # 12,500 rather than 12500
    return None


def _mfu(run: RunMetrics, axis) -> str | None:
    """MFU on its own axes: with a fixed peak it is tokens/s times a constant, and on one plot the
    two lines sat exactly on top of each other."""
    drawn = []
    for metric, label, color in (("throughput/mfu", "MFU (datasheet peak)", "tab:red"), ("throughput/mfu_measured_peak", "MFU (measured peak)", "tab:orange")):
        steps, mfu = run.series(metric)
        if mfu:
            axis.plot(steps, [100 * v for v in mfu], marker=".", color=color, label=label)
            drawn += mfu
    if not drawn:
        return "neither throughput/mfu nor throughput/mfu_measured_peak was recorded"
    axis.set_ylabel("% of peak FLOP/s")
    axis.set_ylim(0, 110 * max(drawn))
    return None


def _data_wait(run: RunMetrics, axis) -> str | None:
    steps, frac = run.series("time/data_wait_frac")
    if not frac:
        return "time/data_wait_frac was not recorded"
    axis.plot(steps, [100 * v for v in frac], marker=".", label="data wait (rank that waited most)")
    low_steps, low = run.series("time/data_wait_frac_rank_min")
    if low:
        axis.plot(low_steps, [100 * v for v in low], marker=".", label="data wait (rank that waited least)")
    axis.axhline(100 * DATA_WAIT_FRAC, color="tab:red", linestyle="--", label=f"data-bound above {DATA_WAIT_FRAC:.0%}")
    axis.set_ylabel("% of step time")
    axis.set_ylim(bottom=0)
    return None


def _step_time(run: RunMetrics, axis) -> str | None:
    steps, step_s = run.series("time/step_s")
    if not step_s:
        return "time/step_s was not recorded"
    ms = [1e3 * v for v in step_s]
    axis.plot(steps, ms, marker=".", label="step time")
    by_step = dict(zip(steps, ms))
    found, thresholds = replay_stalls(run)
    baseline = _baseline_band(run, axis, thresholds)
    alert_steps = [s for s, v in zip(*run.series("alert/slowdown")) if v >= 1 and s in by_step]
    if alert_steps:
        axis.scatter(alert_steps, [by_step[s] for s in alert_steps], color="tab:red", zorder=3, s=40, label="slowdown alert")
    for record in run.records:
        causes = [k.removeprefix("alert/slowdown_cause/") for k in record if k.startswith("alert/slowdown_cause/")]
        if causes and record["step"] in by_step:
            axis.annotate(
                ", ".join(causes), (record["step"], by_step[record["step"]]), textcoords="offset points",
                xytext=(0, 8), ha="center", fontsize="small", color="tab:red",
            )
    spread_steps, spread = run.series("time/step_s_rank_spread")
    gaps = []
    if spread:
        windows = run.window_steps()
        gaps = [1e3 * v * windows[s] for s, v in zip(spread_steps, spread)]
        axis.plot(spread_steps, gaps, marker=".", color="tab:gray", label="rank arrival gap")
    axis.set_ylabel("ms")
    stalls = {stall.step for stall in found}
    # Scale to the steady windows that are not stalls, so one 70x window (or the first window's
    # startup) never flattens the baseline: what is above the scale is drawn at its top, with its value.
    steady = [v for s, v in zip(steps, ms) if s > run.warmup_steps and s not in stalls]
    steady += [g for s, g in zip(spread_steps, gaps) if s > run.warmup_steps]
    top = max(1.25 * max(steady, default=0.0), 1.15e3 * max(thresholds.values(), default=0.0) if baseline else 0.0)
    above = [(s, v) for s, v in zip(steps, ms) if v > top]
    if top > 0 and (above or max(gaps, default=0.0) > top):
        axis.set_ylim(0, top)
        for s, v in above:
            stalled = s in stalls
            axis.scatter([s], [top], marker="^", s=60, clip_on=False, zorder=4, color="tab:purple" if stalled else "0.4")
            axis.annotate(
                f"{v:,.0f} ms" + (" (stall)" if stalled else ""), (s, top), textcoords="offset points", xytext=(7, -3),
                ha="left", va="top", fontsize="small", color="tab:purple" if stalled else "0.3",
            )
    else:
        axis.set_ylim(bottom=0)
    if stalls:  # those off the scale are drawn at its top above; the label stands for both
        in_scale = [s for s in stalls if s in by_step and by_step[s] <= top]
        axis.scatter(in_scale, [by_step[s] for s in in_scale], marker="^", s=60, zorder=4, color="tab:purple",
                     label="stall (value at the top when off the scale)")
    return None


def _baseline_band(run: RunMetrics, axis, stall_thresholds: dict[int, float]) -> float | None:
    """The slowdown detector's baseline (median step time of the first windows after warm-up), its
    threshold as a band and the stall threshold as the detector applied it to each window (step ->
    seconds: a flat line at the baseline would claim a threshold no detector uses); returns the baseline in ms."""
    steady = [1e3 * v for _, v in zip(*run.series("time/step_s", steady=True))]
    windows = int(run.setting("metrics", "slowdown_windows", MetricsConfig.slowdown_windows))
    if len(steady) < windows:
        return None
    baseline = median(steady[:windows])
    threshold = float(run.setting("metrics", "slowdown_threshold", MetricsConfig.slowdown_threshold))
    axis.axhspan(baseline, baseline * (1 + threshold), color="tab:green", alpha=0.15, zorder=0,
                 label=f"baseline {baseline:,.0f} ms to +{threshold:.0%} (slowdown alert above)")
    if stall_thresholds:
        axis.plot(list(stall_thresholds), [1e3 * t for t in stall_thresholds.values()], drawstyle="steps-pre",
                  color="tab:purple", linestyle=":", linewidth=1,
                  label=f"stall threshold ({stall_factor(run):.1f}x the median of the "
                        f"{STALL_WINDOWS} windows before)")
    return baseline


def _checkpoint(run: RunMetrics, axis) -> str | None:
    """Each checkpoint at the step it was saved: its blocked time is recorded in the next window's
    record, and an async upload's duration at the save after it."""
    steps, blocked = run.series("checkpoint/blocked_s")
    up_steps, upload = run.series("checkpoint/upload_s")
    if not blocked and not upload:
        return "no checkpoint was saved between two log steps (checkpoint/blocked_s and checkpoint/upload_s absent)"
    planned = run.planned_saves()
    for i, save in enumerate(planned):
        axis.axvline(save, color="0.6", linestyle=":", linewidth=1, label="checkpoint saved" if i == 0 else None)
    width = max(1.0, 0.4 * min(run.window_steps().values()))
    if blocked:
        at = [(save, seconds) for step, seconds in zip(steps, blocked) for save in run.saves_in_window(step)]
        axis.bar([a for a, _ in at], [b for _, b in at], width=width, label="training blocked by the save")
    if upload:
        asynchronous = run.setting("checkpoint", "upload", "async") == "async"
        points = []
        for step, seconds in zip(up_steps, upload):
            save = run.saves_in_window(step)[0]
            if asynchronous:  # read when the next save waits for it: it belongs to the save before
                earlier = [s for s in planned if s < save]
                save = earlier[-1] if earlier else save
            points.append((save, seconds))
        axis.plot([p for p, _ in points], [u for _, u in points], marker="o", linestyle="", color="tab:orange", label="its upload took")
    if blocked and max(blocked) > 0.5 * CHECKPOINT_MAX_BLOCK_S:
        axis.axhline(CHECKPOINT_MAX_BLOCK_S, color="tab:red", linestyle="--", label=f"stall above {CHECKPOINT_MAX_BLOCK_S:.0f} s")
    axis.set_ylabel("seconds")
    axis.set_ylim(bottom=0)
    return None


def _memory(run: RunMetrics, axis) -> str | None:
    steps, peak = run.series("memory/peak_gb")
    if not peak:
        return "memory/peak_gb was not recorded"
    axis.plot(steps, peak, marker=".", label="peak")
    cur_steps, current = run.series("memory/current_gb")
    if current:
        axis.plot(cur_steps, current, marker=".", label="in use at the log step")
    axis.set_ylabel("GB")
    axis.set_ylim(0, 1.15 * max(peak + current))  # headroom: the peak line is never drawn on the frame
    frac_steps, frac = run.series("memory/peak_frac")
    if frac:
        frac_axis = axis.twinx()
        frac_axis.plot(frac_steps, [100 * v for v in frac], color="tab:green", linestyle=":", label="peak, % of available")
        frac_axis.axhline(100 * MEMORY_UNDERUSED_FRAC, color="tab:red", linestyle="--", label=f"under-used below {MEMORY_UNDERUSED_FRAC:.0%}")
        frac_axis.set_ylim(0, 1.15 * max(100.0, 100 * max(frac)))
        frac_axis.set_ylabel("% of available")
    return None


_SPECS = [
    _Spec(file="loss.png", title="Training loss", caption="train/loss: mean over each log window; val/loss: the held-out set at "
          "each evaluation (a mixture's: each source's, dashed, and their weighted mean).", draw=_loss),
    _Spec(
        file="throughput.png", title="Throughput",
        caption="Tokens per second across all ranks, checkpoint stalls included.", draw=_throughput,
    ),
    _Spec(
        file="mfu.png", title="Model FLOPs utilisation",
        caption="Model FLOPs per second as a share of the device's datasheet peak (GPUs) and of the matmul peak measured "
        "on this device type in the training dtype.", draw=_mfu,
    ),
    _Spec(
        file="data_wait.png", title="Data-wait share",
        caption="Share of each window spent waiting for the next batch; the dashed line is the data-bound threshold.", draw=_data_wait,
    ),
    _Spec(
        file="step_time.png", title="Step time, slowdowns and stalls",
        caption="Wall time per optimizer step. The green band runs from the baseline (the first windows after warm-up) to the "
        "slowdown threshold: a run without alerts stays near it. Red dots are windows where the slowdown detector was on, "
        "labelled with its cause; purple triangles are stalls (a window far slower than the ones before it), drawn at the top "
        "with their value when off the scale, and the dotted purple steps are the stall threshold each window was held to; grey, when present, is how much later the slowest rank reached the log step.",
        draw=_step_time, legend_loc="below",
    ),
    _Spec(
        file="checkpoint.png", title="Checkpoint blocked time",
        caption="Each checkpoint at the step it was saved (dotted): seconds training was blocked by it (bars; the final save "
        "is after the last record, so it has none) and how long its upload took (dots).", draw=_checkpoint,
    ),
    _Spec(
        file="memory.png", title="Memory", caption="Peak and current memory (GPU allocator or process RSS on CPU).",
        draw=_memory, legend_loc="below",  # two y axes: "best" only sees the first one's lines
    ),
    _Spec(file="tasks.png", title=tasks.TITLE, caption=tasks.CAPTION, draw=tasks.draw_tasks, legend_loc="below", over_steps=False),
]
