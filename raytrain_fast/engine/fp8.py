"""`engine.precision: fp8`: the blocks' linear layers compute their matmuls in float8 through torchao's
float8 training (`convert_to_float8_training`), with dynamic tensorwise scaling, compiled with the
blocks. Everything else is the bf16 path: DeepSpeed keeps bf16 weights and fp32 master weights, so
checkpoints, export and resumes are bf16's, and evaluation runs the bf16 matmul (a converted layer
in eval mode). Needs FP8 tensor cores (compute capability 8.9+: L4, L40S, H100, H200, B200).

Tensorwise, not rowwise: on one node it is the faster recipe (torchao's Llama 3 8B: +25% tensorwise,
+10% rowwise over bf16; at 1B tensorwise was ahead in OLMo-core's and nanochat's runs); rowwise's
finer scales pay off in accuracy on long runs at scale. The GPU check compares the loss with bf16's.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from raytrain_fast.config.engine import FP8_ON_CPU
from raytrain_fast.errors import ConfigError

FP8_CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada and Hopper)."""
RECIPE = "tensorwise"
TORCHAO = "torchao==0.18.0"
"""The release the package is tested with (torch 2.11 and later): what the error's install command names."""


def fp8_problem(*, use_gpu: bool) -> str | None:
    """Why engine.precision=fp8 cannot train in this process (on its GPU, or its CPUs), or None."""
    if not use_gpu or not torch.cuda.is_available():
        return FP8_ON_CPU
    capability = torch.cuda.get_device_capability()
    if capability < FP8_CAPABILITY:
        return (f"engine.precision=fp8: this GPU ({torch.cuda.get_device_name()}, compute capability "
                f"{capability[0]}.{capability[1]}) has no FP8 tensor cores (they start at 8.9: L4, L40S, H100, H200, B200); "
                "use engine.precision=bf16")
    try:
        _torchao_float8()
    except ImportError as error:
        return f"engine.precision=fp8 needs torchao ({error}): pip install {TORCHAO}"
    return None


def apply_fp8(model: nn.Module, *, precision: str, device: torch.device) -> str | None:
    """With precision fp8: the blocks' linear layers of `model` converted in place (before they are
    compiled and DeepSpeed wraps the model); returns the startup line. Any other precision: nothing."""
    if precision != "fp8":
        return None
    problem = fp8_problem(use_gpu=device.type == "cuda")
    if problem is not None:
        raise ConfigError(problem)
    converted = convert_blocks(model)
    return (f"FP8: {len(converted)} linear layers of {len(model.blocks)} blocks compute in float8 ({RECIPE} scaling); "
            "the LM head, embeddings, norms and attention stay bf16, and so do checkpoints and evaluation.")


def convert_blocks(model: nn.Module, *, recipe: str = RECIPE, emulate: bool = False) -> list[str]:
    """Swap the linear layers inside `model.blocks` that float8 speeds up for float8-training ones,
    in place; returns their names. `emulate`: float8 casts with high-precision matmuls (any device:
    a CPU rehearsal of the path, never training)."""
    ao = _torchao_float8()
    config = ao.Float8LinearConfig.from_recipe_name(recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    ao.convert_to_float8_training(model.blocks, config=config,
                                  module_filter_fn=lambda module, _: isinstance(module, nn.Linear) and float8_speeds_up(module))
    converted = {f"blocks.{name}": module for name, module in model.blocks.named_modules()
                 if isinstance(module, nn.Linear) and type(module) is not nn.Linear}  # torchao's float8 layers
    for module in converted.values():
        # Its forward, given the plain matmul in eval mode: the same state, the same parameter names.
        module.__class__ = _bf16_in_eval(type(module))
    return list(converted)


def float8_speeds_up(linear: nn.Linear) -> bool:
    """Dimensions float8 matmuls take (multiples of 16) and not too small to gain: torchao's measured
    tensorwise rule on an H100 (a layer with in_features <= 4096 and out_features <= 1024 ran slower)."""
    out_features, in_features = linear.weight.shape
    if out_features % 16 or in_features % 16:
        return False
    return not (in_features <= 4096 and out_features <= 1024)


@functools.lru_cache(maxsize=None)
def _bf16_in_eval(float8_linear: type) -> type:
    class TrainingFloat8Linear(float8_linear):
        """Float8 matmuls while training; evaluation (eval mode) runs the plain matmul in the weights' dtype."""

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if not self.training:
                return F.linear(input, self.weight, self.bias)
            return super().forward(input)

    return TrainingFloat8Linear


@functools.lru_cache(maxsize=1)
def _torchao_float8() -> SimpleNamespace:
    """What this module takes from torchao, imported once (seconds: it imports its whole package)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return SimpleNamespace(Float8LinearConfig=Float8LinearConfig, convert_to_float8_training=convert_to_float8_training)
