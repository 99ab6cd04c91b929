"""Peaks for MFU: the datasheet table (dense figures, None where unknown) and the measured matmul peak."""

from __future__ import annotations

import pytest
import torch

from raytrain_fast.metrics import MetricsConfig, datasheet_peak_flops, device_key, device_name, measure_matmul_peak, mfu
from raytrain_fast.metrics.config import metrics_config_problems


@pytest.mark.parametrize(
    ("name", "bf16_tflops", "fp32_tflops"),
    [
        ("NVIDIA A100-SXM4-80GB", 312, 19.5),
        ("NVIDIA A100-SXM4-40GB", 312, 19.5),
        ("NVIDIA A100 80GB PCIe", 312, 19.5),
        ("NVIDIA H100 80GB HBM3", 989.5, 67),
        ("NVIDIA H100 PCIe", 756.5, 51),
        ("NVIDIA H100 NVL", 835.5, 60),
        ("NVIDIA H200", 989.5, 67),
        ("NVIDIA H200 NVL", 835.5, 60),
        ("NVIDIA L4", 121, 30.3),
        ("NVIDIA L40S", 362.05, 91.6),
        ("NVIDIA A10", 125, 31.2),
    ],
)
def test_datasheet_peaks_are_dense(name, bf16_tflops, fp32_tflops):
    assert datasheet_peak_flops(name, "bf16") == pytest.approx(bf16_tflops * 1e12)
    assert datasheet_peak_flops(name, "fp32") == pytest.approx(fp32_tflops * 1e12)


@pytest.mark.parametrize("name", ["cpu:AMD EPYC 7B13", "NVIDIA A10G", "NVIDIA GH200 480GB", "NVIDIA H100", "Tesla T4", "AMD Instinct MI300X"])
def test_unknown_devices_have_no_datasheet_peak(name):
    assert datasheet_peak_flops(name, "bf16") is None


def test_cpu_has_no_datasheet_peak_but_a_measured_one():
    assert device_name("cpu").startswith("cpu:")
    assert device_key("cpu").endswith(f":{torch.get_num_threads()}t")
    assert datasheet_peak_flops(device_name("cpu"), "fp32") is None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = measure_matmul_peak(device="cpu", dtype="fp32", seconds=0.2, size=256)
    finally:
        torch.set_num_threads(threads)
    assert 1e8 < peak < 1e13  # one core: between 0.1 GFLOP/s and 10 TFLOP/s


def test_mfu_is_none_without_a_peak_or_flops():
    assert mfu(tokens_per_sec=1000.0, flops_per_token=1e6, peak_flops=None, num_devices=1) is None
    assert mfu(tokens_per_sec=1000.0, flops_per_token=None, peak_flops=1e12, num_devices=1) is None
    assert mfu(tokens_per_sec=1000.0, flops_per_token=1e6, peak_flops=1e12, num_devices=2) == pytest.approx(5e-4)


def test_metrics_config_problems_name_the_field():
    assert metrics_config_problems(MetricsConfig()) == []
    problems = metrics_config_problems(MetricsConfig(queue_size=0, slowdown_threshold=0.0, profile_every=-1))
    assert any("metrics.queue_size" in p for p in problems)
    assert any("metrics.slowdown_threshold" in p for p in problems)
    assert any("metrics.profile_every" in p for p in problems)
