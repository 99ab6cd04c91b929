"""Corpora, tokenization, packing (`prepare`) and the Ray Data ingest path (`ingest`).

Names are imported on first use, so `prepare-data` never pays for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DataConfig": "raytrain_fast.data.config",
    "BYTE_VOCAB_SIZE": "raytrain_fast.data.corpus",
    "EOD_TOKEN": "raytrain_fast.data.corpus",
    "stdlib_files": "raytrain_fast.data.corpus",
    "Manifest": "raytrain_fast.data.manifest",
    "prepare_data": "raytrain_fast.data.prepare",
    "ensure_prepared_corpus": "raytrain_fast.data.cache",
    "BatchIterator": "raytrain_fast.data.ingest",
    "DataPosition": "raytrain_fast.data.ingest",
    "check_manifest_matches": "raytrain_fast.data.ingest",
    "load_manifest": "raytrain_fast.data.ingest",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raytrain_fast.data' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
