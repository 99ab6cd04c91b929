"""The run's coordinator actor: values measured once per run, across worker-group restarts and resumes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from raytrain_fast.coordinator import Coordinator, CoordinatorError, model_fingerprint
from raytrain_fast.metrics.peak import device_key, measure_matmul_peak

pytestmark = pytest.mark.ray


def _worker_round(ray, *, run_name: str, ranks: list[int], log_path: str, fingerprint: str = "tiny-128", fresh: bool = False):
    """One worker group: every rank asks for FLOPs per token and the CPU fp32 peak. With `fresh`, each
    task runs in a new process (max_calls=1), like the workers of a restarted group."""

    @ray.remote(num_cpus=0, max_calls=1 if fresh else 0)
    def worker(rank: int) -> tuple[float, float]:
        import torch

        torch.set_num_threads(1)
        coordinator = Coordinator.connect(run_name, timeout_s=60, create_if_missing=False)

        def count() -> float:
            with open(log_path, "a") as log:  # one line per real measurement, from any process
                log.write(f"rank {rank} pid {os.getpid()}\n")
            time.sleep(0.3)  # measuring takes a while: the other ranks must wait, not measure
            return 1010.0

        flops = coordinator.flops_per_token(rank=rank, count=count, formula=1000.0, fingerprint=fingerprint)
        peak = coordinator.achievable_peak(
            device_key=device_key("cpu"), dtype="fp32", seconds=0.2,
            measure=lambda: measure_matmul_peak(device="cpu", dtype="fp32", seconds=0.2),
        )
        return flops.counted, peak

    return ray.get([worker.remote(rank) for rank in ranks])


def _measurement_lines(path: str) -> list[str]:
    return open(path).read().splitlines() if os.path.exists(path) else []


def test_values_are_measured_once_across_a_worker_group_restart(ray_session, tmp_path):
    ray = ray_session
    log_path = str(tmp_path / "measurements.log")
    driver = Coordinator.start("restart-run")
    try:
        # Rank 1 asks first and must wait for rank 0; then the group is restarted in new processes.
        first = _worker_round(ray, run_name="restart-run", ranks=[1, 0], log_path=log_path, fresh=True)
        second = _worker_round(ray, run_name="restart-run", ranks=[1, 0], log_path=log_path, fresh=True)
        lines = _measurement_lines(log_path)
        assert len(lines) == 1 and lines[0].startswith("rank 0 ")  # counted once, by rank 0
        assert {flops for flops, _ in first + second} == {1010.0}
        # One peak measurement shared by all four workers: independent measurements would differ.
        assert len({peak for _, peak in first + second}) == 1
        assert sorted(driver.measurements().values()) == [1, 1]
    finally:
        driver.end()


def test_a_new_job_imports_the_values_from_the_checkpoint(ray_session, tmp_path):
    ray = ray_session
    log_path = str(tmp_path / "measurements.log")
    old = Coordinator.start("resumed-run")
    _worker_round(ray, run_name="resumed-run", ranks=[0, 1], log_path=log_path)
    state = old.export_state()  # what goes into the checkpoint
    old.end()  # the driver of the first job is gone, and its actor with it

    coordinator = Coordinator.start("resumed-run")
    try:
        assert len(coordinator.import_state(state)) == 2
        results = _worker_round(ray, run_name="resumed-run", ranks=[1, 0], log_path=log_path)
        assert len(_measurement_lines(log_path)) == 1  # nothing measured again
        assert coordinator.measurements() == {}
        assert {flops for flops, _ in results} == {1010.0}
        # A different model shape is never served a stale value.
        _worker_round(ray, run_name="resumed-run", ranks=[0], log_path=log_path, fingerprint="bigger-model")
        assert len(_measurement_lines(log_path)) == 2
    finally:
        coordinator.end()


def test_waiting_rank_fails_with_a_clear_error_when_rank_0_never_posts(ray_session):
    coordinator = Coordinator.start("stuck-run")
    coordinator.timeout_s = 1.0  # a waiting rank's limit (metrics.coordinator_timeout_s)
    try:
        started = time.monotonic()
        with pytest.raises(CoordinatorError, match="from rank 0") as error:
            coordinator.flops_per_token(rank=3, count=lambda: 1.0, formula=None, fingerprint="x")
        assert time.monotonic() - started < 10
        assert "coordinator_timeout_s" in str(error.value)
    finally:
        coordinator.end()


def test_a_failed_measurement_lets_another_rank_measure(ray_session):
    coordinator = Coordinator.start("flaky-run")
    coordinator.timeout_s = 5.0  # a waiting rank's limit (metrics.coordinator_timeout_s)
    try:

        def broken() -> float:
            raise RuntimeError("device lost")

        with pytest.raises(RuntimeError, match="device lost"):
            coordinator.get_or_measure("peak/x", measure=broken, may_measure=True, who="any rank")
        assert coordinator.get_or_measure("peak/x", measure=lambda: 7.0, may_measure=True, who="any rank") == 7.0
    finally:
        coordinator.end()


def test_a_rank_that_dies_while_measuring_is_replaced_quickly(ray_session):
    ray = ray_session
    driver = Coordinator.start("dying-run")

    @ray.remote(num_cpus=0, max_retries=0)
    def dying_rank_0() -> None:
        coordinator = Coordinator.connect("dying-run", create_if_missing=False, timeout_s=30)
        coordinator.lease_s = 1.0
        coordinator.flops_per_token(rank=0, count=lambda: os._exit(1), formula=None, fingerprint="f")

    try:
        with pytest.raises(ray.exceptions.RayError):
            ray.get(dying_rank_0.remote())  # died holding the claim
        restarted = Coordinator(driver.actor, run_name="dying-run", timeout_s=30, lease_s=1.0)
        started = time.monotonic()
        flops = restarted.flops_per_token(rank=0, count=lambda: 123.0, formula=None, fingerprint="f")
        assert flops.counted == 123.0
        assert time.monotonic() - started < 15  # the lease ran out; no waiting for the 30 s timeout
    finally:
        driver.end()


def test_counted_and_formula_flops_disagreeing_is_a_warning_naming_both(ray_session, caplog):
    coordinator = Coordinator.start("mismatch-run")
    try:
        with caplog.at_level(logging.WARNING, logger="raytrain_fast.coordinator"):
            flops = coordinator.flops_per_token(rank=0, count=lambda: 1.3e6, formula=1.0e6, fingerprint="m")
        assert "1.3e+06" in caplog.text and "1e+06" in caplog.text and "+30%" in caplog.text
        assert flops.for_mfu == 1.0e6 and flops.counted == 1.3e6
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="raytrain_fast.coordinator"):
            coordinator.flops_per_token(rank=0, count=lambda: 1.05e6, formula=1.0e6, fingerprint="close")
        assert caplog.text == ""
    finally:
        coordinator.end()


def test_the_actor_module_imports_neither_torch_nor_deepspeed():
    code = "import sys, raytrain_fast.coordinator; print('torch' in sys.modules, 'deepspeed' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "False"]


def test_fingerprint_depends_on_the_shape():
    assert model_fingerprint({"d_model": 128}, 128) == model_fingerprint({"d_model": 128}, 128)
    assert model_fingerprint({"d_model": 128}, 128) != model_fingerprint({"d_model": 128}, 256)


def test_mfu_inputs_for_the_tiny_gpt_on_cpu(ray_session):
    import torch

    from raytrain_fast.metrics import MetricsConfig
    from raytrain_fast.metrics.setup import mfu_inputs
    from raytrain_fast.model import GPT, ModelConfig

    coordinator = Coordinator.start("mfu-run")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = GPT(ModelConfig(num_layers=2, d_model=64, num_heads=2))
        tokens = torch.randint(0, 257, (16, 64))
        inputs = mfu_inputs(
            coordinator, MetricsConfig(peak_measure_s=0.2),
            rank=0, model=model, sample_tokens=tokens, device="cpu", precision="fp32",
        )
        assert inputs.flops_per_token == model.flops_per_token(64)  # MFU uses the model's formula ...
        assert inputs.counted_flops_per_token == pytest.approx(inputs.flops_per_token, rel=0.10)  # ... checked by a count
        assert inputs.datasheet_peak_flops is None and inputs.dtype == "fp32"  # no datasheet for a CPU
        assert inputs.measured_peak_flops > 0
        assert all(p.grad is None for p in model.parameters())  # counting left no gradients behind
    finally:
        torch.set_num_threads(threads)
        coordinator.end()
