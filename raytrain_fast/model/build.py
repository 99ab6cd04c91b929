"""The model of a config: GPT or its Llama-family subclass, built on the device it trains on."""

from __future__ import annotations

import torch

from raytrain_fast.config.model import ModelConfig
from raytrain_fast.errors import ConfigError
from raytrain_fast.model.documents import DocumentMasking, flex_attention_available
from raytrain_fast.model.gpt import GPT
from raytrain_fast.model.llama import Llama


def model_class(config: ModelConfig) -> type[GPT]:
    """The module class of `model.architecture`: GPT or Llama (a GPT subclass)."""
    return Llama if config.architecture == "llama" else GPT


def build_model(config: ModelConfig, device: torch.device | str | None = None, *, documents: DocumentMasking | None = None) -> GPT:
    """The model of `config.architecture` with its weights created and initialised on `device`
    directly: no fp32 host copy per rank (5.3 GB for a 1.3B model) before moving it. Same init
    distributions as on the CPU (the values differ: each device has its own random stream).
    `documents`: document masking (model/documents.py `document_masking`), or None."""
    cls = model_class(config)
    if documents is not None and device is not None:
        _check_document_masking(config, torch.device(device))
    if device is None:
        return cls(config, documents)
    with torch.device(device):
        return cls(config, documents)


def _check_document_masking(config: ModelConfig, device: torch.device) -> None:
    """What the driver checks too (config/data.py `document_masking_problems`), for a model built on
    a GPU the driver could not see, and the torch version, which only the worker's process knows."""
    if device.type != "cuda":
        return
    if not flex_attention_available():
        raise ConfigError(
            f"data.document_masking on a GPU uses flex attention, which torch {torch.__version__} lacks; "
            "install torch >= 2.5 or set data.document_masking=false"
        )
    if config.dropout > 0:
        raise ConfigError(
            f"data.document_masking on a GPU uses flex attention, which has no dropout, but model.dropout is {config.dropout}; "
            "set model.dropout=0 (pretraining's usual value) or data.document_masking=false"
        )
