"""Storage for runs and data: local paths or S3-compatible buckets, built explicitly from config."""

from raytrain_fast.storage.check import check_storage
from raytrain_fast.storage.config import StorageConfig
from raytrain_fast.storage.credentials import S3Credentials, resolve_credentials
from raytrain_fast.storage.errors import StorageError
from raytrain_fast.storage.filesystem import build_s3_filesystem, is_remote, resolve_filesystem, split_s3_uri
from raytrain_fast.storage.redact import redact

__all__ = [
    "S3Credentials",
    "StorageConfig",
    "StorageError",
    "build_s3_filesystem",
    "check_storage",
    "is_remote",
    "redact",
    "resolve_credentials",
    "resolve_filesystem",
    "split_s3_uri",
]
