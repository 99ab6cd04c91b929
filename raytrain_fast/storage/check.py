"""Prove, before any worker starts, that the run's storage is reachable and writable.

For s3:// a marker object is written under the prefix and deleted again, with short timeouts and
few retries, so a wrong endpoint, a missing bucket or missing credentials fail in seconds with a
message that names the endpoint, the bucket and the fix (instead of a worker failing minutes later
at its first checkpoint). Local paths are created and test-written.
"""

from __future__ import annotations

import os
import uuid

import pyarrow.fs as pafs

from raytrain_fast.storage.config import StorageConfig
from raytrain_fast.storage.credentials import S3Credentials, missing_credentials_message, resolve_credentials
from raytrain_fast.storage.errors import StorageError
from raytrain_fast.storage.filesystem import build_s3_filesystem, describe_endpoint, is_remote, split_s3_uri

MARKER_PREFIX = ".raytrain-fast-write-check-"
CONNECT_TIMEOUT_S = 2.0
REQUEST_TIMEOUT_S = 5.0
MAX_ATTEMPTS = 2


def check_storage(storage: StorageConfig, *, create_bucket: bool = False) -> None:
    """Raise StorageError unless `storage.uri` can be written (and the marker deleted).

    create_bucket: create a missing S3 bucket instead of failing (the CLI's --create-bucket).
    """
    uri = storage.uri
    if uri.startswith("s3://"):
        _check_s3(storage, create_bucket=create_bucket)
    elif is_remote(uri):
        try:
            filesystem, path = pafs.FileSystem.from_uri(uri)
        except (OSError, ValueError) as error:
            raise StorageError(f"storage.uri '{uri}' cannot be opened: {error}") from None
        _write_and_delete_marker(filesystem, path, on_error=lambda e: StorageError(f"cannot write to {uri}: {e}"))
    else:
        _check_local(uri)


def _check_local(uri: str) -> None:
    path = os.path.abspath(os.path.expanduser(uri[len("file://"):] if uri.startswith("file://") else uri))
    try:
        os.makedirs(path, exist_ok=True)
        marker = os.path.join(path, MARKER_PREFIX + uuid.uuid4().hex)
        with open(marker, "wb") as handle:
            handle.write(b"ok")
        os.remove(marker)
    except OSError as error:
        raise StorageError(
            f"storage.uri '{uri}' (local directory {path}) is not writable: {error.strerror or error}. "
            "Choose another directory with --set storage.uri=<dir> or fix its permissions."
        ) from None


def _check_s3(storage: StorageConfig, *, create_bucket: bool) -> None:
    bucket, prefix = split_s3_uri(storage.uri)
    endpoint = describe_endpoint(storage)
    credentials = resolve_credentials(storage)
    if credentials is None:
        raise StorageError(missing_credentials_message(endpoint=endpoint, bucket=bucket))
    filesystem = build_s3_filesystem(
        storage, credentials=credentials, connect_timeout_s=CONNECT_TIMEOUT_S, request_timeout_s=REQUEST_TIMEOUT_S,
        max_attempts=MAX_ATTEMPTS, allow_bucket_creation=create_bucket,
    )
    where = f"s3://{bucket}/{prefix}".rstrip("/")

    def explain(error: OSError, *, creating: bool = False) -> StorageError:
        return _explain_s3_error(
            error, storage=storage, bucket=bucket, where=where, endpoint=endpoint, credentials=credentials, creating=creating
        )

    try:
        _write_and_delete_marker(filesystem, f"{bucket}/{prefix}".rstrip("/"), on_error=explain)
    except _MissingBucket:
        if not create_bucket:
            raise StorageError(
                f"Bucket '{bucket}' does not exist at {endpoint}. Create it (e.g. `aws s3 mb s3://{bucket}`"
                f"{' --endpoint-url ' + storage.endpoint_url if storage.endpoint_url else ''}), or run again "
                "with --create-bucket to have raytrain-fast create it."
            ) from None
        try:
            filesystem.create_dir(bucket)
        except OSError as error:
            raise explain(error, creating=True) from None
        try:
            _write_and_delete_marker(filesystem, f"{bucket}/{prefix}".rstrip("/"), on_error=explain)
        except _MissingBucket:
            raise StorageError(f"Bucket '{bucket}' was created at {endpoint} but is still not visible; try again.") from None


