"""`raytrain-fast report`: each diagnosis rule on records built here (fast), the report of real tiny
runs (a clean one names nothing, one with planted problems names each of them), S3 storage and
runs with missing metrics."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from raytrain_fast.cli import main
from raytrain_fast.drills import LoopHooks, SlowData, SlowSink, SlowStep, SlowUpload
from raytrain_fast.report import diagnose, from_records, make_report, report_for
from raytrain_fast.report.findings.checkpoint_stall import CHECKPOINT_BLOCKED_SHARE
from raytrain_fast.report.findings.data_bound import DATA_WAIT_FRAC
from raytrain_fast.report.findings.memory_underused import MEMORY_UNDERUSED_FRAC
from raytrain_fast.report.findings.slowdown import SLOWDOWN_FALLBACK_RATIO
from raytrain_fast.report.findings.straggler import STRAGGLER_SHARE

pytestmark = pytest.mark.unit

PNGS = {"loss.png", "throughput.png", "mfu.png", "data_wait.png", "step_time.png", "checkpoint.png", "memory.png"}


# --- records built in the test -------------------------------------------------------------------


def records(num_windows: int = 16, *, log_every: int = 5, step_s: float = 0.1, ranks: int = 2, tweak=None) -> list[dict]:
    """A healthy run's records; `tweak(index, record)` changes window `index` (0-based) in place."""
    out, now = [], 1_700_000_000.0
    for i in range(num_windows):
        step = (i + 1) * log_every
        now += step_s * log_every
        record = {
            "step": step, "time": now, "train/loss": 5.0 / (1 + 0.1 * i), "train/lr": 1e-3,
            "throughput/tokens_per_sec": 1000.0 / step_s, "throughput/mfu_measured_peak": 0.3, "time/step_s": step_s,
            "time/data_wait_frac": 0.005, "memory/peak_gb": 2.0, "memory/current_gb": 1.9, "gc/collect_s": 0.0,
            "sink/dropped": 0.0, "sink/backlog": 0.0, "sink/errors": 0.0,
            "host/cpu_share": 0.95, "host/cpu_wait_frac": 0.03, "host/memory_used_frac": 0.4, "host/swap_used_gb": 0.0,
        }
        if i == 0:
            record["host/niceness"] = 0.0
        if ranks > 1:
            record["time/step_s_rank_spread"] = 0.01 * step_s / log_every  # the gap is 1% of a step
            record["time/data_wait_frac_rank_min"] = 0.004
        if step > 20:  # the detector's baseline exists after its warm-up
            record["alert/slowdown"], record["alert/slowdown_ratio"] = 0.0, 1.0
        if tweak:
            tweak(i, record)
        out.append(record)
    return out


CONFIG = {
    "train": {"log_every": 5, "micro_batch": 4},
    "metrics": {"slowdown_warmup_steps": 10, "queue_size": 1000},
    "checkpoint": {"every_steps": 5, "upload": "sync"},
    "resources": {"num_workers": 2},
    "data": {"prefetch_batches": 2},
}


def keys_of(recs: list[dict], config: dict | None = CONFIG) -> list[str]:
    return diagnose(from_records(recs, name="t", config=config)).keys()


def test_a_healthy_run_has_no_finding_and_says_what_it_could_not_check():
    diagnosis = diagnose(from_records(records(), config=CONFIG))
    assert diagnosis.findings == []
    assert any("memory/peak_frac" in s for s in diagnosis.skipped)
    assert any("checkpoint" in s for s in diagnosis.skipped)


def _evaluated(val: list[float]):
    """A tweak: val/loss at every window (an evaluation per log step), train/loss still falling."""
    def tweak(index: int, record: dict) -> None:
        record["val/loss"] = val[index]
    return tweak


