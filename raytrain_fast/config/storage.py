from __future__ import annotations

import re
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
    shared: bool = False
    """A local uri (and a local data.cache_dir) is on a filesystem every node of the Ray cluster
    mounts at the same path (NFS, Lustre, ...). Without it, a local uri on a cluster of more than
    one node is refused before workers start: each node would hold only its own ranks' files."""
    request_checksums: Literal["auto", "when_supported", "when_required"] = "auto"
    """S3 upload checksums. when_supported: the AWS SDK default, uploads sent aws-chunked with a trailing
    CRC, which some S3-compatible stores save as part of the object; when_required: plain request
    bodies, which every store reads. auto = when_required with storage.endpoint_url, else when_supported."""


SUPPORTED_URIS = "a local directory, file:///absolute/path or s3://bucket/prefix"
# A scheme of two or more letters followed by ':' (one letter is a Windows drive, C:\\...).
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):")


def uri_problem(uri: str, *, setting: str) -> str | None:
    """Why `uri` is not a storage location raytrain-fast can use, or None.

    Only local paths, file:// and s3:// are accepted: pyarrow's other filesystems (gs://, hdfs://)
    have no timeouts or need a JVM, and a typo such as `s3:/bucket` would otherwise become a
    local folder named `s3:`.
    """
    match = _SCHEME.match(uri)
    if match is None:
        return None
    scheme = match.group(1).lower()
    if scheme in ("s3", "file") and uri[len(scheme) + 1:].startswith("//"):
        if scheme == "s3" and not uri[len("s3://"):].split("/", 1)[0]:
            return f"{setting} '{uri}' names no bucket: use s3://<bucket>/<prefix>"
        return None
    if scheme in ("s3", "file"):
        return f"{setting} '{uri}' is not a valid URI (missing '//'?): use {scheme}://..., or {SUPPORTED_URIS}"
    hint = (" For Google Cloud Storage use its S3-compatible API: s3://bucket/prefix with "
            "storage.endpoint_url=https://storage.googleapis.com and HMAC keys.") if scheme in ("gs", "gcs") else ""
    return f"{setting} '{uri}': scheme '{scheme}://' is not supported; use {SUPPORTED_URIS}.{hint}"


def is_local_uri(uri: str) -> bool:
    """A plain path or file://: storage that lives on one machine unless it is a shared mount."""
    return "://" not in uri or uri.lower().startswith("file://")


def multi_node_storage_problems(storage: StorageConfig, *, cache_dir: str | None, nodes: int) -> list[str]:
    """Why local storage cannot serve a Ray cluster of `nodes` nodes (empty when it can).

    A checkpoint is the merge of every rank's files; on a node-local directory each node keeps only
    its own ranks' shards, so no node has a complete checkpoint and resume finds none. The same goes
    for data prepared into a node-local cache_dir, which the other nodes' workers cannot read."""
    if nodes <= 1 or storage.shared:
        return []
    fix = (
        "use S3-compatible storage (s3://bucket/prefix, with storage.endpoint_url for MinIO and the like), or, if the "
        "path is a filesystem every node mounts at the same place (NFS, Lustre), declare it with --set storage.shared=true"
    )
    problems = []
    if is_local_uri(storage.uri):
        problems.append(
            f"storage.uri '{storage.uri}' is a local directory, but the Ray cluster has {nodes} nodes: each node would "
            f"keep only its own workers' checkpoint files; {fix}"
        )
    if cache_dir is not None and is_local_uri(cache_dir):
        problems.append(
            f"data.cache_dir '{cache_dir}' is a local directory, but the Ray cluster has {nodes} nodes: the other nodes' "
            f"workers could not read the prepared data; {fix}"
        )
    return problems
