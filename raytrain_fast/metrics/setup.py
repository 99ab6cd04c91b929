"""The numbers MFU needs, obtained once per run through the coordinator."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.metrics.peak import datasheet_peak_flops, device_name, matmul_dtype

if TYPE_CHECKING:
    import torch

    from raytrain_fast.coordinator import Coordinator
    from raytrain_fast.metrics.peak import PeakFigure


@dataclass(frozen=True, kw_only=True)
class MfuInputs:
    flops_per_token: float | None
    """Training FLOPs per token used for MFU (the model's formula; the count where there is none)."""
    counted_flops_per_token: float | None
    """FlopCounterMode's count over one forward + backward (rank 0, once per run)."""
    datasheet_peak_flops: float | None
    """Per device, dense, from the datasheet table; None for CPUs and unlisted devices."""
    measured_peak_flops: float | None
    """Per device, measured with large matmuls in the training dtype; None where not measured."""
    device_name: str
    dtype: str
    """The matmul dtype the peaks are for (bf16, fp16, tf32 or fp32)."""
    peak_source: str | None = None
    """Where measured_peak_flops came from (measured now, the per-host cache, this run); None where not measured here."""

    def peak_line(self) -> str | None:
        """The `Measured peak:` line rank 0 prints, so a run says which denominator its % of peak uses."""
        if self.measured_peak_flops is None or self.peak_source is None:
            return None
        return f"Measured peak: {self.measured_peak_flops / 1e9:,.0f} GFLOP/s per device in {self.dtype} ({self.peak_source})"


def mfu_inputs(
    coordinator: Coordinator,
    config: MetricsConfig,
    *,
    rank: int,
    model: Any,
    sample_tokens: torch.Tensor,
    device: torch.device | str,
    precision: str,
    measure_peak: bool | None = None,
) -> MfuInputs:
    """FLOPs per token (counted by rank 0, read by every rank) and the peaks of this device.

    Call it on every rank BEFORE the model is wrapped by DeepSpeed: counting runs one plain
    forward + backward on `model` (a GPT, on the device it will train on; `sample_tokens` (B, T) on
    that device too; one sequence is enough, FLOPs per token do not depend on the batch). Rank 0's
    count is shared through the coordinator, so a restarted worker group does not count again.
    The achievable peak is measured by rank 0 only (`measure_peak` overrides), once per run and
    device type, for `config.peak_measure_s` seconds (0 = not measured).
    """
    from raytrain_fast.coordinator import model_fingerprint
    from raytrain_fast.model.flops import count_training_flops_per_token

    sample = sample_tokens[:1]
    seq_len = int(sample.shape[1])
    formula = model.flops_per_token(seq_len) if hasattr(model, "flops_per_token") else None
    model_config = getattr(model, "config", None)
    shape = dataclasses.asdict(model_config) if dataclasses.is_dataclass(model_config) else repr(model)
    flops = coordinator.flops_per_token(
        rank=rank,
        count=lambda: count_training_flops_per_token(model, sample),
        formula=formula,
        fingerprint=model_fingerprint(shape, seq_len),
    )
    dtype = matmul_dtype(precision)
    name = device_name(device)
    if measure_peak is None:
        measure_peak = rank == 0
    measured, source = None, None
    if measure_peak and config.peak_measure_s > 0:
        measured, source = _measured_peak(coordinator, config, device=device, dtype=dtype)
    return MfuInputs(
        flops_per_token=flops.for_mfu,
        counted_flops_per_token=flops.counted,
        datasheet_peak_flops=datasheet_peak_flops(name, dtype),
        measured_peak_flops=measured,
        device_name=name,
        dtype=dtype,
        peak_source=source,
    )


def _measured_peak(coordinator: Coordinator, config: MetricsConfig, *, device: torch.device | str, dtype: str) -> tuple[float, str]:
    """The achievable peak, once per run through the coordinator; the measurement itself goes through
    the per-host cache, so runs on one machine share one figure. Returns (FLOP/s, where it came from)."""
    from raytrain_fast.metrics.peak import PEAK_SAMPLES, cached_matmul_peak, device_key

    figures: list[PeakFigure] = []

    def measure() -> float:
        figures.append(cached_matmul_peak(device=device, dtype=dtype, seconds=config.peak_measure_s))
        return figures[-1].flops

    flops = coordinator.achievable_peak(
        device_key=device_key(device), dtype=dtype, seconds=config.peak_measure_s, measure=measure
    )
    if not figures:  # a restarted worker group, or a resumed run: the coordinator held it
        return flops, "kept from this run's first measurement"
    figure = figures[0]
    if figure.cached:
        return flops, f"cached for this host on {figure.measured_at}; delete {figure.cache_path} to measure again"
    return flops, f"median of {PEAK_SAMPLES} samples over {figure.seconds:g} s, cached in {figure.cache_path}"
