"""Storage for runs and data: local paths or S3-compatible buckets, built explicitly from config."""

from raytrain_fast.storage.check import check_storage, check_storage_readable, store_corruption_hint
from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.storage.credentials import S3Credentials, resolve_credentials
from raytrain_fast.errors import StorageError
from raytrain_fast.storage.filesystem import (
    build_s3_filesystem,
    check_uri,
    resolve_filesystem,
    uri_of,
    split_s3_uri,
    uri_problem,
)
from raytrain_fast.storage.redact import redact, redact_text

__all__ = [
    "S3Credentials",
    "StorageConfig",
    "StorageError",
    "build_s3_filesystem",
    "check_storage",
    "check_storage_readable",
    "check_uri",
    "redact",
    "redact_text",
    "resolve_credentials",
    "resolve_filesystem",
    "uri_of",
    "split_s3_uri",
    "store_corruption_hint",
    "uri_problem",
]
