"""Prove, before any worker starts, that the run's storage is reachable and writable.

For s3:// a marker object is written under the prefix, read back, compared byte for byte and
deleted again, with short timeouts and few retries, so a wrong endpoint, a missing bucket or missing credentials fail in seconds with a
message that names the endpoint, the bucket and the fix (instead of a worker failing minutes later
at its first checkpoint). The read-back catches a store that saves uploads altered (the AWS SDK's
aws-chunked framing kept in the object), which would otherwise surface later as a corrupt manifest.
Local paths are created and test-written the same way. Every probe has a deadline and Ctrl-C ends it.
"""

from __future__ import annotations

import functools
import os
import re
import uuid

import pyarrow.fs as pafs

from raytrain_fast.config.storage import StorageConfig
from raytrain_fast.storage.credentials import S3Credentials, missing_credentials_message, resolve_credentials
from raytrain_fast.errors import StorageError
from raytrain_fast.storage.filesystem import (
    build_s3_filesystem,
    check_uri,
    describe_endpoint,
    request_checksums,
    resolve_filesystem,
    split_s3_uri,
)
from raytrain_fast.storage.probe import call_with_timeout

MARKER_PREFIX = ".raytrain-fast-write-check-"
READ_PROBE_TIMEOUT_S = 10.0
"""runs / export / report: one listing call, so a silent endpoint is reported after 10 s, not after
every attempt's request timeout."""


def check_storage(storage: StorageConfig, *, create_bucket: bool = False) -> None:
    """Raise StorageError unless `storage.uri` can be written (and the marker deleted).

    create_bucket: create a missing S3 bucket instead of failing (the CLI's --create-bucket).
    """
    uri = storage.uri
    check_uri(uri, setting="storage.uri")
    if uri.startswith("s3://"):
        call_with_timeout(
            lambda: _check_s3(storage, create_bucket=create_bucket), what=f"write to {uri} at {describe_endpoint(storage)}",
            fix="Check storage.endpoint_url and that the service answers from this machine.",
        )
    else:
        call_with_timeout(lambda: _check_local(uri), what=f"write to {uri}", fix="Is it a stalled network mount?")


def check_storage_readable(uri: str, storage: StorageConfig, *, setting: str = "--storage") -> None:
    """Raise StorageError unless `uri` exists and can be listed, within the probe deadline.

    For the commands that only read (runs, export, report): a missing location is an error that
    names it, never an empty listing.
    """
    check_uri(uri, setting=setting)
    endpoint = describe_endpoint(storage) if uri.startswith("s3://") else "on this machine"

    def probe() -> pafs.FileType:
        if uri.startswith("s3://"):
            bucket, prefix = split_s3_uri(uri)
            filesystem = build_s3_filesystem(storage, fail_fast=True)
            return filesystem.get_file_info(f"{bucket}/{prefix}".rstrip("/")).type
        filesystem, path = resolve_filesystem(uri, storage)
        return filesystem.get_file_info(path).type

    fix = "Check storage.endpoint_url (--endpoint-url) and that the service answers from this machine."
    try:
        kind = call_with_timeout(probe, timeout_s=READ_PROBE_TIMEOUT_S, what=f"read {uri} ({endpoint})", fix=fix)
    except OSError as error:
        raise StorageError(f"Cannot read {uri} ({endpoint}): {_short(str(error))}. {fix}") from None
    if kind == pafs.FileType.NotFound:
        where = f"at {endpoint}" if uri.startswith("s3://") else endpoint
        raise StorageError(
            f"{setting} '{uri}' does not exist {where}. Check the path (a run directory or the storage.uri "
            "the runs were trained with, e.g. ./runs)."
        )


def _marker_bytes() -> bytes:
    # Long enough for a multi-line body, so a store that keeps upload framing changes it visibly.
    return b"raytrain-fast storage check\n" + uuid.uuid4().hex.encode() * 4 + b"\n"


