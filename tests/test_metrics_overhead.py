"""The overhead bench: every variant timed the same way, on the same setup, and our loop's clock
agreeing with the run's own metrics. Real runs of every variant on a micro model (a few seconds
of training in all); Ray Train's default result poll interval for one test, so a per-step report
slipping into our loop would show."""

from __future__ import annotations

import json

import pytest

from raytrain_fast._ray_compat import health_check_interval_s
from raytrain_fast.bench import loop_clock
from raytrain_fast.bench.loop_clock import ClockHooks
from raytrain_fast.bench.overhead import (
    VARIANTS,
    OverheadSetup,
    compare,
    drift_warning,
    in_ray_worker,
    machine_drift,
    overhead_report,
    raytrain_fast_loop,
)

pytestmark = pytest.mark.unit


def micro_setup(corpus_dir, **changes) -> OverheadSetup:
    """A model of 39k parameters: steps of milliseconds, so the test time is Ray's start-ups."""
    corpus = corpus_dir / "corpus.txt"
    if not corpus.exists():
        corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(6000)))
    values = dict(
        size="micro", d_model=32, num_layers=2, num_heads=2, seq_len=32, micro_batch=4, warmup_steps=5, steps=20,
        log_every=5, threads=1, precision="bf16", data_source=str(corpus), data_cache_dir=str(corpus_dir / "prepared"),
    )
    return OverheadSetup(**{**values, **changes})


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("overhead-corpus")


