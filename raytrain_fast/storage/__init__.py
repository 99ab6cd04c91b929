"""Storage for runs and data: local paths or S3-compatible buckets, built explicitly from config."""

from raytrain_fast.storage.check import check_storage, check_storage_readable, store_corruption_hint
from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.errors import StorageError
from raytrain_fast.storage.filesystem import check_uri, resolve_filesystem, uri_of
from raytrain_fast.storage.redact import redact, redact_text
