"""raytrain_fast: fast, fault-tolerant pretraining of decoder-only language models on Ray.

The public surface is this package's `__all__`, documented in docs/api.md: what the `raytrain-fast`
command does, as Python. Every name is imported on first use, so `import raytrain_fast` costs no
torch. Everything else (the subpackages and their modules) is internal and may change without notice.
"""

from __future__ import annotations

from raytrain_fast._lazy import lazy_exports

_DRILLS = ("CpuBurn", "FailOnce", "Hang", "HoldMemory", "Nonfinite", "RecordSequences", "SlowData", "SlowSink",
           "SlowStep", "SlowUpload", "Spike")
_EXPORTS = {
    # configuration
    "Config": "raytrain_fast.config.root",
    "load_config": "raytrain_fast.config.root",
    "validate": "raytrain_fast.config.validate",
    "StorageConfig": "raytrain_fast.config.storage",
    # training, sweeps, drills
    "pretrain": "raytrain_fast.launch.trainer:run",
    "RunResult": "raytrain_fast.launch.trainer",
    "run_sweep": "raytrain_fast.sweep.runner",
    "SweepSpec": "raytrain_fast.sweep.runner",
    "LoopHooks": "raytrain_fast.loop.hooks",
    "StepHooks": "raytrain_fast.loop.hooks",
    "parse_drills": "raytrain_fast.drills.specs",
    **dict.fromkeys(_DRILLS, "raytrain_fast.drills.kinds"),
    # data
    "prepare_data": "raytrain_fast.data.prepare",
    "train_tokenizer": "raytrain_fast.data.train_tokenizer",
    # checkpoints and exports
    "list_runs": "raytrain_fast.checkpoint.runs",
    "format_runs_table": "raytrain_fast.checkpoint.runs",
    "export_checkpoint": "raytrain_fast.checkpoint.export",
    "load_exported": "raytrain_fast.checkpoint.export",
    # metrics and the run report
    "read_metrics": "raytrain_fast.metrics.metric_files",
    "make_report": "raytrain_fast.report",
    # errors
    "RaytrainFastError": "raytrain_fast.errors",
    "ConfigError": "raytrain_fast.errors",
    "DataError": "raytrain_fast.errors",
    "CheckpointError": "raytrain_fast.errors",
    "StorageError": "raytrain_fast.errors",
    "DivergenceError": "raytrain_fast.errors",
    "HungRun": "raytrain_fast.launch.trainer",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