def test_overfitting_needs_val_loss_rising_over_evaluations_while_train_loss_falls():
    falling = [4.0 - 0.1 * i for i in range(16)]
    assert "overfitting" not in keys_of(records(tweak=_evaluated(falling)))
    # Lowest at window 9 (step 50), then up for the last 6 evaluations while train/loss keeps falling.
    planted = falling[:10] + [3.2, 3.3, 3.4, 3.5, 3.6, 3.7]
    diagnosis = diagnose(from_records(records(tweak=_evaluated(planted)), name="t", config=CONFIG))
    [finding] = [f for f in diagnosis.findings if f.key == "overfitting"]
    assert finding.numbers["best_step"] == 50 and finding.numbers["best_val_loss"] == pytest.approx(3.1)
    assert finding.numbers["rise"] == pytest.approx(3.7 / 3.1 - 1)
    assert "3.1000 at step 50" in finding.evidence[0] and "train/loss fell" in finding.evidence[1]
    advice = " ".join(finding.advice)
    assert "more data" in advice and "checkpoint.keep_best" in advice and "model.dropout" in advice
    # One evaluation up is noise, not a trend; without evaluation the check says why it did not run.
    assert "overfitting" not in keys_of(records(tweak=_evaluated(falling[:15] + [3.0])))
    healthy = diagnose(from_records(records(), name="t", config=CONFIG))
    assert any(s.startswith("overfitting: no val/loss") for s in healthy.skipped)


def test_data_bound_names_the_share_and_the_fix():
    def slow_data(i, r):
        r["time/data_wait_frac"] = 0.30

    finding = diagnose(from_records(records(tweak=slow_data), config=CONFIG)).findings[0]
    assert finding.key == "data_bound"
    assert "30%" in finding.title and "median time/data_wait_frac 30%" in finding.evidence[0]
    assert any("data.prefetch_batches (now 2)" in a for a in finding.advice)
    # Just below the threshold, and a slow warm-up, are not findings.
    def mild(i, r):
        r["time/data_wait_frac"] = DATA_WAIT_FRAC * 0.9 if i else 0.9

    assert keys_of(records(tweak=mild)) == []


def test_sink_drops_or_a_persistent_backlog_are_findings_a_blip_is_not():
    def dropping(i, r):
        r["sink/dropped"] = float(max(0, i - 10))

    finding = diagnose(from_records(records(tweak=dropping), config=CONFIG)).findings[0]
    assert finding.key == "sink_backlog" and "5 metric records were dropped" in finding.evidence[0]

    def behind(i, r):
        r["sink/backlog"] = 4.0 if i in (8, 9, 12) else 0.0

    assert keys_of(records(tweak=behind)) == ["sink_backlog"]

    def blip(i, r):
        r["sink/backlog"] = 6.0 if i == 8 else 1.0

    assert keys_of(records(tweak=blip)) == []


def test_memory_under_used_when_peak_frac_is_low():
    def low(i, r):
        r["memory/peak_frac"] = 0.2

    finding = diagnose(from_records(records(tweak=low), config=CONFIG)).findings[0]
    assert finding.key == "memory_underused"
    assert "20%" in finding.evidence[0] and "2.00 GB of 10.0 GB" in finding.evidence[0]
    assert "micro_batch: auto" in finding.advice[0]

    def high(i, r):
        r["memory/peak_frac"] = MEMORY_UNDERUSED_FRAC + 0.1

    assert keys_of(records(tweak=high)) == []


def test_progressive_slowdown_from_the_detector_says_since_when_and_why():
    def slower(i, r):
        if i >= 9:  # steps 50.. are 60% slower, mostly waiting for data
            r["time/step_s"] = 0.16
            r["time/data_wait_frac"] = 0.06 / 0.16
            r["alert/slowdown_ratio"] = 1.6
            r["alert/slowdown"] = 1.0 if i >= 10 else 0.0
            if i == 10:
                r["alert/slowdown_cause/data_wait"] = 1.0

    diagnosis = diagnose(from_records(records(tweak=slower), config=CONFIG))
    finding = next(f for f in diagnosis.findings if f.key == "slowdown")
    assert "since step 55" in finding.title and "1.60x" in finding.title
    text = " ".join(finding.evidence)
    assert "data wait 0.5 ms -> 60.0 ms per step" in text
    assert "likely cause: the data pipeline" in text

    # Two alert windows at the end of a run (a burst on a shared machine) are not a finding.
    def burst(i, r):
        if i >= 14:
            r["time/step_s"], r["alert/slowdown_ratio"], r["alert/slowdown"] = 0.2, 2.0, float(i == 15 or i == 14)

    assert keys_of(records(tweak=burst)) == []


