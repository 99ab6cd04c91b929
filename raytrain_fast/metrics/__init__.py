"""Metrics of the step loop: on-device accumulators drained every `log_every` steps, throughput and
MFU, phase times, a slowdown detector, GC control, and sinks written from rank 0 off the training thread."""

from raytrain_fast.metrics.config import MetricsConfig, metrics_config_problems
from raytrain_fast.metrics.names import METRICS
from raytrain_fast.metrics.peak import datasheet_peak_flops, device_key, device_name, matmul_dtype, measure_matmul_peak, mfu
from raytrain_fast.metrics.sinks import (
    JsonlSink,
    MetricSink,
    SinkWriter,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    read_metrics,
)
from raytrain_fast.metrics.setup import MfuInputs, mfu_inputs
from raytrain_fast.metrics.slowdown import SlowdownDetector, Window
from raytrain_fast.metrics.train_metrics import TrainMetrics

__all__ = [
    "JsonlSink",
    "METRICS",
    "MetricSink",
    "MetricsConfig",
    "MfuInputs",
    "SinkWriter",
    "SlowdownDetector",
    "TensorBoardSink",
    "TrainMetrics",
    "WandbSink",
    "Window",
    "build_sinks",
    "datasheet_peak_flops",
    "device_key",
    "device_name",
    "matmul_dtype",
    "measure_matmul_peak",
    "metrics_config_problems",
    "mfu",
    "mfu_inputs",
    "read_metrics",
]
