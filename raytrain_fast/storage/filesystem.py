"""pyarrow filesystems built explicitly from config (pyarrow's bare S3FileSystem ignores
AWS_ENDPOINT_URL, so an S3-compatible endpoint must be passed in, never left to the environment)."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raytrain_fast.storage.config import StorageConfig


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def build_s3_filesystem(storage: StorageConfig) -> pafs.S3FileSystem:
    """An S3FileSystem for `storage`; credentials from the environment only."""
    kwargs: dict = {
        "region": storage.region or os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1",
        "force_virtual_addressing": not storage.path_style,
    }
    if storage.endpoint_url:
        endpoint = urlparse(storage.endpoint_url)
        kwargs["endpoint_override"] = endpoint.netloc or endpoint.path
        kwargs["scheme"] = endpoint.scheme or "https"
    access_key, secret_key = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if access_key and secret_key:
        kwargs["access_key"], kwargs["secret_key"] = access_key, secret_key
        if os.environ.get("AWS_SESSION_TOKEN"):
            kwargs["session_token"] = os.environ["AWS_SESSION_TOKEN"]
    return pafs.S3FileSystem(**kwargs)


def resolve_filesystem(uri: str, storage: StorageConfig) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or an s3:// URI. The path has no scheme."""
    if uri.startswith("s3://"):
        return build_s3_filesystem(storage), uri[len("s3://"):].rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if is_remote(uri):
        filesystem, path = pafs.FileSystem.from_uri(uri)
        return filesystem, path
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