def test_slowdown_blamed_on_sink_drops_by_the_detector_is_read_from_the_seconds():
    def slower(i, r):
        if i >= 9:
            r["time/step_s"], r["alert/slowdown_ratio"], r["alert/slowdown"] = 0.2, 2.0, float(i >= 10)
            r["sink/dropped"] = 3.0
            if i == 10:
                r["alert/slowdown_cause/sink"] = 1.0

    diagnosis = diagnose(from_records(records(tweak=slower), config=CONFIG))
    text = " ".join(next(f for f in diagnosis.findings if f.key == "slowdown").evidence)
    assert "likely cause: nothing the loop measures" in text and "detector named 'sink'" in text
    assert "sink_backlog" in diagnosis.keys()


def test_slowdown_without_detector_metrics_uses_the_report_own_check():
    def slower(i, r):
        r.pop("alert/slowdown", None)
        r.pop("alert/slowdown_ratio", None)
        if i >= 8:
            r["time/step_s"] = 0.2

    finding = diagnose(from_records(records(tweak=slower), config=CONFIG)).findings[0]
    assert finding.key == "slowdown" and "since step 45" in finding.title
    assert "nothing the loop measures" in " ".join(finding.evidence)


@pytest.mark.parametrize(("factor", "recovers", "found"), [
    (SLOWDOWN_FALLBACK_RATIO + 0.05, False, True),
    (SLOWDOWN_FALLBACK_RATIO - 0.05, False, False),  # below the report's bar (the live alert's is lower)
    (2.0, True, False),  # slow for five windows, then back to the baseline: not progressive
])
def test_slowdown_without_detector_metrics_replays_the_detector_with_the_report_thresholds(factor, recovers, found):
    def slower(i, r):
        r.pop("alert/slowdown", None)
        r.pop("alert/slowdown_ratio", None)
        if i >= 7 and not (recovers and i >= 12):
            r["time/step_s"] = 0.1 * factor

    findings = [f for f in diagnose(from_records(records(tweak=slower), config=CONFIG)).findings if f.key == "slowdown"]
    assert bool(findings) == found
    if found:
        assert findings[0].numbers["since_step"] == 40  # window 7: the first one above the bar
        assert findings[0].numbers["ratio"] == pytest.approx(factor)


def test_checkpoint_stalls_by_share_of_wall_time_and_by_a_single_long_block():
    def stalls(i, r):
        if i % 2:
            r["checkpoint/blocked_s"] = 0.1  # one save per window: 0.1 s of each 0.5 s window
            r["time/step_s"] = 0.12

    finding = diagnose(from_records(records(tweak=stalls), config=CONFIG)).findings[0]
    assert finding.key == "checkpoint_stall"
    assert finding.numbers["blocked_share"] > CHECKPOINT_BLOCKED_SHARE
    assert "checkpoint.upload=async" in finding.advice[0]

    def one_long(i, r):
        if i == 10:
            r["checkpoint/blocked_s"] = 120.0

    long_run = records(num_windows=16, step_s=100.0, tweak=one_long)  # 120 s is 1.5% of this run's time
    finding = diagnose(from_records(long_run, config=CONFIG)).findings[0]
    assert finding.key == "checkpoint_stall" and finding.numbers["worst_block_s"] == 120.0

    def cheap(i, r):
        r["checkpoint/blocked_s"] = 0.001

    assert keys_of(records(tweak=cheap)) == []


def test_straggler_needs_most_windows_late_and_reads_the_data_gap():
    def late(i, r):
        r["time/step_s_rank_spread"] = 0.3 * r["time/step_s"] / 5  # arrives 30% of a step late

    finding = diagnose(from_records(records(tweak=late), config=CONFIG)).findings[0]
    assert finding.key == "straggler" and "30%" in finding.title
    assert "data wait is alike on every rank" in " ".join(finding.evidence)

    def sometimes(i, r):
        r["time/step_s_rank_spread"] = (2 * STRAGGLER_SHARE if i % 3 == 0 else 0.01) * r["time/step_s"] / 5

    assert keys_of(records(tweak=sometimes)) == []
    single = diagnose(from_records(records(ranks=1), config={**CONFIG, "resources": {"num_workers": 1}}))
    assert single.findings == [] and any("single-rank" in s for s in single.skipped)


