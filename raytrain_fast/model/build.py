"""The model of a config: GPT or its Llama-family subclass, built on the device it trains on."""

from __future__ import annotations

import torch

from raytrain_fast.config.model import ModelConfig
from raytrain_fast.model.gpt import GPT
from raytrain_fast.model.llama import Llama


def model_class(config: ModelConfig) -> type[GPT]:
    """The module class of `model.architecture`: GPT or Llama (a GPT subclass)."""
    return Llama if config.architecture == "llama" else GPT


def build_model(config: ModelConfig, device: torch.device | str | None = None) -> GPT:
    """The model of `config.architecture` with its weights created and initialised on `device`
    directly: no fp32 host copy per rank (5.3 GB for a 1.3B model) before moving it. Same init
    distributions as on the CPU (the values differ: each device has its own random stream)."""
    cls = model_class(config)
    if device is None:
        return cls(config)
    with torch.device(device):
        return cls(config)
