"""`train.micro_batch: auto`: candidates, validation, and a real search under a small CPU memory
budget (each candidate measured in a fresh Ray worker process), then a training run with the choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_fast.autobatch import candidate_micro_batches
from raytrain_fast.config import load_config, validate
from raytrain_fast.errors import ConfigError


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
        no_budget.grad_accum()


@pytest.mark.slow
def test_auto_under_a_small_budget_fits_keeps_the_global_batch_and_is_cached(ray_session, tmp_path, capfd):
    import dataclasses

    from raytrain_fast.autobatch import resolve_micro_batch
    from raytrain_fast.launch.trainer import resolve_resources, run
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

    # The run trained at the global batch asked for, and its memory share is measured against the budget.
    assert result.metrics["step"] == 3 and result.metrics["tokens"] == 3 * 4 * 2048
    records = [r for r in read_metrics(result.run_dir) if "memory/peak_gb" in r]
    assert records and all(r["memory/peak_frac"] == pytest.approx(r["memory/peak_gb"] / budget) for r in records)
    # The probe imports what a worker imports, so the worker's own peak fits as well (0.85 GB of 0.95 here).
    assert max(r["memory/peak_gb"] for r in records) <= budget

    # A rerun (or a resume) finds the choice in storage and measures nothing.
    resolved = resolve_micro_batch(resolve_resources(config), probe=_must_not_probe)
    assert (resolved.train.micro_batch, resolved.train.grad_accum) == (record["micro_batch"], record["grad_accum"])
    assert "cached in" in capfd.readouterr().out
    # A different budget is a different question: not answered from this cache.
    other = dataclasses.replace(config, resources=dataclasses.replace(config.resources, memory_budget_gb=budget * 2))
    with pytest.raises(AssertionError, match="probed"):
        resolve_micro_batch(resolve_resources(other), probe=_must_not_probe)


def _must_not_probe(*args, **kwargs):
    raise AssertionError("probed although the choice was cached")