def test_compare_interleaves_rotates_and_summarises():
    calls: list[str] = []

    def variant(name: str, values: list[float]):
        queue = list(values)

        def run() -> dict:
            calls.append(name)
            return {"tokens_per_sec": queue.pop(0)}

        return run

    report = compare({"a": variant("a", [100.0, 120.0, 110.0]), "b": variant("b", [50.0, 40.0, 60.0])}, repeats=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # round-robin, the order rotated each round
    assert report["order"] == [["a", "b"], ["b", "a"], ["a", "b"]]
    a = report["variants"]["a"]
    assert a["tokens_per_sec"] == [100.0, 120.0, 110.0]
    assert a["median"] == 110.0 and a["min"] == 100.0 and a["max"] == 120.0
    assert a["spread"] == pytest.approx(20.0 / 110.0)


def test_machine_drift_is_the_spread_of_a_fixed_work_variants_cpu_seconds_per_step():
    def variant(cpu_s_per_step: list[float]):
        queue = list(cpu_s_per_step)

        def run() -> dict:
            cpu = queue.pop(0)
            return {"tokens_per_sec": 1.0 / cpu, "proc": {"cpu_s_per_step": cpu}}

        return run

    quiet = compare({"bare": variant([0.200, 0.201, 0.199]), "raytrain_fast": variant([0.3, 0.2, 0.25])}, repeats=3)
    drift = machine_drift(quiet)
    assert drift["reference"] == "bare" and drift["cpu_s_per_step_per_round"] == [0.200, 0.201, 0.199]
    assert drift["spread"] == pytest.approx(0.002 / 0.200) and drift["resolves_0_03"]
    assert drift_warning(drift) is None
    # A VM whose host got busy: the same steps took 15% more CPU seconds in one round.
    busy = compare({"bare_in_ray_worker": variant([0.20, 0.23, 0.20]), "raytrain_fast": variant([0.2, 0.2, 0.2])}, repeats=3)
    drift = machine_drift(busy)
    assert drift["reference"] == "bare_in_ray_worker" and drift["spread"] == pytest.approx(0.15)
    assert not drift["resolves_0_03"] and "moved by 15% between rounds" in drift_warning(drift)
    # Our own loop does not measure the machine (its work is what is compared), and one round cannot.
    assert machine_drift(compare({"raytrain_fast": variant([0.2, 0.3])}, repeats=2)) is None
    assert machine_drift(compare({"bare": variant([0.2])}, repeats=1)) is None


class FakeTime:
    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def test_clock_hook_spans_the_end_of_warmup_to_the_end_of_the_last_step(tmp_path, monkeypatch):
    """The loop's order: next(batches) for each micro-batch, the step, state.step += 1, then the
    step's log / checkpoint. Each step's own time and its after-step time differ, so a window
    shifted by one step, or missing the after-step work, gives another number."""
    clock = FakeTime()
    monkeypatch.setattr(loop_clock, "time", clock)
    timing = tmp_path / "timing.json"
    hooks = ClockHooks(timing_file=str(timing), start_step=2, end_step=5)
    state = {"step": 0}
    batches = hooks.for_rank(0).batches(iter(range(100)), current_step=lambda: state["step"])
    for step in range(1, 8):
        for _ in range(2):  # two micro-batches per step
            next(batches)
            clock.now += 0.1 * step
        state["step"] += 1
        clock.now += 0.01 * step  # the step's log, checkpoint, sinks
    record = json.loads(timing.read_text())
    assert (record["start_step"], record["end_step"]) == (2, 5)
    assert record["seconds"] == pytest.approx(sum(0.2 * s + 0.01 * s for s in (3, 4, 5)))
    # Other ranks keep no clock.
    other = tmp_path / "rank1.json"
    batches = ClockHooks(timing_file=str(other), start_step=0, end_step=1).for_rank(1).batches(iter(range(9)), current_step=lambda: state["step"])
    for state["step"] in range(3):
        next(batches)
    assert not other.exists()


def test_memory_batches_replace_the_data_and_close_its_pipeline():
    class Data:
        closed = False

        def __iter__(self):
            return self

        def __next__(self):
            raise AssertionError("the run's data was read")

        def close(self):
            self.closed = True

    data = Data()
    batches = ClockHooks(memory_batches=(4, 8, 0)).for_rank(0).batches(data, current_step=lambda: 0)
    assert data.closed
    tokens, seq_ids = next(batches)
    assert tuple(tokens.shape) == (4, 9) and tuple(seq_ids.shape) == (4,) and int(tokens.max()) < 257


@pytest.mark.ray
def test_every_variant_is_timed_the_same_way(ray_session, corpus_dir, tmp_path):
    setup = micro_setup(corpus_dir)
    report = overhead_report(setup=setup, repeats=1, storage_dir=str(tmp_path / "runs"))
    runs = {name: summary["runs"][0] for name, summary in report["detail"]["variants"].items()}
    assert list(runs) == list(VARIANTS)
    # Each variant reports what its training process used, not the setup echoed back.
    for key, value in (("precision", "bf16"), ("threads", 1), ("steps", 20), ("warmup_steps", 5), ("tokens", 20 * 4 * 32)):
        assert {name: run[key] for name, run in runs.items()} == dict.fromkeys(VARIANTS, value), key
    assert all(run["niceness"] == 0 for run in runs.values())
    assert (report["precision"], report["threads"], report["steps"], report["size"]) == ("bf16", 1, 20, "micro")
    # One baseline for every ratio: bare's is 1, and the ratios rank the variants as their speeds do.
    ratios = report["ratio_to_bare"]
    assert ratios["bare"] == 1.0 and set(ratios) == set(VARIANTS)
    assert sorted(ratios, key=ratios.get) == sorted(runs, key=lambda name: runs[name]["tokens_per_sec"])
    ours = runs["raytrain_fast"]
    assert report["ratio_vs_bare"] == ratios["raytrain_fast"]  # the headline is the table's entry
    # Per round (one here): our variant over each other variant of the same round, and the spread.
    assert set(report["round_ratios"]) == set(VARIANTS) - {"raytrain_fast"}
    assert report["round_ratios"]["bare"]["per_round"] == [pytest.approx(ratios["raytrain_fast"])]
    assert all(r["spread"] == 0.0 for r in report["round_ratios"].values())
    assert report["machine_drift"] is None  # one round: nothing to compare the machine's speed with
    for key, baseline in (("ratio_vs_bare_in_ray_worker", "bare_in_ray_worker"), ("ratio_vs_typical_no_report", "typical_no_report")):
        assert (report[key] > 1) == (ours["tokens_per_sec"] > runs[baseline]["tokens_per_sec"]), key
    # Our loop: the checkpoint cadence puts one save inside the timed window; the memory variant
    # trained on in-memory batches.
    assert ours["checkpoints_in_window"] == [20] and not ours["memory_batches"]
    assert runs["raytrain_fast_memory"]["memory_batches"]
    # The run's own windows that tile the timed steps: their tokens over their wall time is the
    # clock's number (the windows are cut at the log sync, the clock at the next step's batch).
    for name in ("raytrain_fast", "raytrain_fast_memory"):
        assert runs[name]["window_steps"] == 20
        assert runs[name]["windows_tokens_per_sec"] == pytest.approx(runs[name]["tokens_per_sec"], rel=0.05), name
    assert report["raytrain_fast_over_window_median"] == pytest.approx(
        ours["tokens_per_sec"] / report["raytrain_fast_window_median_tokens_per_sec"])
    # Each variant's training process, counted over its timed window (/proc): its threads, context
    # switches per step and the cores the rest of the machine took. A Ray worker holds Ray's threads
    # beside torch's; the bare process far fewer.
    for name, run in runs.items():
        proc = run["proc"]
        assert proc["threads"] >= 1 and proc["cpu_s_per_step"] > 0, name
        assert proc["voluntary_switches_per_step"] >= 0 and proc["involuntary_switches_per_step"] >= 0, name
        assert proc["other_processes_cores"] >= 0 and len(proc["other_processes_largest"]) <= 5, name
        assert report["proc"][name]["threads"] == proc["threads"], name
    for name, run in runs.items():  # per thread, by name: together no more than the process
        by_thread = run["proc"]["by_thread"]
        assert sum(row["count"] for row in by_thread.values()) == run["proc"]["threads"], name
        assert sum(row["cores"] for row in by_thread.values()) == pytest.approx(run["proc"]["process_cores"], abs=0.01), name
    # Our loop's own threads are named: the full loop's data producer runs; the memory variant closed it.
    assert {"batches-rank0", "raytrain-fast-metric-sinks"} <= set(runs["raytrain_fast"]["proc"]["by_thread"])
    assert "batches-rank0" not in runs["raytrain_fast_memory"]["proc"]["by_thread"]
    assert runs["bare"]["proc"]["threads"] < runs["bare_in_ray_worker"]["proc"]["threads"]
    assert runs["bare"]["proc"]["threads"] < runs["raytrain_fast"]["proc"]["threads"]
    # A report every step costs one controller poll per step: the typical loop cannot beat it.
    poll = report["ray_train_poll_interval_s"]
    assert runs["typical_ray_train"]["seconds"] >= 0.8 * setup.steps * poll


@pytest.mark.ray
def test_our_loop_at_ray_default_poll_interval_reports_far_less_than_once_per_step(
    ray_session, corpus_dir, tmp_path, monkeypatch
):
    """The suite polls Ray Train workers every 0.1 s (conftest); Ray's default is 2 s, and the
    controller takes one reported result per poll. Ray passes the driver's variable to the
    controller of each fit, so setting it here gives this test's runs the default."""
    from ray.train.v2._internal.constants import DEFAULT_HEALTH_CHECK_INTERVAL_S, HEALTH_CHECK_INTERVAL_S_ENV_VAR

    monkeypatch.setenv(HEALTH_CHECK_INTERVAL_S_ENV_VAR, str(DEFAULT_HEALTH_CHECK_INTERVAL_S))
    poll = health_check_interval_s()
    assert poll == DEFAULT_HEALTH_CHECK_INTERVAL_S == 2.0
    # The default reaches the controller: a report per step waits for a poll each.
    typical = in_ray_worker("typical_ray_train", micro_setup(corpus_dir, warmup_steps=1, steps=3))
    assert typical["seconds"] >= 0.75 * (3 - 1) * poll
    # Our loop (one checkpoint report inside the window) at that interval.
    setup = micro_setup(corpus_dir, warmup_steps=10, steps=30, log_every=10)
    ours = raytrain_fast_loop(setup, storage_dir=str(tmp_path / "runs"))
    assert ours["checkpoints_in_window"] == [30]
    once_per_step_ceiling = setup.tokens_per_step / poll
    assert ours["tokens_per_sec"] > 10 * once_per_step_ceiling, ours
    assert ours["windows_tokens_per_sec"] == pytest.approx(ours["tokens_per_sec"], rel=0.05)