def test_a_stall_names_its_windows_the_seconds_lost_and_the_cause():
    def contended(i, r):
        if i in (9, 10):
            r["time/step_s"], r["host/cpu_wait_frac"], r["host/cpu_share"] = 0.5, 0.8, 0.2

    diagnosis = diagnose(from_records(records(tweak=contended), name="t", config=CONFIG))
    finding = {f.key: f for f in diagnosis.findings}["stall"]
    assert finding.numbers["windows"] == 2 and finding.numbers["first_step"] == 50
    assert finding.numbers["lost_s"] == pytest.approx(2 * 5 * 0.4)  # two windows of 5 steps, 0.4 s over 0.1 s each
    assert "other processes took the CPU" in finding.title and "nice -n 19" in finding.advice[0]
    assert "the windows ending at step 50 (5.0x" in finding.evidence[0]

    def data(i, r):
        if i == 9:
            r["time/step_s"], r["time/data_wait_frac"] = 0.5, 0.7
    found = {f.key: f for f in diagnose(from_records(records(tweak=data), name="t", config=CONFIG)).findings}
    assert "waiting for data" in found["stall"].title

    def twice(i, r):  # 2x: noise on a busy machine can do that to a window, not a stall
        if i == 9:
            r["time/step_s"] = 0.2
    assert "stall" not in keys_of(records(tweak=twice))

    def blip(i, r):  # 3x once in a long run: 0.5% of the time lost, left to the live alert
        if i == 200:
            r["time/step_s"] = 0.3
    assert "stall" not in keys_of(records(400, tweak=blip))


def test_host_contention_needs_several_windows_and_names_the_priority():
    def contended(i, r):
        if 8 <= i <= 10:
            r["host/cpu_wait_frac"], r["host/cpu_share"], r["time/step_s"] = 0.6, 0.4, 0.4
        if i == 0:
            r["host/niceness"] = 15.0

    finding = {f.key: f for f in diagnose(from_records(records(tweak=contended), name="t", config=CONFIG)).findings}["host_contention"]
    assert finding.numbers["windows"] == 3 and finding.numbers["cpu_wait_frac"] == pytest.approx(0.6)
    assert finding.numbers["waited_s"] == pytest.approx(3 * 0.6 * 0.4 * 5)  # 3 windows of 5 steps: 3.6 s
    assert "steps 45, 50, 55" in finding.evidence[0] and "niceness 15" in " ".join(finding.evidence)
    assert "RAY_worker_niceness=0" in finding.advice[0]

    def once(i, r):
        if i == 9:
            r["host/cpu_wait_frac"], r["time/step_s"] = 0.6, 0.25
    assert "host_contention" not in keys_of(records(tweak=once))

    def hiccups(i, r):  # a tiny model's 50 ms windows: one scheduling hiccup reads as 40%
        if i % 3 == 0:
            r["host/cpu_wait_frac"] = 0.4
    assert "host_contention" not in keys_of(records(tweak=hiccups, step_s=0.01))


def test_host_memory_pressure_from_the_node_the_swap_or_the_budget():
    def full(i, r):
        if i >= 8:
            r["host/memory_used_frac"] = 0.95
    assert {f.key: f for f in diagnose(from_records(records(tweak=full), config=CONFIG)).findings}["memory_pressure"].numbers[
        "host/memory_used_frac"] == pytest.approx(0.95)

    def swapping(i, r):
        r["host/swap_used_gb"] = 0.05 * i
    finding = {f.key: f for f in diagnose(from_records(records(tweak=swapping), config=CONFIG)).findings}["memory_pressure"]
    assert "swap in use grew from 0.00 GB to 0.75 GB" in " ".join(finding.evidence)

    def budget(i, r):
        r["host/memory_budget_frac"] = 0.5 if i < 10 else 0.97
    finding = {f.key: f for f in diagnose(from_records(records(tweak=budget), config=CONFIG)).findings}["memory_pressure"]
    assert "resources.memory_budget_gb" in finding.evidence[0] and "resources.memory_budget_gb" in finding.advice[-1]
    assert "memory_pressure" not in keys_of(records())


