"""The run's headline numbers and facts, for the terminal and the HTML page."""

from __future__ import annotations

from raytrain_fast.report.finding import duration, ms, pct
from raytrain_fast.report.load import RunMetrics, median
from raytrain_fast.report.mixture import mixture_facts


def run_facts(run: RunMetrics) -> dict[str, str]:
    """What the run was: model, precision, workers, batch, tokens and dates (from its config and
    records), for the top of the report."""
    import datetime

    facts: dict[str, str] = {}
    model = run.config.get("model") if run.config else None
    if isinstance(model, dict) and model.get("d_model"):
        facts["model"] = (
            f"{model.get('num_layers')} layers, d_model {model.get('d_model'):,}, {model.get('num_heads')} heads, "
            f"vocabulary {model.get('vocab_size', 0):,}, sequence {model.get('max_seq_len', 0):,}"
        )
    precision = run.setting("engine", "precision")
    if precision:
        facts["precision"] = f"{precision}, ZeRO stage {run.setting('engine', 'zero_stage', '?')}"
    workers = run.setting("resources", "num_workers")
    if workers is not None:
        facts["workers"] = f"{workers}" + (f" x {run.setting('resources', 'cpus_per_worker')} CPUs" if run.setting("resources", "cpus_per_worker") else "")
    global_batch, seq_len = run.setting("train", "global_batch"), run.setting("data", "seq_len")
    if isinstance(global_batch, int) and isinstance(seq_len, int):
        facts["batch"] = f"{global_batch:,} sequences of {seq_len:,} tokens (micro-batch {run.setting('train', 'micro_batch')})"
        steps = run.setting("train", "steps")
        facts["tokens trained"] = f"{global_batch * seq_len * run.last_step:,} (to step {run.last_step:,}" + (f" of {steps:,})" if isinstance(steps, int) else ")")
    times = [r["time"] for r in run.records if isinstance(r.get("time"), (int, float))]
    if times:
        fmt = lambda t: datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")  # noqa: E731
        facts["logged"] = f"{fmt(min(times))} to {fmt(max(times))}"
        first = run.records[0]
        # The first record closes the first window: the run started that window's steps earlier.
        start = min(times) - float(first.get("time/step_s", 0.0)) * run.window_steps()[first["step"]]
        resumes = f", {len(run.restart_steps)} resume(s) and the pauses before them included" if run.restart_steps else ""
        facts["duration"] = f"{duration(max(times) - start)} from the first step to the last record{resumes}"
    facts.update(mixture_facts(run))  # a mixture: each source's weight against its realised share
    return facts


def summarize(run: RunMetrics) -> dict[str, str]:
    """Headline numbers: medians over the steady windows (all windows when none is steady)."""
    steady = bool(run.steady)
    summary: dict[str, str] = {}
    first, last = run.records[0]["step"], run.last_step
    summary["steps logged"] = f"{first:,}-{last:,} ({len(run.records):,} records, every {run.log_every:,} steps)"
    ranks = run.world_size
    summary["ranks"] = str(ranks) if ranks else ("several" if run.has("time/step_s_rank_spread") else "1 (or unknown)")
    summary["warm-up left out"] = f"steps up to {run.warmup_steps}" + (f"; resumes at steps {run.restart_steps}" if run.restart_steps else "")
    _, loss = run.series("train/loss")
    if loss:
        summary["loss"] = f"{loss[0]:.4f} -> {loss[-1]:.4f} (min {min(loss):.4f})"

    def add(label: str, metric: str, fmt, of=None) -> None:
        """`fmt` of the median over the steady windows, or of `of(every value)`, when the metric was recorded."""
        _, values = run.series(metric, steady=steady and of is None)
        if values:
            summary[label] = fmt((of or median)(values))

    add("tokens/s (median)", "throughput/tokens_per_sec", lambda v: f"{v:,.0f}")
    add("step time (median)", "time/step_s", ms)
    add("MFU (median)", "throughput/mfu", pct)
    add("MFU vs measured peak (median)", "throughput/mfu_measured_peak", pct)
    add("data wait (median)", "time/data_wait_frac", pct)
    _, blocked = run.series("checkpoint/blocked_s")
    if blocked:
        # How many of the run's saves those times cover: a final save (or one on a stop signal) comes
        # after the last record, so no window times it.
        saves = run.planned_saves()
        untimed = [s for s in saves if s >= run.last_step]
        timed = f"{len(blocked)} window(s) timing a save"
        if saves:
            after = f"; the save at step {untimed[0]} is after the last record" if untimed else ""
            timed = f"{len(saves)} saves; {timed}{after}"
        summary["checkpoint blocked"] = f"median {duration(median(blocked))}, worst {duration(max(blocked))} ({timed})"
    add("peak memory", "memory/peak_gb", lambda v: f"{v:.2f} GB", of=max)
    _, fracs = run.series("memory/peak_frac")
    if "peak memory" in summary and fracs:
        summary["peak memory"] += f" ({pct(max(fracs))} of available)"
    add("worker niceness", "host/niceness", of=lambda values: values[0], fmt=lambda n: f"{n:.0f}" + (
        " (normal priority)" if n <= 0 else " (below normal priority: other processes come first)"))
    add("CPU wait (median)", "host/cpu_wait_frac", pct)
    _, alerts = run.series("alert/slowdown")
    if alerts:
        summary["slowdown alerts"] = f"{int(sum(a >= 1 for a in alerts))} of {len(alerts)} windows"
    add("sink records dropped", "sink/dropped", lambda v: str(int(v)), of=max)
    return summary
