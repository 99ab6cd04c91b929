"""`train.micro_batch: auto` and the search it shares with the sweep (raytrain_fast.microbatch):
candidates, outcomes, peak memory, validation, and a real search under a small CPU memory budget
(each candidate measured in a fresh Ray worker process), then a training run with the choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_fast.microbatch.auto import Probe, candidate_micro_batches, search
from raytrain_fast.config import load_config, validate
from raytrain_fast.errors import ConfigError, RaytrainFastError
from raytrain_fast.microbatch import (
    FAILED,
    OK,
    OOM,
    OVER_BUDGET,
    MemoryBudgetExceeded,
    Outcome,
    classify_error,
    classify_peak,
    fastest,
    plan_candidates,
)
from raytrain_fast.metrics.memory import peak_memory_gb

pytestmark = pytest.mark.unit


def _config(tmp_path: Path, *extra: str, name: str = "auto"):
    return load_config(
        "tiny",
        [
            # Long sequences on a narrow model: activation memory, which grows with the micro-batch,
            # is large next to what does not (weights, optimizer state, the libraries).
            # A large vocabulary adds logits memory per token at little compute.
            "model.vocab_size=4096", "model.d_model=64", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=2048",
            "data.seq_len=2048", "data.max_tokens=100000", "train.global_batch=4", "train.micro_batch=auto",
            "engine.precision=fp32", "metrics.peak_measure_s=0.2", f"storage.uri={tmp_path / 'runs'}", *extra,
        ],
        name=name,
    )


def test_candidates_keep_the_global_batch():
    assert candidate_micro_batches(16, 1) == [1, 2, 4, 8, 16]
    assert candidate_micro_batches(4, 1) == [1, 2, 4]
    assert candidate_micro_batches(24, 2) == [1, 2, 4, 12]  # 12 per worker: powers of two that divide it, and 12
    assert candidate_micro_batches(15, 2) == []
    assert candidate_micro_batches(96, 1) == [1, 2, 4, 8, 16, 32, 96]  # not the 12 divisors of 96
    assert candidate_micro_batches(7, 1) == [1, 7]
    assert candidate_micro_batches(0, 1) == [] and candidate_micro_batches(8, 0) == []
    for global_batch in range(1, 65):
        for workers in range(1, 5):
            candidates = candidate_micro_batches(global_batch, workers)
            runnable, skipped = plan_candidates(global_batch, workers)
            assert [m for m, _ in runnable] == candidates and skipped == []  # the default list needs no skipping
            assert all(m * accum * workers == global_batch for m, accum in runnable)
            if global_batch % workers == 0:
                per_worker = global_batch // workers
                assert candidates[0] == 1 and candidates[-1] == per_worker and candidates == sorted(set(candidates))
                assert all(m == per_worker or m & (m - 1) == 0 for m in candidates)
            else:
                assert candidates == []


def test_one_plan_rule_for_a_given_list():
    runnable, skipped = plan_candidates(8, 2, [8, 0, 3, 2, 2, 1, -4])
    assert runnable == [(1, 4), (2, 2)]  # ascending, each once
    assert skipped == [
        (-4, "micro-batch must be > 0"), (0, "micro-batch must be > 0"),
        (3, "global batch 8 is not a multiple of 3 x 2 worker(s) = 6"),
        (8, "global batch 8 is not a multiple of 8 x 2 worker(s) = 16"),
    ]
    assert plan_candidates(8, 2, []) == ([], [])


def test_a_measured_peak_is_ok_or_over_budget():
    assert classify_peak(0.9, 1.0) == Outcome(OK) and classify_peak(0.9, 1.0).fits
    assert classify_peak(1.0, 1.0).status == OK  # at the budget still fits
    assert classify_peak(50.0, None).status == OK  # no budget: nothing to exceed
    assert classify_peak(None, 1.0).status == OK
    over = classify_peak(1.1, 1.0)
    assert (over.status, over.reason, over.fits) == (OVER_BUDGET, "over memory budget: peak 1.100 GB > budget 1.000 GB", False)


def test_an_error_is_oom_over_budget_or_failed_with_one_line():
    import torch

    try:
        torch.empty(2**62, dtype=torch.uint8)  # PyTorch's CPU allocator gives up: a real out-of-memory error
    except RuntimeError as error:
        cpu_oom = classify_error(error)
    assert cpu_oom.status == OOM and cpu_oom.reason.startswith("out of memory: ") and "can't allocate memory" in cpu_oom.reason
    cuda_oom = classify_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail"))
    assert cuda_oom == Outcome(OOM, "out of memory: CUDA out of memory. Tried to allocate 2.00 GiB.")

    budget = MemoryBudgetExceeded("peak memory 1.20 GB > resources.memory_budget_gb 0.90 GB at step 2")
    wrapped = RuntimeError("training failed: CUDA out of memory somewhere else")
    wrapped.__cause__ = budget
    assert classify_error(wrapped) == Outcome(OVER_BUDGET, f"over memory budget: {budget}")  # the budget says more

    plain = ValueError("first line\n\n  the last line says most  \n")
    assert classify_error(plain) == Outcome(FAILED, "ValueError: the last line says most")
    outer = RuntimeError("outer")
    outer.__cause__ = KeyError("deep")
    assert classify_error(outer) == Outcome(FAILED, "KeyError: 'deep'")  # the deepest cause
    assert classify_error(RuntimeError("x" * 500)).reason == "RuntimeError: " + "x" * 200  # one short line
    assert classify_error(RuntimeError()) == Outcome(FAILED, "RuntimeError")
    loop = RuntimeError("a")
    loop.__cause__ = loop  # a cycle ends
    assert classify_error(loop).status == FAILED


def test_ray_train_worker_failures_are_looked_into():
    from ray.train.v2.api.exceptions import ControllerError, WorkerGroupError

    failures = {0: ValueError("fine"), 1: MemoryBudgetExceeded("peak 2 GB")}
    group = WorkerGroupError("Training failed due to worker errors", failures)
    assert classify_error(group) == Outcome(OVER_BUDGET, "over memory budget: peak 2 GB")
    controller = ControllerError(RuntimeError("NCCL error: unhandled cuda error, NCCL version 2.21: out of memory"))
    assert classify_error(controller).status == OOM


def test_fastest_is_the_ok_one_with_most_tokens():
    probes = [
        Probe(micro_batch=1, grad_accum=4, status=OK, tokens_per_sec=100.0),
        Probe(micro_batch=2, grad_accum=2, status=OK, tokens_per_sec=300.0),
        Probe(micro_batch=4, grad_accum=1, status=OVER_BUDGET, tokens_per_sec=900.0),  # faster, but it does not fit
        Probe(micro_batch=8, grad_accum=1, status=OK),  # no speed measured
    ]
    assert fastest(probes) is probes[1]
    assert fastest(probes[2:]) is None and fastest([]) is None


def test_peak_memory_on_cpu_holds_what_is_alive():
    import resource

    import torch

    def current_gb() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * resource.getpagesize() / 1e9

    before = current_gb()
    block = torch.ones(50_000_000, dtype=torch.float32)  # 0.2 GB, touched
    assert peak_memory_gb() >= before + 0.19
    for device in (torch.device("cpu"), "cpu"):
        now = current_gb()  # the block still alive: the peak holds it
        assert peak_memory_gb(device) >= now
    del block


@pytest.mark.gpu
def test_peak_memory_on_gpu_is_what_the_allocator_reserved():
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    block = torch.ones(50_000_000, dtype=torch.float32, device=device)
    del block  # freed, but the caching allocator keeps it: the next allocation competes with it
    assert peak_memory_gb(device) == torch.cuda.max_memory_reserved(device) / 1e9
    assert peak_memory_gb(device) >= max(0.2, torch.cuda.max_memory_allocated(device) / 1e9)


def test_search_stops_at_the_first_that_does_not_fit_and_takes_the_fastest(tmp_path):
    measured = {1: (OK, 100.0, 0.5), 2: (OK, 300.0, 0.6), 4: (OK, 200.0, 0.7), 8: (OVER_BUDGET, 400.0, 1.2), 16: (OK, 999.0, 0.1)}
    asked = []

    def probe(config, *, micro_batch, grad_accum, budget_gb):
        asked.append((micro_batch, grad_accum, budget_gb))
        status, speed, peak = measured[micro_batch]
        return Probe(micro_batch=micro_batch, grad_accum=grad_accum, status=status, tokens_per_sec=speed, peak_gb=peak,
                     reason=classify_peak(peak, budget_gb).reason)

    config = _config(tmp_path, "train.global_batch=32", "resources.num_workers=2", "resources.memory_budget_gb=1")
    choice = search(config, probe=probe)
    assert asked == [(1, 16, 1.0), (2, 8, 1.0), (4, 4, 1.0), (8, 2, 1.0)]  # 16 per worker, never probed past 8
    assert (choice.micro_batch, choice.grad_accum) == (2, 8)
    assert "fastest of 3 that fit" in choice.reason and "the larger 4 fit but ran slower" in choice.reason
    assert "micro_batch=8 did not fit (over memory budget: peak 1.200 GB > budget 1.000 GB)" in choice.reason

    measured[1] = (OOM, None, None)
    with pytest.raises(ConfigError, match="not even micro_batch=1 fits"):
        search(config, probe=probe)
    measured[1] = (FAILED, None, None)
    with pytest.raises(RaytrainFastError, match="the probe of micro_batch=1 failed"):
        search(config, probe=probe)


def test_search_turns_activation_checkpointing_on_only_when_nothing_fits_without_it(tmp_path):
    from raytrain_fast.microbatch.auto import cache_key, resolve_micro_batch

    # Peaks (GB) by (micro_batch, activation checkpointing); the decision under test, not the numbers
    # (test_auto_turns_activation_checkpointing_on_under_a_budget_only_it_meets measures real ones).
    peaks = {(1, "none"): 1.3, (2, "none"): 1.6, (1, "full"): 0.6, (2, "full"): 0.8, (4, "full"): 1.1}
    asked = []

    def probe(config, *, micro_batch, grad_accum, budget_gb):
        ckpt = config.model.activation_checkpointing
        asked.append((micro_batch, ckpt))
        outcome = classify_peak(peaks[micro_batch, ckpt], budget_gb)
        return Probe(micro_batch=micro_batch, grad_accum=grad_accum, status=outcome.status, reason=outcome.reason,
                     tokens_per_sec=100.0 * micro_batch, peak_gb=peaks[micro_batch, ckpt])

    config = _config(tmp_path, "resources.use_gpu=false", "resources.cpus_per_worker=2", "resources.memory_budget_gb=1")
    choice = search(config, probe=probe)
    assert asked == [(1, "none"), (1, "full"), (2, "full"), (4, "full")]  # again smallest first, with it on
    assert (choice.micro_batch, choice.grad_accum, choice.activation_checkpointing) == (2, 2, "full")
    assert choice.reason.startswith(
        "no micro-batch fits without activation checkpointing (micro_batch=1 did not fit: over memory budget: "
        "peak 1.300 GB > budget 1.000 GB); with it (full), micro_batch=2 fits: fastest of 2 that fit"
    ), choice.reason
    assert [p.activation_checkpointing for p in choice.probes] == ["none", "full", "full", "full"]

    # resolve_micro_batch turns it on in the config, says so, and a cached answer does the same.
    resolved = resolve_micro_batch(config, probe=probe)
    assert resolved.model.activation_checkpointing == "full" and resolved.train.micro_batch == 2
    cached = resolve_micro_batch(config, probe=_must_not_probe)
    assert cached.model == resolved.model and cached.train == resolved.train

    # Something fits without it: left off. A setting of the user's own: never changed.
    peaks[1, "none"] = 0.9
    assert search(config, probe=probe).activation_checkpointing is None
    peaks[1, "none"] = 1.3
    for own in ("every_n", "full"):
        peaks[1, own] = 1.2
        asked.clear()
        with pytest.raises(ConfigError, match=f"not even micro_batch=1 fits with model.activation_checkpointing={own}"):
            search(_config(tmp_path, f"model.activation_checkpointing={own}", "resources.memory_budget_gb=1"), probe=probe)
        assert asked == [(1, own)]
    # The cache key tells `none` (which the search may turn on) from an explicit `full`.
    explicit = _config(tmp_path, "resources.use_gpu=false", "resources.cpus_per_worker=2", "resources.memory_budget_gb=1",
                       "model.activation_checkpointing=full")
    assert cache_key(explicit)[0] != cache_key(config)[0]

    # Nothing fits with it either: the error says both were tried.
    peaks[1, "full"] = 1.05
    with pytest.raises(ConfigError, match=r"not even micro_batch=1 fits, neither without activation checkpointing "
                       r"\(over_budget: .*1\.300 GB.*\) nor with it, full \(over_budget: .*1\.050 GB"):
        search(config, probe=probe)


def test_auto_is_validated_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="set train.grad_accum=null"):
        validate(_config(tmp_path, "train.grad_accum=2", "resources.memory_budget_gb=4"))
    with pytest.raises(ConfigError, match="multiple of resources.num_workers"):
        validate(_config(tmp_path, "train.global_batch=15", "resources.num_workers=2", "resources.memory_budget_gb=4"))
    with pytest.raises(ConfigError, match="must be > 0"):
        validate(_config(tmp_path, "resources.memory_budget_gb=0"))
    no_budget = _config(tmp_path)
    validate(no_budget)  # a GPU cluster would not need a budget...
    with pytest.raises(ConfigError, match="needs resources.memory_budget_gb"):
        validate(no_budget, cluster_cpus=2, cluster_gpus=0)  # ...CPU workers do
    validate(_config(tmp_path, "resources.memory_budget_gb=4"), cluster_cpus=2, cluster_gpus=0)
    with pytest.raises(ValueError, match="must be resolved first"):
        no_budget.batch()


@pytest.mark.ray
@pytest.mark.slow
def test_auto_under_a_small_budget_fits_keeps_the_global_batch_and_is_cached(ray_session, tmp_path, capfd):
    import dataclasses

    from raytrain_fast.microbatch.auto import resolve_micro_batch
    from raytrain_fast.launch.trainer import run
    from raytrain_fast.metrics import read_metrics

    # GB. Measured on the 2-core CI machine: a probe peaks at about 0.75 GB with one sequence of 2048
    # tokens per micro-batch, 0.85 GB with 2 and 1.1 GB with 4.
    budget = 0.95
    config = _config(tmp_path, f"resources.memory_budget_gb={budget}", "train.steps=3", "train.log_every=1", "optim.warmup_steps=1")
    result = run(config)
    out = capfd.readouterr().out

    (cache_file,) = (tmp_path / "runs" / "_autobatch").glob("*.json")
    record = json.loads(cache_file.read_text())
    probes = {p["micro_batch"]: p for p in record["probes"]}
    chosen = probes[record["micro_batch"]]
    assert chosen["status"] == "ok" and chosen["peak_gb"] <= budget  # its measured peak fits
    assert any(p["status"] == "over_budget" and p["peak_gb"] > budget for p in probes.values())  # the budget binds
    assert chosen["tokens_per_sec"] == max(p["tokens_per_sec"] for p in probes.values() if p["status"] == "ok")
    assert sorted(probes) in ([1, 2, 4], [1, 2]) and record["micro_batch"] * record["grad_accum"] == 4
    assert f"micro_batch=auto -> micro_batch={record['micro_batch']}, grad_accum={record['grad_accum']}" in out
    # engine.compile=auto is off on CPUs: the probe built the eager program the run trains, and the run compiled nothing.
    assert record["key_inputs"]["compile"] == "auto" and chosen["compiled"] is False, record
    assert "Compile: on" not in out and not any("time/compile_s" in r for r in read_metrics(result.run_dir))

    # The run trained at the global batch asked for, and its memory share is measured against the budget.
    assert result.metrics["step"] == 3 and result.metrics["tokens"] == 3 * 4 * 2048
    records = [r for r in read_metrics(result.run_dir) if "memory/peak_gb" in r]
    assert records and all(r["memory/peak_frac"] == pytest.approx(r["memory/peak_gb"] / budget) for r in records)
    # The probe imports what a worker imports, so the worker's own peak fits as well (0.85 GB of 0.95 here).
    assert max(r["memory/peak_gb"] for r in records) <= budget

    # A rerun (or a resume) finds the choice in storage and measures nothing.
    resolved = resolve_micro_batch(_on_the_cluster(config), probe=_must_not_probe)
    assert (resolved.train.micro_batch, resolved.train.grad_accum) == (record["micro_batch"], record["grad_accum"])
    assert "cached in" in capfd.readouterr().out
    # A different budget is a different question: not answered from this cache.
    other = dataclasses.replace(config, resources=dataclasses.replace(config.resources, memory_budget_gb=budget * 2))
    with pytest.raises(AssertionError, match="probed"):
        resolve_micro_batch(_on_the_cluster(other), probe=_must_not_probe)


@pytest.mark.ray
@pytest.mark.slow
def test_auto_turns_activation_checkpointing_on_under_a_budget_only_it_meets(ray_session, tmp_path, capfd):
    from raytrain_fast.microbatch.auto import resolve_micro_batch

    # One sequence of 4096 tokens through 12 blocks with a 32x-wide MLP: activations are most of the
    # memory. Measured 3 times each on the 2-core CI machine (micro_batch=1): the probe peaks at
    # 1.65-1.71 GB without activation checkpointing and at 0.83-0.84 GB with it (full).
    budget = 1.25
    config = _config(
        tmp_path, "model.vocab_size=320", "model.num_layers=12", "model.mlp_ratio=32", "model.max_seq_len=4096",
        "data.seq_len=4096", "train.global_batch=1", f"resources.memory_budget_gb={budget}",
    )
    resolved = resolve_micro_batch(_on_the_cluster(config))
    out = capfd.readouterr().out
    assert (resolved.train.micro_batch, resolved.train.grad_accum, resolved.model.activation_checkpointing) == (1, 1, "full")
    assert "micro_batch=auto -> micro_batch=1, grad_accum=1, model.activation_checkpointing=full" in out
    assert "no micro-batch fits without activation checkpointing" in out and "with it (full), micro_batch=1 fits" in out

    (cache_file,) = (tmp_path / "runs" / "_autobatch").glob("*.json")
    record = json.loads(cache_file.read_text())
    without, with_it = record["probes"]
    assert (without["activation_checkpointing"], without["status"]) == ("none", "over_budget") and without["peak_gb"] > budget
    assert (with_it["activation_checkpointing"], with_it["status"]) == ("full", "ok") and with_it["peak_gb"] <= budget
    assert record["activation_checkpointing"] == "full" and record["key_inputs"]["model"]["activation_checkpointing"] == "none"

    # A rerun finds the choice, activation checkpointing included, and measures nothing.
    again = resolve_micro_batch(_on_the_cluster(config), probe=_must_not_probe)
    assert again.model == resolved.model and again.train == resolved.train
    assert "cached in" in capfd.readouterr().out


def _on_the_cluster(config):
    """The config as the plan hands it to micro_batch=auto: checked, its resources resolved on the cluster."""
    from raytrain_fast.launch.checks import check_run
    from raytrain_fast.launch.plan import on_the_cluster

    return on_the_cluster(check_run(config).config)[0]


def _must_not_probe(*args, **kwargs):
    raise AssertionError("probed although the choice was cached")


def test_a_program_of_another_shape_is_a_new_question_for_the_cache(tmp_path):
    from raytrain_fast.microbatch.auto import cache_key

    settings = ("resources.use_gpu=false", "resources.cpus_per_worker=2", "resources.memory_budget_gb=1")
    base = cache_key(_config(tmp_path, *settings))[0]
    assert cache_key(_config(tmp_path, *settings))[0] == base
    for other in ("engine.compile=on", "data.document_masking=true"):
        assert cache_key(_config(tmp_path, *settings, other))[0] != base, other


@pytest.mark.e2e
@pytest.mark.slow
def test_the_probe_compiles_the_blocks_when_the_run_does(ray_session, tmp_path, capfd):
    """micro_batch=auto's probe builds the program the run trains (engine/program.py): with
    engine.compile=on its blocks are compiled as the run's are (with auto, off on CPUs, neither is:
    test_auto_under_a_small_budget_fits_keeps_the_global_batch_and_is_cached)."""
    from raytrain_fast.launch.trainer import run
    from raytrain_fast.metrics import read_metrics

    def config(name: str, setting: str):
        return _config(
            tmp_path, "model.vocab_size=512", "model.d_model=32", "model.max_seq_len=32", "data.seq_len=32",
            "data.max_tokens=20000", "train.global_batch=1", "train.steps=2", "optim.warmup_steps=0", "train.log_every=1", "eval.enabled=false",
            "checkpoint.every_steps=0", "resources.num_workers=1", "resources.cpus_per_worker=1",
            "resources.memory_budget_gb=8", f"engine.compile={setting}", name=name,
        )

    result = run(config("compiled", "on"))
    out = capfd.readouterr().out
    (probe,) = next(r for r in _cache_records(tmp_path) if r["key_inputs"]["compile"] == "on")["probes"]
    assert probe["status"] == "ok" and probe["compiled"] is True, probe
    assert "Compile: on, 2 blocks compiled on their first step" in out, out[-2000:]
    assert any("time/compile_s" in r for r in read_metrics(result.run_dir))


def _cache_records(tmp_path: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in (tmp_path / "runs" / "_autobatch").glob("*.json")]
