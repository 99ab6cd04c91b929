"""DeepSpeed ZeRO engine built from config (deepspeed_engine.py), and the worker's program around it (program.py)."""

from raytrain_fast.config.engine import EngineConfig, OptimConfig
from raytrain_fast.engine.deepspeed_engine import (
    apply_optim_settings,
    build_deepspeed_config,
    build_engine,
    build_optimizer,
    lr_lambda,
    resolve_precision,
    select_accelerator,
    training_device,
)
