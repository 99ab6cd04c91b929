"""A sweep's results: one row per micro-batch (and activation checkpointing setting, when the sweep
tries several), the terminal table, CSV and JSON in storage, and the best setting as a config file
for `raytrain-fast pretrain --config`."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import statistics
import typing
from dataclasses import dataclass
from typing import Any

import yaml

from raytrain_fast.config import Config
from raytrain_fast.microbatch import OK, fastest
from raytrain_fast.config.model import ModelConfig
from raytrain_fast.storage import redact

ACTIVATION_CHECKPOINTING: tuple[str, ...] = typing.get_args(typing.get_type_hints(ModelConfig)["activation_checkpointing"])
"""The values of model.activation_checkpointing a sweep may try (none, full, every_n)."""


@dataclass(kw_only=True)
class SweepRow:
    micro_batch: int
    grad_accum: int | None
    activation_checkpointing: str = ""
    """The trial's model.activation_checkpointing; empty on a skipped micro-batch's one row when the
    sweep tried several values (it is skipped for all of them)."""
    status: str
    """ok, stopped (stopped early: clearly behind the best trial at the same window), failed, or skipped."""
    reason: str = ""
    """Why it is not ok; for failed one line in the `microbatch.classify_error` forms ("out of memory: ...",
    "over memory budget: ...", "<ErrorType>: ...")."""
    tokens_per_sec: float | None = None
    """Median over the trial's log windows after the first (warm-up), all workers together."""
    tokens_per_sec_low: float | None = None
    tokens_per_sec_high: float | None = None
    """The lower and upper quartile of those windows (their middle half): how far a trial's own windows
    spread, without the one window another process happened to slow."""
    windows: int = 0
    """Log windows after the first that the median is over."""
    load_per_cpu: float | None = None
    """Median 1-minute load average per CPU of the node over the trial's windows (host/load_per_cpu)."""
    mfu: float | None = None
    """Against the datasheet peak (absent on CPUs and unlisted devices)."""
    mfu_measured_peak: float | None = None
    """Against the matmul peak measured on this device in the training dtype."""
    peak_gb: float | None = None
    peak_frac: float | None = None
    """peak_gb / (device memory or resources.memory_budget_gb)."""
    final_loss: float | None = None
    final_val_loss: float | None = None
    """val/loss at the trial's last evaluation (objective val_loss evaluates every window)."""
    steps_done: int = 0
    best: bool = False
    run_name: str = ""


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def row_from_reports(*, micro_batch: int, grad_accum: int, reports: list[dict[str, Any]], steps: int,
                     error: str | None, run_name: str = "", activation_checkpointing: str = "") -> SweepRow:
    """Summarise a trial's reported log windows (first window = warm-up, left out of the speed)."""
    steady = reports[1:] if len(reports) > 1 else reports

    def series(name: str, windows: list[dict[str, Any]]) -> list[float]:
        return [float(r[name]) for r in windows if r.get(name) is not None and r[name] == r[name]]  # not NaN

    speeds = series("throughput/tokens_per_sec", steady)
    low, _, high = statistics.quantiles(speeds, n=4, method="inclusive") if len(speeds) > 1 else (None, None, None)
    peaks = series("memory/peak_gb", reports)
    fracs = series("memory/peak_frac", reports)
    losses = series("train/loss", reports)
    val_losses = series("val/loss", reports)
    steps_done = max((int(r.get("step", 0)) for r in reports), default=0)
    status = "failed" if error else "stopped" if steps_done < steps else OK
    return SweepRow(
        micro_batch=micro_batch, grad_accum=grad_accum, activation_checkpointing=activation_checkpointing, status=status,
        reason=error or ("early: more than 10% behind the best trial at the same window" if status == "stopped" else ""),
        tokens_per_sec=_median(speeds), tokens_per_sec_low=low, tokens_per_sec_high=high,
        windows=len(speeds), load_per_cpu=_median(series("host/load_per_cpu", reports)),
        mfu=_median(series("throughput/mfu", steady)),
        mfu_measured_peak=_median(series("throughput/mfu_measured_peak", steady)),
        peak_gb=max(peaks) if peaks else None, peak_frac=max(fracs) if fracs else None,
        final_loss=losses[-1] if losses else None, final_val_loss=val_losses[-1] if val_losses else None,
        steps_done=steps_done, run_name=run_name,
    )


def pick_best(rows: list[SweepRow], *, objective: str) -> SweepRow | None:
    """Among trials that ran to the end: the most tokens/s, or the lowest final (validation) loss."""
    if objective in ("loss", "val_loss"):
        field = "final_loss" if objective == "loss" else "final_val_loss"
        done = [r for r in rows if r.status == OK and getattr(r, field) is not None]
        best = min(done, key=lambda r: getattr(r, field)) if done else None
    else:
        best = fastest(rows)  # the rule autobatch picks by
    if best is not None:
        best.best = True
    return best


