"""DeepSpeed ZeRO engine built from config, and the worker's program around it (program.py)."""

from raytrain_fast.config.engine import EngineConfig, OptimConfig
from raytrain_fast.engine.deepspeed_engine import (
    apply_deepspeed_patches,
    apply_optim_settings,
    build_deepspeed_config,
    build_engine,
    build_optimizer,
    enable_tf32,
    lr_lambda,
    measure_cpu_bf16_speedup,
    resolve_precision,
    select_accelerator,
    training_device,
)
from raytrain_fast.engine.program import WorkerProgram, build_program, one_process, prepare_process

__all__ = ["EngineConfig", "OptimConfig", "WorkerProgram", "apply_deepspeed_patches", "apply_optim_settings", "build_deepspeed_config",
    "build_engine", "build_optimizer", "build_program", "enable_tf32", "lr_lambda", "measure_cpu_bf16_speedup", "one_process",
    "prepare_process", "resolve_precision", "select_accelerator", "training_device"]