def test_the_first_window_after_a_resume_is_warm_up_again():
    def resumed(i, r):
        if i >= 8:
            r["time"] += 600.0  # the job was down for 10 minutes before step 45
        if i == 8:
            r["time/data_wait_frac"], r["time/step_s_rank_spread"] = 0.9, 0.5  # cold data, workers starting

    run = from_records(records(num_windows=10, tweak=resumed), config=CONFIG)
    assert run.restart_steps == [45]
    assert diagnose(run).findings == []
    assert "resumes at steps [45]" in diagnose(run).summary["warm-up left out"]


def test_missing_metrics_and_missing_records_still_make_a_report(tmp_path):
    # Only loss and step time, no config, and every other record missing (a sink that dropped them).
    bare = [{"step": r["step"], "time": r["time"], "train/loss": r["train/loss"], "time/step_s": r["time/step_s"]}
            for r in records()[::2]]
    report = report_for(from_records(bare, name="bare"), out_dir=str(tmp_path))
    assert report.diagnosis.findings == []
    assert {Path(p).name for p in report.pngs} == {"loss.png", "step_time.png"}
    html = Path(report.html_path).read_text()
    assert "throughput/tokens_per_sec was not recorded" in html
    assert "time/data_wait_frac was not recorded" in report.text
    assert from_records(bare).log_every == 10  # from the records when the config is unknown


# --- real runs -----------------------------------------------------------------------------------


def _config(tmp_path: Path, name: str, *extra: str):
    from raytrain_fast.config import load_config

    return load_config(
        "tiny",
        [
            "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
            "data.seq_len=32", "data.max_tokens=60000", "train.micro_batch=4", "train.global_batch=8",
            "train.steps=30", "train.log_every=3", "optim.warmup_steps=3", "optim.lr=0.01",
            "resources.num_workers=2", "resources.max_failures=0", "engine.precision=fp32",
            "metrics.slowdown_warmup_steps=6", "metrics.peak_measure_s=0.2", f"storage.uri={tmp_path / 'runs'}", *extra,
        ],
        name=name,
    )


# Planted problems. Per step: ~50 ms of compute, 200 ms of data wait, rank 1 200 ms late, a sync
# checkpoint after every step whose upload starts 150 ms late (the save itself took 8-25 ms on a quiet
# 2-core machine with a fast disk, under the 5% threshold: the stall must not depend on the disk); from
# step 13 every rank 300 ms slower (a progressive slowdown the detector sees against its baseline of
# windows 9 and 12). Sizes keep each share about twice its threshold even after the slowdown dilutes
# it, on a busy 2-core machine.
DRILLS = LoopHooks(
    SlowData(0.2),
    SlowStep(0.2, rank=1), SlowStep(0.3, from_step=13),
    SlowSink(2.0),  # a record every ~2 s, a queue of 1: records are dropped
    SlowUpload(0.15),
)


@pytest.fixture(scope="module")
def real_runs(ray_session, tmp_path_factory):
    """One clean run and one with planted problems, both 2 workers x 30 steps of a tiny model."""
    from raytrain_fast.launch.trainer import run

    tmp_path = tmp_path_factory.mktemp("report-runs")
    # No checkpoint but the last (at this size any save is a stall); evaluated every 6 steps, so
    # the overfitting check runs and must stay quiet on a run that sees each sequence once.
    run(_config(tmp_path, "clean", "eval.every_steps=6"))
    planted = [
        "checkpoint.every_steps=1", "checkpoint.upload=sync", "metrics.queue_size=1", "metrics.slowdown_windows=2",
        "resources.memory_budget_gb=64",  # a ~0.6 GB process: memory under-used (memory/peak_frac ~1%)
    ]
    run(_config(tmp_path, "planted", *planted), hooks=DRILLS)
    return tmp_path / "runs"


