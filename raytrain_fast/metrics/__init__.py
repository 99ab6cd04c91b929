"""Metrics of the step loop: on-device accumulators drained every `log_every` steps, throughput and
MFU, phase times, a slowdown detector, GC control, and sinks written from rank 0 off the training thread.

Names are imported on first use, so the report (which replays the slowdown detector) and the config
never pay for importing torch.
"""

from __future__ import annotations

from raytrain_fast._lazy import lazy_exports

_EXPORTS = {
    "MetricsConfig": "raytrain_fast.config.metrics",
    "datasheet_peak_flops": "raytrain_fast.metrics.peak",
    "device_key": "raytrain_fast.metrics.peak",
    "device_name": "raytrain_fast.metrics.peak",
    "measure_matmul_peak": "raytrain_fast.metrics.peak",
    "mfu": "raytrain_fast.metrics.peak",
    "JsonlSink": "raytrain_fast.metrics.sinks",
    "SinkWriter": "raytrain_fast.metrics.sinks",
    "TensorBoardSink": "raytrain_fast.metrics.sinks",
    "WandbSink": "raytrain_fast.metrics.sinks",
    "build_sinks": "raytrain_fast.metrics.sinks",
    "read_metrics": "raytrain_fast.metrics.sinks",
    "mfu_inputs": "raytrain_fast.metrics.setup",
    "SlowdownDetector": "raytrain_fast.metrics.slowdown",
    "Window": "raytrain_fast.metrics.slowdown",
    "StepPlan": "raytrain_fast.metrics.train_metrics",
    "TrainMetrics": "raytrain_fast.metrics.train_metrics",
}

__getattr__ = lazy_exports(__name__, _EXPORTS)
