"""Storage for runs and data: local paths or S3-compatible buckets, built explicitly from config."""

from raytrain_fast.storage.config import StorageConfig
from raytrain_fast.storage.filesystem import build_s3_filesystem, is_remote, resolve_filesystem

__all__ = ["StorageConfig", "build_s3_filesystem", "is_remote", "resolve_filesystem"]
