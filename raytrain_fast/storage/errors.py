"""Kept for imports inside storage/; the type lives in raytrain_fast.errors with its siblings."""

from raytrain_fast.errors import StorageError

__all__ = ["StorageError"]
