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


CSV_FIELDS = [f.name for f in dataclasses.fields(SweepRow)]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def row_from_reports(*, micro_batch: int, grad_accum: int, reports: list[dict[str, Any]], steps: int,
                     error: str | None, run_name: str = "", activation_checkpointing: str = "") -> SweepRow:
    """Summarise a trial's reported log windows (first window = warm-up, left out of the speed)."""
    steady = reports[1:] if len(reports) > 1 else reports

    def series(name: str, windows: list[dict[str, Any]]) -> list[float]:
        return [float(r[name]) for r in windows if r.get(name) is not None and r[name] == r[name]]  # not NaN

    peaks = series("memory/peak_gb", reports)
    fracs = series("memory/peak_frac", reports)
    losses = series("train/loss", reports)
    val_losses = series("val/loss", reports)
    steps_done = max((int(r.get("step", 0)) for r in reports), default=0)
    if error:
        status = "failed"
    elif steps_done < steps:
        status = "stopped"
    else:
        status = "ok"
    return SweepRow(
        micro_batch=micro_batch, grad_accum=grad_accum, activation_checkpointing=activation_checkpointing, status=status,
        reason=error or ("early: more than 10% behind the best trial at the same window" if status == "stopped" else ""),
        tokens_per_sec=_median(series("throughput/tokens_per_sec", steady)),
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


def _order(row: SweepRow) -> tuple[int, int]:
    """Micro-batch order; within one micro-batch, none, full, every_n (a skipped row first)."""
    setting = row.activation_checkpointing
    return row.micro_batch, ACTIVATION_CHECKPOINTING.index(setting) if setting in ACTIVATION_CHECKPOINTING else -1


def format_table(rows: list[SweepRow]) -> str:
    """The terminal table, one line per trial (or skipped micro-batch), in micro-batch order. An
    activation-checkpointing column when a row has it on (a sweep over it, or a config with it)."""
    measured_only = any(r.mfu is None and r.mfu_measured_peak is not None for r in rows)
    checkpointing = any(r.activation_checkpointing not in ("", "none") for r in rows)
    header = ["micro-batch", "accum", *(["act. ckpt"] if checkpointing else []), "tokens/s", "MFU", "peak memory", "status"]
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
            "-" if r.tokens_per_sec is None else f"{r.tokens_per_sec:,.0f}", mfu, peak, status,
        ])
    columns = len(header) - 1  # right-aligned; the status last, as it comes
    widths = [max(len(header[i]), *(len(line[i]) for line in lines)) if lines else len(header[i]) for i in range(columns)]
    out = ["  ".join(h.rjust(w) for h, w in zip(header[:columns], widths)) + "  " + header[columns]]
    out += ["  ".join(c.rjust(w) for c, w in zip(line[:columns], widths)) + "  " + line[columns] for line in lines]
    if measured_only:
        out.append("* against the matmul peak measured on this device (it has no datasheet peak)")
    if any(r.peak_frac is not None for r in rows):
        out.append("peak memory (%): share of the device's memory, or of resources.memory_budget_gb on CPUs")
    return "\n".join(out)


def to_csv(rows: list[SweepRow]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in sorted(rows, key=_order):
        writer.writerow(dataclasses.asdict(r))
    return buffer.getvalue()


def to_json(rows: list[SweepRow], *, summary: dict[str, Any]) -> str:
    return json.dumps({**summary, "trials": [dataclasses.asdict(r) for r in sorted(rows, key=_order)]}, indent=2)


def best_config_yaml(config: Config, best: SweepRow, *, sweep_name: str, objective: str) -> str:
    """The user's config with the winning micro-batch and accumulation (global batch unchanged), and
    its activation checkpointing where that is not the config's own."""
    chosen = dataclasses.replace(
        config, train=dataclasses.replace(config.train, micro_batch=best.micro_batch, grad_accum=best.grad_accum)
    )
    checkpointing = ""
    if best.activation_checkpointing and best.activation_checkpointing != config.model.activation_checkpointing:
        chosen = dataclasses.replace(
            chosen, model=dataclasses.replace(config.model, activation_checkpointing=best.activation_checkpointing)
        )
        checkpointing = f", model.activation_checkpointing={best.activation_checkpointing}"
    if objective == "tokens_per_sec" and best.tokens_per_sec:
        what = f"{best.tokens_per_sec:,.0f} tokens/s"
    elif objective == "val_loss" and best.final_val_loss is not None:
        what = f"final val/loss {best.final_val_loss:.4f}"
    else:
        what = f"final loss {best.final_loss:.4f}"
    header = (
        f"# Written by `raytrain-fast sweep` ({sweep_name}): micro_batch={best.micro_batch} x grad_accum={best.grad_accum}"
        f" x {config.resources.num_workers} worker(s) = global batch {config.train.global_batch}{checkpointing} ({what}).\n"
        "# Train with: raytrain-fast pretrain --config <this file>\n"
    )
    return header + yaml.safe_dump(redact(chosen.to_dict()), sort_keys=False)
