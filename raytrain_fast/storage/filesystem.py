"""pyarrow filesystems built explicitly from config (pyarrow's bare S3FileSystem ignores
AWS_ENDPOINT_URL, so an S3-compatible endpoint must be passed in, never left to the environment)."""

from __future__ import annotations

import os
from urllib.parse import urlparse

import pyarrow.fs as pafs

from raytrain_fast.config.storage import StorageConfig, uri_problem
from raytrain_fast.storage.credentials import S3Credentials, resolve_credentials
from raytrain_fast.errors import StorageError


def check_uri(uri: str, *, setting: str) -> None:
    """Raise StorageError when `uri_problem` finds one."""
    problem = uri_problem(uri, setting=setting)
    if problem:
        raise StorageError(problem)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/a/b -> ("bucket", "a/b")."""
    if not uri.startswith("s3://"):
        raise StorageError(f"'{uri}' is not an s3:// URI")
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    if not bucket:
        raise StorageError(f"storage.uri '{uri}' names no bucket: use s3://<bucket>/<prefix>")
    return bucket, prefix.strip("/")


def describe_endpoint(storage: StorageConfig) -> str:
    """The endpoint in words for messages, without any user:password part of the URL."""
    if not storage.endpoint_url:
        return f"AWS S3 (region {s3_region(storage)})"
    parsed = urlparse(storage.endpoint_url)
    host = parsed.hostname or parsed.path
    port = f":{parsed.port}" if parsed.port else ""
    scheme = f"{parsed.scheme}://" if parsed.scheme else ""
    return f"endpoint {scheme}{host}{port}"


def s3_region(storage: StorageConfig) -> str:
    if storage.region:
        return storage.region
    if storage.profile:
        import botocore.session

        try:
            region = botocore.session.Session(profile=storage.profile).get_config_variable("region")
        except Exception:  # a missing profile is reported where credentials are resolved
            region = None
        if region:
            return region
    return os.environ.get("AWS_DEFAULT_REGION") or os.environ.get("AWS_REGION") or "us-east-1"


CHECKSUM_ENV = ("AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION")
CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 2


def request_checksums(storage: StorageConfig) -> str:
    """storage.request_checksums with `auto` resolved: plain bodies for any custom endpoint."""
    if storage.request_checksums != "auto":
        return storage.request_checksums
    return "when_required" if storage.endpoint_url else "when_supported"


def checksum_env(storage: StorageConfig) -> dict[str, str]:
    """The environment that sets the AWS SDK's checksum mode for `storage` ({} = leave the SDK default).

    pyarrow's S3FileSystem has no checksum option: its AWS SDK reads these variables each time a
    filesystem (and so an S3 client) is built, in this process or, once unpickled, in a Ray worker.
    """
    mode = request_checksums(storage)
    if storage.request_checksums == "auto" and mode == "when_supported":
        return {}  # AWS S3 itself: keep the SDK's default (and whatever the user's environment says)
    return dict.fromkeys(CHECKSUM_ENV, mode)


def build_s3_filesystem(
    storage: StorageConfig,
    *,
    credentials: S3Credentials | None = None,
    fail_fast: bool = False,
    allow_bucket_creation: bool = False,
) -> pafs.S3FileSystem:
    """An S3FileSystem for `storage`.

    Credentials: `credentials` if given, else `resolve_credentials(storage)` (profile, environment,
    default chain). Fixed keys are passed to pyarrow (and so travel, pickled, with the filesystem
    to Ray workers); role-based temporary ones are left to pyarrow's own default chain, which
    refreshes them. Timeouts and attempts: pyarrow's defaults, or with `fail_fast` the short ones
    the storage checks use to fail in seconds (CONNECT_TIMEOUT_S, REQUEST_TIMEOUT_S, MAX_ATTEMPTS).
    """
    kwargs: dict = {
        "region": s3_region(storage),
        "force_virtual_addressing": not storage.path_style,
        "allow_bucket_creation": allow_bucket_creation,
    }
    if storage.endpoint_url:
        endpoint = urlparse(storage.endpoint_url)
        kwargs["endpoint_override"] = endpoint.netloc.rpartition("@")[2] or endpoint.path
        kwargs["scheme"] = endpoint.scheme or "https"
    if credentials is None:
        credentials = resolve_credentials(storage)
    os.environ.update(checksum_env(storage))  # read by the AWS SDK when the filesystem below is built
    if credentials is not None and not credentials.refreshable:
        kwargs["access_key"], kwargs["secret_key"] = credentials.access_key, credentials.secret_key
        if credentials.session_token:
            kwargs["session_token"] = credentials.session_token
    if fail_fast:
        kwargs["connect_timeout"] = CONNECT_TIMEOUT_S
        kwargs["request_timeout"] = REQUEST_TIMEOUT_S
        kwargs["retry_strategy"] = pafs.AwsStandardS3RetryStrategy(max_attempts=MAX_ATTEMPTS)
    return pafs.S3FileSystem(**kwargs)


_SHIPPED: dict[tuple, pafs.FileSystem] = {}


def _endpoint_key(storage: StorageConfig) -> tuple:
    return (storage.endpoint_url, storage.region, storage.path_style, storage.profile)


def use_shipped_s3_filesystem(storage: StorageConfig, filesystem: pafs.FileSystem) -> None:
    """In a worker: use the S3 filesystem the driver built (it carries the driver's credentials,
    pickled as Ray's own storage filesystem is) for every s3:// URI of this storage endpoint.

    Workers need not see the credential environment variables themselves: a Ray instance started
    before they were exported, or a cluster whose workers lack them, still reaches the bucket.
    """
    _SHIPPED[_endpoint_key(storage)] = filesystem


def uri_of(path: str, *, like: str) -> str:
    """A path inside the filesystem of URI `like` (resolve_filesystem's second value, or below it) as
    the user names it: s3://bucket/... on S3, the path itself on local disk."""
    return f"s3://{path}" if like.startswith("s3://") and not path.startswith("s3://") else path


def resolve_filesystem(uri: str, storage: StorageConfig) -> tuple[pafs.FileSystem, str]:
    """(filesystem, path inside it) for a local path or an s3:// URI. The path has no scheme."""
    if uri.startswith("s3://"):
        shipped = _SHIPPED.get(_endpoint_key(storage))
        return shipped or build_s3_filesystem(storage), uri[len("s3://"):].rstrip("/")
    check_uri(uri, setting="storage URI")
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