def _check_local(uri: str) -> None:
    path = os.path.abspath(os.path.expanduser(uri[len("file://"):] if uri.startswith("file://") else uri))
    try:
        os.makedirs(path, exist_ok=True)
        marker = os.path.join(path, MARKER_PREFIX + uuid.uuid4().hex)
        written = _marker_bytes()
        with open(marker, "wb") as handle:
            handle.write(written)
        with open(marker, "rb") as handle:
            read = handle.read()
        os.remove(marker)
    except OSError as error:
        raise StorageError(
            f"storage.uri '{uri}' (local directory {path}) is not writable: {error.strerror or error}. "
            "Choose another directory with --set storage.uri=<dir> or fix its permissions."
        ) from None
    if read != written:
        raise StorageError(f"storage.uri '{uri}' (local directory {path}) returned other bytes than were written to it.")


def _check_s3(storage: StorageConfig, *, create_bucket: bool) -> None:
    bucket, prefix = split_s3_uri(storage.uri)
    endpoint = describe_endpoint(storage)
    credentials = resolve_credentials(storage)
    if credentials is None:
        raise StorageError(missing_credentials_message(endpoint=endpoint, bucket=bucket))
    filesystem = build_s3_filesystem(
        storage, credentials=credentials, fail_fast=True, allow_bucket_creation=create_bucket
    )
    where = f"s3://{bucket}/{prefix}".rstrip("/")
    explain = functools.partial(
        _explain_s3_error, storage=storage, bucket=bucket, where=where, endpoint=endpoint, credentials=credentials
    )
    for created in (False, True):  # a second round once --create-bucket made the bucket
        try:
            written, read = _write_and_delete_marker(filesystem, f"{bucket}/{prefix}".rstrip("/"))
            break
        except OSError as error:
            if "NO_SUCH_BUCKET" not in str(error):
                raise explain(error, creating=False) from None
            if created:
                raise StorageError(f"Bucket '{bucket}' was created at {endpoint} but is still not visible; try again.") from None
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
    if read != written:
        raise StorageError(altered_upload_message(storage, where=where, endpoint=endpoint, written=written, read=read))


def _write_and_delete_marker(filesystem: pafs.FileSystem, directory: str) -> tuple[bytes, bytes]:
    """Write a marker, read it back, delete it: (bytes written, bytes read)."""
    marker = f"{directory}/{MARKER_PREFIX}{uuid.uuid4().hex}"
    written = _marker_bytes()
    with filesystem.open_output_stream(marker) as stream:
        stream.write(written)
    with filesystem.open_input_stream(marker) as stream:
        read = stream.read()
    filesystem.delete_file(marker)
    return written, read


def looks_like_aws_chunked(data: bytes) -> bool:
    """Whether `data` starts with aws-chunked framing (`<hex size>[;chunk-signature=...]\\r\\n`) or
    holds its trailing checksum line: an upload stored by a service that did not decode it."""
    head = data[:200]
    return re.match(rb"^[0-9a-fA-F]{1,16}(;chunk-signature=[0-9a-f]+)?\r\n", head) is not None or b"x-amz-checksum-" in data[-300:]


def altered_upload_message(storage: StorageConfig, *, where: str, endpoint: str, written: bytes, read: bytes) -> str:
    """The start-up check's error when the store returned other bytes than were uploaded."""
    mode = request_checksums(storage)
    seen = f"wrote {len(written)} bytes to {where} at {endpoint} and read back {len(read)} other bytes ({read[:40]!r}...)"
    if looks_like_aws_chunked(read) and mode != "when_required":
        return (
            f"Storage check: {seen}. The store kept the AWS SDK's aws-chunked upload framing in the object "
            f"(storage.request_checksums={mode}), so every file it stores would be corrupt. Set "
            "storage.request_checksums=when_required (e.g. --set storage.request_checksums=when_required) to send "
            "plain request bodies."
        )
    return (
        f"Storage check: {seen} (storage.request_checksums={mode}). The store alters uploads: check the "
        "service at storage.endpoint_url (a proxy or gateway that rewrites bodies?) before training on it."
    )


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
    detail = str(error)
    for secret in credentials.secrets():
        detail = detail.replace(secret, "***")
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


def store_corruption_hint(raw: bytes) -> str:
    """Advice for a stored JSON file that does not parse: the store may have altered it on upload."""
    framing = " (it starts with aws-chunked upload framing)" if looks_like_aws_chunked(raw) else ""
    return (
        f"It may have been corrupted by the store{framing}: on an S3-compatible store set "
        "storage.request_checksums=when_required (`raytrain-fast pretrain` checks this at start), then write it again"
    )