class _MissingBucket(Exception):
    pass


def _write_and_delete_marker(filesystem: pafs.FileSystem, directory: str, *, on_error) -> None:
    marker = f"{directory}/{MARKER_PREFIX}{uuid.uuid4().hex}"
    try:
        with filesystem.open_output_stream(marker) as stream:
            stream.write(b"ok")
        filesystem.delete_file(marker)
    except OSError as error:
        if "NO_SUCH_BUCKET" in str(error):
            raise _MissingBucket() from None
        raise on_error(error) from None


def _scrub(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


def _explain_s3_error(
    error: OSError,
    *,
    storage: StorageConfig,
    bucket: str,
    where: str,
    endpoint: str,
    credentials: S3Credentials,
    creating: bool,
) -> StorageError:
    detail = _scrub(str(error), credentials.secrets())
    action = f"create bucket '{bucket}'" if creating else f"write to {where}"
    if any(token in detail for token in ("NETWORK_CONNECTION", "curlCode", "Could not connect", "Couldn't resolve", "timed out", "Timeout")):
        return StorageError(
            f"Cannot reach {endpoint} to {action}: {_short(detail)}. Check storage.endpoint_url (scheme, "
            "host and port, e.g. http://127.0.0.1:9000 for a local MinIO) and that the service is running and "
            "reachable from this machine and from every Ray node."
        )
    if any(token in detail for token in ("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId", "SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch")):
        return StorageError(
            f"{endpoint} rejected the credentials from {credentials.source} (access key "
            f"{credentials.masked_access_key()}) for bucket '{bucket}': the access key is unknown there or the "
            f"secret key does not match it. Fix AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
            f"{' or the profile' if storage.profile else ''}, and check storage.endpoint_url points at the service "
            "that issued them."
        )
    if any(token in detail for token in ("EXPIRED_TOKEN", "ExpiredToken", "TokenRefreshRequired")):
        return StorageError(
            f"The credentials from {credentials.source} have expired (bucket '{bucket}' at {endpoint}): refresh them "
            "(e.g. `aws sso login`, or new AWS_SESSION_TOKEN)."
        )
    if any(token in detail for token in ("ACCESS_DENIED", "AccessDenied", "response code: 403")):
        needed = "s3:CreateBucket" if creating else "s3:PutObject, s3:GetObject, s3:DeleteObject and s3:ListBucket"
        return StorageError(
            f"Access denied: the credentials from {credentials.source} (access key {credentials.masked_access_key()}) "
            f"may not {action} at {endpoint}. Grant {needed} on bucket '{bucket}' (and its prefix), or use "
            "credentials that have them."
        )
    if any(token in detail for token in ("PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraint", "response code: 301")):
        return StorageError(
            f"Cannot {action} at {endpoint}: {_short(detail)}. The bucket may be in another region: set storage.region."
        )
    if "RESOURCE_NOT_FOUND" in detail:
        return StorageError(
            f"Cannot {action} at {endpoint}: it answered 'not found' without an S3 error ({_short(detail)}). "
            "Check that storage.endpoint_url is the S3 API endpoint of the service (for MinIO the API port, "
            "not the console port)."
        )
    return StorageError(f"Cannot {action} at {endpoint}: {_short(detail)}")


def _short(detail: str, limit: int = 300) -> str:
    # pyarrow's message starts with the object key (our random marker name): keep the AWS part.
    detail = " ".join(detail.split())
    detail = detail[detail.index("AWS Error"):] if "AWS Error" in detail else detail
    return detail if len(detail) <= limit else detail[:limit] + "..."
