"""Peaks for MFU: the datasheet table (dense figures, None where unknown) and the measured matmul peak."""

from __future__ import annotations

import os
import time

import pytest
import torch

from raytrain_fast.metrics import MetricsConfig, datasheet_peak_flops, device_key, device_name, measure_matmul_peak, mfu
from raytrain_fast.metrics.peak import DTYPES
from raytrain_fast.config.metrics import metrics_config_problems

pytestmark = pytest.mark.unit


NAMES_IN_THE_WILD = [  # torch.cuda.get_device_name() as it reads on each
    "NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe",
    "NVIDIA H100 NVL", "NVIDIA H200", "NVIDIA H200 NVL", "NVIDIA L4", "NVIDIA L40", "NVIDIA L40S", "NVIDIA A10",
]


@pytest.mark.parametrize("name", NAMES_IN_THE_WILD)
def test_every_known_device_has_a_dense_figure_for_every_dtype(name):
    peaks = {dtype: datasheet_peak_flops(name, dtype) for dtype in DTYPES}
    assert None not in peaks.values(), peaks
    # Dense, never the datasheets' "with sparsity" figures (twice as large): the largest dense BF16
    # among these GPUs is under 1,000 TFLOP/s, the sparse ones of the H100/H200 SXM near 2,000.
    assert 100e12 <= peaks["bf16"] < 1000e12, peaks
    assert peaks["bf16"] == peaks["fp16"] >= peaks["tf32"] >= peaks["fp32"], peaks


def test_names_of_one_product_share_its_figures_and_near_names_do_not():
    for same in (["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe"],
                 ["NVIDIA H100 80GB HBM3", "NVIDIA H200"], ["NVIDIA H100 NVL", "NVIDIA H200 NVL"]):
        assert len({datasheet_peak_flops(name, dtype) for name in same for dtype in ("bf16",)}) == 1, same
    # The form factor changes the figure (SXM > NVL > PCIe), and an L40S is neither an L40 nor an L4.
    sxm, nvl, pcie = (datasheet_peak_flops(f"NVIDIA H100 {form}", "bf16") for form in ("80GB HBM3", "NVL", "PCIe"))
    assert sxm > nvl > pcie
    assert datasheet_peak_flops("NVIDIA L40S", "bf16") > datasheet_peak_flops("NVIDIA L40", "bf16") > datasheet_peak_flops("NVIDIA L4", "bf16")


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


def _busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat", encoding="ascii") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


@pytest.mark.quiet
def test_two_peak_measurements_on_one_machine_agree_within_10_percent():
    """The median of several short samples repeats; one best-of sample swung 366-927 GFLOP/s between runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    busy, own = _busy_cpu_seconds(), time.process_time()
    started = time.monotonic()
    try:
        first, second = (measure_matmul_peak(device="cpu", dtype="fp32", seconds=0.6, size=192) for _ in range(2))
    finally:
        torch.set_num_threads(threads)
    others = (_busy_cpu_seconds() - busy - (time.process_time() - own)) / (time.monotonic() - started)
    gap = abs(first - second) / max(first, second)
    if gap >= 0.10 and others > 0.2:
        # No measurement repeats while other processes take the cores it runs on (CI once measured 73 and
        # 63 GFLOP/s where a quiet run gives 175 +- 3%, with a 1-minute load average below the core count);
        # the per-host cache is what keeps runs comparable there. On a quiet machine this must hold.
        pytest.skip(f"machine busy (other processes used {others:.2f} cores meanwhile): "
                    f"{first / 1e9:.1f} vs {second / 1e9:.1f} GFLOP/s")
    assert gap < 0.10, (first, second, f"other processes used {others:.2f} cores meanwhile")


def test_measured_peak_is_cached_per_host_dtype_and_threads(tmp_path):
    from raytrain_fast.metrics.peak import cached_matmul_peak, peak_cache_key

    cache = str(tmp_path / "cache" / "matmul_peak.json")
    calls: list[str] = []

    def peak(dtype: str, seconds: float = 1.0, value: float = 5e9):
        def measure() -> float:
            calls.append(dtype)
            return value

        return cached_matmul_peak(device="cpu", dtype=dtype, seconds=seconds, cache_path=cache, measure=measure)

    first = peak("fp32")
    assert not first.cached and first.flops == 5e9 and calls == ["fp32"]
    again = peak("fp32", value=9e9)  # reused: the second figure is never measured
    assert again.cached and again.flops == 5e9 and again.measured_at == first.measured_at and calls == ["fp32"]
    assert peak("bf16", value=1e8).flops == 1e8 and calls == ["fp32", "bf16"]  # keyed by dtype
    assert peak("fp32", seconds=3.0, value=6e9).flops == 6e9  # a longer measurement than the cached one: measured again
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        assert not peak("fp32", value=7e9).cached  # keyed by thread count
    finally:
        torch.set_num_threads(threads)
    import json
    import socket

    keys = json.loads(open(cache, encoding="utf-8").read())
    assert all(key.startswith(socket.gethostname() + "|") for key in keys)
    assert peak_cache_key("cpu", "fp32") in keys and len(keys) == 3
