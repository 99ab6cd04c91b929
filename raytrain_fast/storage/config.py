from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class StorageConfig:
    """Where runs (checkpoints, metrics) are stored."""

    uri: str = "./runs"
    """A local directory (made absolute) or a URI understood by pyarrow (e.g. s3://bucket/prefix)."""