def resolution(rows: list[SweepRow], *, objective: str) -> str:
    """Whether the best trial's lead over the next is larger than what else could make it: "" when it
    is (or there is nothing to compare), else one line saying it is not resolved, with the numbers.
    Two things besides the setting move a trial's tokens/s:
    - its own noise: the spread of its windows (the middle half: upper - lower quartile), against the
      gap between the two medians, trials stopped early among them (they were stopped on the same
      noisy windows);
    - the machine's load: a trial that ran while other processes held the CPUs got a share of them
      (about 1 / load per CPU above 1), so a lead no larger than the ratio of the two trials' loads
      may be the load's, not the setting's.
    Judged on tokens/s (the loss objectives compare one value per trial)."""
    done = sorted((r for r in rows if r.status in (OK, "stopped") and r.tokens_per_sec is not None and r.windows >= 2),
                  key=lambda r: r.tokens_per_sec, reverse=True)
    if objective != "tokens_per_sec" or len(done) < 2:
        return ""
    first, second = done[0], done[1]
    gap = first.tokens_per_sec - second.tokens_per_sec
    spread = max(first.tokens_per_sec_high - first.tokens_per_sec_low, second.tokens_per_sec_high - second.tokens_per_sec_low)
    if spread > gap:
        return (f"not resolved: {_label(first)} leads {_label(second)} by {gap:,.0f} tokens/s, less than the {spread:,.0f} "
                "tokens/s that the middle half of one trial's own windows spreads over; rerun with more --steps, on a "
                "quieter machine, before trusting the order")
    if first.load_per_cpu is None or second.load_per_cpu is None:
        return ""
    load_ratio = max(1.0, second.load_per_cpu) / max(1.0, first.load_per_cpu)  # the ratio of their CPU shares
    if first.tokens_per_sec <= load_ratio * second.tokens_per_sec:
        return (f"not resolved: {_label(first)} leads {_label(second)} by {first.tokens_per_sec / second.tokens_per_sec:.2f}x, "
                f"but it ran at a load per CPU of {first.load_per_cpu:.2f} against {second.load_per_cpu:.2f}: the load alone "
                f"can make a {load_ratio:.2f}x difference; rerun on a quieter machine before trusting the order")
    return ""


def load_note(rows: list[SweepRow]) -> str:
    """The machine load the trials saw (host/load_per_cpu), or "" when none was recorded."""
    loads = [r.load_per_cpu for r in rows if r.load_per_cpu is not None]
    if not loads:
        return ""
    busy = " (above 1: other processes shared the CPUs, and tokens/s moved with them)" if max(loads) > 1 else ""
    return (f"load/CPU: the machine's 1-minute load average per CPU during each trial (host/load_per_cpu): "
            + (f"{loads[0]:.2f}" if len(loads) == 1 else f"{min(loads):.2f} to {max(loads):.2f} across trials") + busy)


def _label(row: SweepRow) -> str:
    checkpointing = f" ({row.activation_checkpointing})" if row.activation_checkpointing not in ("", "none") else ""
    return f"micro-batch {row.micro_batch}{checkpointing}"


def _order(row: SweepRow) -> tuple[int, int]:
    """Micro-batch order; within one micro-batch, none, full, every_n (a skipped row first)."""
    setting = row.activation_checkpointing
    return row.micro_batch, ACTIVATION_CHECKPOINTING.index(setting) if setting in ACTIVATION_CHECKPOINTING else -1


