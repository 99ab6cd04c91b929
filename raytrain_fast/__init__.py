"""raytrain_fast: fast, fault-tolerant pretraining of decoder-only language models on Ray.

Entry points: the `raytrain-fast` command (raytrain_fast.cli) and `jobs/pretrain.py`. The public
Python surface is below; everything else is internal.
"""

from raytrain_fast.config import Config, load_config, validate
from raytrain_fast.errors import CheckpointError, ConfigError, DataError, RaytrainFastError, StorageError

__all__ = [
    "CheckpointError",
    "Config",
    "ConfigError",
    "DataError",
    "RaytrainFastError",
    "StorageError",
    "load_config",
    "validate",
]
