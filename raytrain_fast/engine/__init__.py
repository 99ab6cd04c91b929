"""DeepSpeed ZeRO engine built from config."""

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

__all__ = ["EngineConfig", "OptimConfig", "apply_deepspeed_patches", "apply_optim_settings", "build_deepspeed_config", "build_engine", "build_optimizer", "enable_tf32", "lr_lambda",
    "measure_cpu_bf16_speedup", "resolve_precision", "select_accelerator", "training_device"]