def format_table(rows: list[SweepRow], *, notes: list[str] = ()) -> str:
    """The terminal table, one line per trial (or skipped micro-batch), in micro-batch order. An
    activation-checkpointing column when a row has it on (a sweep over it, or a config with it).
    tokens/s is the median of the trial's windows, with the slowest and fastest in brackets."""
    measured_only = any(r.mfu is None and r.mfu_measured_peak is not None for r in rows)
    checkpointing = any(r.activation_checkpointing not in ("", "none") for r in rows)
    loads = any(r.load_per_cpu is not None for r in rows)
    header = ["micro-batch", "accum", *(["act. ckpt"] if checkpointing else []), "tokens/s", "MFU", "peak memory",
              *(["load/CPU"] if loads else []), "status"]
    lines = []
    for r in sorted(rows, key=_order):
        if r.mfu is not None:
            mfu = f"{r.mfu:.1%}"
        elif r.mfu_measured_peak is not None:
            mfu = f"{r.mfu_measured_peak:.1%}*"
        else:
            mfu = "-"
        peak = "-" if r.peak_gb is None else f"{r.peak_gb:.2f} GB" + (f" ({r.peak_frac:.0%})" if r.peak_frac is not None else "")
        status = ("BEST" if r.best else r.status) + (f": {r.reason}" if r.reason else "")
        lines.append([
            str(r.micro_batch), "-" if r.grad_accum is None else str(r.grad_accum),
            *([r.activation_checkpointing or "-"] if checkpointing else []),
            _speed(r), mfu, peak, *([("-" if r.load_per_cpu is None else f"{r.load_per_cpu:.2f}")] if loads else []), status,
        ])
    columns = len(header) - 1  # right-aligned; the status last, as it comes
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) if lines else len(header[i]) for i in range(columns)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header[:columns], widths)) + "  " + header[columns]]
    out += ["  ".join(c.rjust(w) for c, w in zip(line[:columns], widths)) + "  " + line[columns] for line in lines]
    if measured_only:
        out.append("* against the matmul peak measured on this device (it has no datasheet peak)")
    if any(r.peak_frac is not None for r in rows):
        out.append("peak memory (%): share of the device's memory, or of resources.memory_budget_gb on CPUs")
    if any(r.windows >= 2 for r in rows):
        out.append("tokens/s: the median of a trial's log windows after the first [the middle half of them: lower - upper quartile]")
    out += [note for note in notes if note]
    return "\n".join(out)


def _speed(row: SweepRow) -> str:
    if row.tokens_per_sec is None:
        return "-"
    if row.tokens_per_sec_low is None or row.tokens_per_sec_high is None:
        return f"{row.tokens_per_sec:,.0f}"
    return f"{row.tokens_per_sec:,.0f} [{row.tokens_per_sec_low:,.0f}-{row.tokens_per_sec_high:,.0f}]"


def to_csv(rows: list[SweepRow]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=[f.name for f in dataclasses.fields(SweepRow)], lineterminator="\n")
    writer.writeheader()
    for r in sorted(rows, key=_order):
        writer.writerow(dataclasses.asdict(r))
    return buffer.getvalue()


def to_json(rows: list[SweepRow], *, summary: dict[str, Any]) -> str:
    return json.dumps({**summary, "trials": [dataclasses.asdict(r) for r in sorted(rows, key=_order)]}, indent=2)


def changed_settings(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The keys of `values` (a config's dict) that differ from `defaults`, section by section."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        default = defaults.get(key)
        if isinstance(value, dict) and isinstance(default, dict):
            if changed := changed_settings(value, default):
                out[key] = changed
        elif value != default:
            out[key] = value
    return out


def best_config_yaml(config: Config, best: SweepRow, *, sweep_name: str, objective: str) -> str:
    """The user's config (the preset or file, and their --set values) with the winning micro-batch
    and accumulation (global batch unchanged), its activation checkpointing where that is not the
    config's own, and a run name of its own (under the sweep's base name it would resume that run, whose
    checkpoints may hold another precision or batch split); written as the keys that differ from the
    defaults, so nothing the sweep set for its trials alone (their steps, logging, evaluation) is in it."""
    setting = best.activation_checkpointing
    own = not setting or setting == config.model.activation_checkpointing
    chosen = dataclasses.replace(
        config, name=f"{config.name or 'run'}-mb{best.micro_batch}{'' if own else f'-ac-{setting}'}",
        train=dataclasses.replace(config.train, micro_batch=best.micro_batch, grad_accum=best.grad_accum),
        model=config.model if own else dataclasses.replace(config.model, activation_checkpointing=setting),
    )
    checkpointing = "" if own else f", model.activation_checkpointing={setting}"
    if objective == "tokens_per_sec" and best.tokens_per_sec:
        what = f"{best.tokens_per_sec:,.0f} tokens/s"
    elif objective == "val_loss" and best.final_val_loss is not None:
        what = f"final val/loss {best.final_val_loss:.4f}"
    else:
        what = f"final loss {best.final_loss:.4f}"
    header = (
        f"# Written by `raytrain-fast sweep` ({sweep_name}): micro_batch={best.micro_batch} x grad_accum={best.grad_accum}"
        f" x {config.resources.num_workers} worker(s) = global batch {config.train.global_batch}{checkpointing} ({what}).\n"
        f"# Your config and --set values with the sweep's choice, as the keys that differ from the defaults; run '{chosen.name}'.\n"
        "# Train with: raytrain-fast pretrain --config <this file>\n"
    )
    return header + yaml.safe_dump(changed_settings(redact(chosen.to_dict()), Config().to_dict()), sort_keys=False)
