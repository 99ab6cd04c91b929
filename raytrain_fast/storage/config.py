from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(kw_only=True)
class StorageConfig:
    """Where runs (checkpoints, metrics) and prepared data live. Credentials never go here: they
    come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) or a named profile."""

    uri: str = "./runs"
    """A local directory (made absolute), file:///path or s3://bucket/prefix. Other schemes are refused."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (MinIO, Ceph, R2, ...), e.g. http://127.0.0.1:9000. null = AWS S3."""
    region: str | None = None
    """S3 region; null = the profile's region, else AWS_DEFAULT_REGION / AWS_REGION, else us-east-1."""
    path_style: bool = True
    """Path-style addressing (endpoint/bucket/key), which MinIO and most S3-compatible services need."""
    profile: str | None = None
    """Named AWS profile (~/.aws/credentials or ~/.aws/config) to take credentials from. null = the
    environment variables, then the default AWS chain (shared files, instance or container role)."""
    request_checksums: Literal["auto", "when_supported", "when_required"] = "auto"
    """S3 upload checksums. when_supported: the AWS SDK default, uploads sent aws-chunked with a trailing
    CRC, which some S3-compatible stores save as part of the object; when_required: plain request
    bodies, which every store reads. auto = when_required with storage.endpoint_url, else when_supported."""