# Findings that timing noise on a loaded 2-core machine cannot cause (they count records, bytes or
# saves), and the timed ones with the number each is judged by.
NOISE_PROOF = {"sink_backlog", "checkpoint_stall", "memory_underused", "memory_pressure"}
TIMED = {"data_bound": "data_wait_frac", "straggler": "share", "slowdown": "ratio"}
# Findings about other processes on the machine: judged on the clean run only on a quiet machine
# (test_clean_run_has_no_stall_or_host_contention); a second test run beside this one causes them for real.
HOST = {"stall", "host_contention"}


def _excess(key: str, value: float) -> float:
    """How far past 'nothing' a timed finding's number is (a ratio of 1.0 is nothing)."""
    return value - 1.0 if key == "slowdown" else value


@pytest.mark.ray
@pytest.mark.slow
def test_clean_run_report_has_the_plots_and_no_finding_noise_cannot_explain(real_runs, tmp_path, capsys):
    """The clean run has none of the findings noise cannot cause (sink drops, checkpoint stalls,
    memory). A timed finding can come from another process taking the CPU on a 2-core machine, so
    the clean run may show a data-wait or straggler finding only below the size planted in the
    other run (about twice each threshold): a stall as large as a planted 200 ms per step is a real
    defect. Slowdowns are not judged on the clean run (see below)."""
    out = tmp_path / "clean-report"
    assert main(["report", "--storage", str(real_runs), "--name", "clean", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    clean = make_report(str(real_runs), "clean", out_dir=str(tmp_path / "clean-again"))
    planted = {f.key: f for f in make_report(str(real_runs), "planted", out_dir=str(tmp_path / "p")).diagnosis.findings}
    found = {f.key: f for f in clean.diagnosis.findings}
    assert not NOISE_PROOF & set(found), clean.text
    assert set(found) <= set(TIMED) | HOST, clean.text
    for key, finding in found.items():
        if key in HOST:
            continue
        if key == "slowdown":
            # Not judged here: another process taking the CPU slows the steps of a clean run 1.3-1.7x
            # (seen with a second test run beside this one), and the share of that blamed on data
            # wait or GC moves with it. The planted run and the detector's unit tests prove it.
            continue
        number = TIMED[key]
        assert _excess(key, finding.numbers[number]) < _excess(key, planted[key].numbers[number]), clean.text
    if found:
        assert all(finding.title in printed for finding in found.values()), printed
    else:
        assert "no problems found" in printed, printed
    # Every plot but the checkpoint one (no save between two log steps), which the page explains.
    assert {p.name for p in out.glob("*.png")} == PNGS - {"checkpoint.png"}
    html = (out / "report.html").read_text()
    # One file to mail: every plot embedded, and what the run was at the top.
    assert all(f'<figure id="{name}"><img src="data:image/png;base64,' in html for name in PNGS - {"checkpoint.png"})
    assert html.index("<h2>Run</h2>") < html.index("<h2>Summary</h2>")
    assert "fp32, ZeRO stage 2" in html and "2 layers, d_model 32" in html and "tokens trained" in html
    assert "Checkpoint blocked time: no checkpoint was saved between two log steps" in html
    assert "tokens/s (median)" in html
    assert ("No problems found" in html) == (not found)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.quiet
def test_clean_run_has_no_stall_or_host_contention(real_runs, tmp_path):
    """With nothing else running on the machine, the clean run's windows stay near each other and
    its training threads get their cores: no stall, no host contention."""
    clean = make_report(str(real_runs), "clean", out_dir=str(tmp_path / "clean-host"))
    assert not HOST & set(clean.diagnosis.keys()), clean.text
    assert "host contention" not in " ".join(clean.diagnosis.skipped)  # it was checked: the run has host/cpu_wait_frac


@pytest.mark.ray
@pytest.mark.slow
def test_planted_problems_are_each_named_with_their_numbers(real_runs, tmp_path):
    report = make_report(str(real_runs), "planted", out_dir=str(tmp_path / "planted-report"))
    found = {f.key: f for f in report.diagnosis.findings}
    expected = {"data_bound", "sink_backlog", "checkpoint_stall", "straggler", "slowdown", "memory_underused"}
    assert set(found) - HOST == expected, report.text  # HOST: other processes may really stall a window here
    assert found["data_bound"].numbers["data_wait_frac"] > DATA_WAIT_FRAC
    assert found["sink_backlog"].numbers["dropped"] > 0
    assert found["checkpoint_stall"].numbers["blocked_share"] > CHECKPOINT_BLOCKED_SHARE
    assert "checkpoint.upload=async" in " ".join(found["checkpoint_stall"].advice)
    assert found["straggler"].numbers["share"] > STRAGGLER_SHARE
    assert 13 <= found["slowdown"].numbers["since_step"] <= 24, report.text
    assert found["slowdown"].numbers["ratio"] > 1.3
    assert found["memory_underused"].numbers["peak_frac"] < 0.05
    html = Path(report.html_path).read_text()
    assert all(f'id="{key}"' in html for key in found)
    assert {Path(p).name for p in report.pngs} == PNGS


@pytest.mark.ray
@pytest.mark.slow
def test_overfitting_is_named_on_a_planted_run(ray_session, tmp_path):
    """Planted: ~30 sequences repeated for ~25 epochs. The tiny model memorises them: train/loss
    falls while val/loss, lowest early, climbs; the report says so with the numbers and the fixes."""
    from raytrain_fast.config import load_config
    from raytrain_fast.launch.trainer import run

    config = load_config("tiny", [
        "train.steps=50", "train.log_every=5", "eval.every_steps=5", "data.max_tokens=4000", "optim.lr=0.003",
        "optim.warmup_steps=10", "checkpoint.every_steps=0", "engine.precision=fp32", "resources.num_workers=1",
        "metrics.peak_measure_s=0.2", f"storage.uri={tmp_path / 'runs'}",
    ], name="memorise")
    run(config)
    report = make_report(str(tmp_path / "runs"), "memorise", out_dir=str(tmp_path / "report"))
    found = {f.key: f for f in report.diagnosis.findings}
    assert "overfitting" in found, report.text
    numbers = found["overfitting"].numbers
    assert numbers["best_step"] < 50 and numbers["val_loss"] > numbers["best_val_loss"] * 1.01
    assert "Overfitting" in report.text and "more data" in report.text


# --- storage -------------------------------------------------------------------------------------


def test_report_reads_metrics_from_s3(s3_server, monkeypatch, tmp_path, capsys):
    from raytrain_fast.metrics.sinks import JsonlSink
    from raytrain_fast.storage import StorageConfig

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.make_bucket(f"report-{uuid.uuid4().hex[:8]}")
    storage = StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=s3_server.endpoint_url)

    def slow_data(i, r):
        r["time/data_wait_frac"] = 0.4

    sink = JsonlSink(f"s3://{bucket}/runs/remote", start_step=0, storage=storage)
    for record in records(tweak=slow_data):
        sink.log({k: v for k, v in record.items() if k not in ("step", "time")}, record["step"])
    sink.close()

    out = tmp_path / "remote-report"
    argv = ["report", "--storage", f"s3://{bucket}/runs", "--endpoint-url", s3_server.endpoint_url, "--name", "remote", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Data-bound: training waits for data 40% of the time" in printed
    assert (out / "report.html").exists() and (out / "data_wait.png").exists()
    assert s3_server.env.get("AWS_SECRET_ACCESS_KEY", "no-secret") not in printed

    assert main(["report", "--storage", f"s3://{bucket}/runs", "--endpoint-url", s3_server.endpoint_url, "--name", "nope"]) == 2
    assert "has no metrics" in capsys.readouterr().err
    # --storage pointing at the run itself: the hint names the command that works.
    assert main(["report", "--storage", f"s3://{bucket}/runs/remote", "--endpoint-url", s3_server.endpoint_url, "--name", "remote"]) == 2
    assert f"--storage s3://{bucket}/runs --name remote" in capsys.readouterr().err
