"""raytrain_fast: fast, fault-tolerant pretraining of decoder-only language models on Ray.

Entry points: the `raytrain-fast` command (raytrain_fast.cli) and `jobs/pretrain.py`. The public
Python surface is below (imported on first use, so light modules such as the coordinator actor
never pay for importing torch); everything else is internal.
"""

from __future__ import annotations

from raytrain_fast._lazy import lazy_exports

_EXPORTS = {
    "Config": "raytrain_fast.config",
    "load_config": "raytrain_fast.config",
    "validate": "raytrain_fast.config",
    "CheckpointError": "raytrain_fast.errors",
    "ConfigError": "raytrain_fast.errors",
    "DataError": "raytrain_fast.errors",
    "RaytrainFastError": "raytrain_fast.errors",
    "StorageError": "raytrain_fast.errors",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
