"""The overhead bench harness: interleaved repeats, medians, ratios; the two reference loops run."""

from __future__ import annotations

import pytest

from raytrain_fast.bench.overhead import OverheadSetup, bare, compare, overhead_report, typical_ray_train

TINY = OverheadSetup(warmup_steps=1, steps=3, micro_batch=4, threads=1, precision="fp32")


def test_compare_interleaves_rotates_and_summarises():
    calls: list[str] = []

    def variant(name: str, values: list[float]):
        queue = list(values)

        def run() -> float:
            calls.append(name)
            return queue.pop(0)

        return run

    report = compare({"a": variant("a", [100.0, 120.0, 110.0]), "b": variant("b", [50.0, 40.0, 60.0])}, repeats=3)
    assert calls == ["a", "b", "b", "a", "a", "b"]  # round-robin, the order rotated each round
    assert report["order"] == [["a", "b"], ["b", "a"], ["a", "b"]]
    a = report["variants"]["a"]
    assert a["tokens_per_sec"] == [100.0, 120.0, 110.0]
    assert a["median"] == 110.0 and a["min"] == 100.0 and a["max"] == 120.0
    assert a["spread"] == pytest.approx(20.0 / 110.0)


def test_report_ratios_against_bare_with_the_package_variant():
    report = overhead_report(setup=TINY, raytrain_fast=lambda: 1.0, repeats=2, include_typical=False)
    bare_median = report["variants"]["bare"]["median"]
    assert bare_median > 0
    assert report["ratios"]["ratio_vs_bare"] == pytest.approx(1.0 / bare_median)
    assert "ratio_vs_typical" not in report["ratios"]
    assert report["setup"]["precision"] == "fp32" and report["setup"]["threads"] == 1


def test_bare_loop_reports_tokens_per_second():
    assert bare(TINY) > 0


def test_typical_ray_train_loop_runs_on_a_torch_trainer(ray_session):
    import torch

    threads = torch.get_num_threads()
    try:
        # Local mode (the loop in this process) keeps the test short; the bench itself uses one worker.
        assert typical_ray_train(TINY, num_workers=0) > 0
    finally:
        torch.set_num_threads(threads)
