"""The inputs of `prepare_data` and `train_tokenizer`: listing files, directories, globs and s3:// URIs,
and listing what cannot be used with the reason.

What a file holds is read by `data/readers.py`; this module finds the files.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from collections import Counter
from dataclasses import dataclass, field

import pyarrow.fs as pafs

from raytrain_fast.data.manifest import MANIFEST_NAME, Skipped
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

NODE_ID_LABEL = "ray.io/node-id"
"""Every Ray node carries its id under this label: tasks pinned to it read next to their caller."""
_GLOB_CHARS = "*?["


@dataclass
class Source:
    uri: str
    """Canonical name: absolute local path or s3://bucket/key."""
    location: str
    """`local` or `s3`: which filesystem reads it."""
    path: str
    """Path inside that filesystem."""
    size: int
    mtime_ns: int | None
    val_fraction: float = 0.0
    """Share of this file's documents that go to the validation split (1.0: a --val-input file)."""


@dataclass
class Listing:
    sources: list[Source] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


def canonical_input(item: str) -> str:
    """An input as the recipe records it: s3:// URIs as given (no trailing slash), local paths absolute."""
    if item.startswith("s3://"):
        return item.rstrip("/")
    if item.startswith("file://"):
        item = item[len("file://"):]
    return os.path.abspath(os.path.expanduser(item))


def _is_hidden(name: str) -> bool:
    return name.startswith(".")


def _walk_local(root: str, listing: Listing, exclude: str | None) -> int:
    """Every non-hidden file under `root`, sorted; hidden entries are reported, not read."""
    found = 0
    for directory, dirs, files in os.walk(root):
        dirs.sort()
        for name in [d for d in dirs if _is_hidden(d)]:
            listing.skipped.append(Skipped(path=os.path.join(directory, name), reason="hidden directory (not read)"))
        dirs[:] = [d for d in dirs if not _is_hidden(d) and os.path.join(directory, d) != exclude]
        for name in sorted(files):
            path = os.path.join(directory, name)
            if _is_hidden(name):
                listing.skipped.append(Skipped(path=path, reason="hidden file (not read)"))
                continue
            _add_local_file(path, listing)
            found += 1
    return found


def _add_local_file(path: str, listing: Listing) -> None:
    try:
        stat = os.stat(path)
    except OSError as error:
        listing.skipped.append(Skipped(path=path, reason=f"cannot be read ({error.strerror})"))
        return
    listing.sources.append(Source(uri=path, location="local", path=path, size=stat.st_size, mtime_ns=stat.st_mtime_ns))


def _list_s3(item: str, filesystem: pafs.FileSystem, listing: Listing) -> None:
    path = item[len("s3://"):]
    pattern = path if any(c in path for c in _GLOB_CHARS) else None
    if pattern is not None:
        base = pattern[: min(pattern.index(c) for c in _GLOB_CHARS if c in pattern)].rsplit("/", 1)[0]
        infos = _s3_files_under(base, filesystem)
        matches = [info for info in infos if fnmatch.fnmatchcase(info.path, pattern)]
        if not matches:
            listing.skipped.append(Skipped(path=item, reason="matched no files"))
        infos = matches
    else:
        info = filesystem.get_file_info(path)
        if info.type == pafs.FileType.File:
            infos = [info]
        elif info.type == pafs.FileType.Directory:
            infos = _s3_files_under(path, filesystem)
            if not infos:
                listing.skipped.append(Skipped(path=item, reason="no files under this prefix"))
        else:
            listing.skipped.append(Skipped(path=item, reason="does not exist"))
            return
    for info in sorted(infos, key=lambda i: i.path):
        if _is_hidden(info.base_name):
            listing.skipped.append(Skipped(path=f"s3://{info.path}", reason="hidden file (not read)"))
            continue
        listing.sources.append(Source(uri=f"s3://{info.path}", location="s3", path=info.path, size=info.size, mtime_ns=None))


def _s3_files_under(base: str, filesystem: pafs.FileSystem) -> list[pafs.FileInfo]:
    infos = filesystem.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True))
    return [info for info in infos if info.type == pafs.FileType.File]


def _list_local(item: str, listing: Listing, exclude: str | None) -> None:
    if any(c in item for c in _GLOB_CHARS):
        matches = sorted(glob.glob(item, recursive=True))
        if not matches:
            listing.skipped.append(Skipped(path=item, reason="matched no files"))
        for match in matches:
            if os.path.isdir(match):
                _walk_local(match, listing, exclude)
            else:
                _add_local_file(match, listing)
    elif os.path.isdir(item):
        if _walk_local(item, listing, exclude) == 0:
            listing.skipped.append(Skipped(path=item, reason="directory has no (non-hidden) files"))
    elif os.path.exists(item):
        _add_local_file(item, listing)
    else:
        listing.skipped.append(Skipped(path=item, reason="does not exist"))


def list_sources(inputs: list[str], *, s3: pafs.FileSystem | None, exclude: str | None) -> Listing:
    """The files that canonical `inputs` name, in order, each once; what is not read goes to `.skipped`.
    exclude: a local output directory, left out of the listing."""
    listing = Listing()
    for item in inputs:
        if item.startswith("s3://"):
            assert s3 is not None  # built by the caller whenever an input is on S3
            try:
                _list_s3(item, s3, listing)
            except OSError as error:
                raise DataError(f"input '{item}' cannot be listed: {error}") from None
        else:
            _list_local(item, listing, exclude)
    unique: list[Source] = []
    seen: set[str] = set()
    for source in listing.sources:
        if source.uri in seen:
            listing.skipped.append(Skipped(path=source.uri, reason="listed twice (used once)"))
        elif exclude is not None and source.location == "local" and source.path.startswith(exclude + os.sep):
            listing.skipped.append(Skipped(path=source.uri, reason="inside the output directory"))
        else:
            seen.add(source.uri)
            unique.append(source)
    listing.sources = unique
    return listing


def input_filesystems(canonical: list[str], storage: StorageConfig) -> dict[str, pafs.FileSystem]:
    """The filesystems that read `canonical` inputs, by Source.location."""
    filesystems: dict[str, pafs.FileSystem] = {"local": pafs.LocalFileSystem()}
    if any(item.startswith("s3://") for item in canonical):
        filesystems["s3"] = resolve_filesystem("s3://", storage)[0]
    return filesystems


def list_inputs(
    inputs: list[str], storage: StorageConfig, *, exclude: str | None = None
) -> tuple[Listing, dict[str, pafs.FileSystem]]:
    """The files `inputs` name, listed as prepare_data lists them (hidden, missing and duplicate
    entries in `.skipped`), and the filesystems that read them (see `readers.FileReader`)."""
    canonical = [canonical_input(item) for item in inputs]
    filesystems = input_filesystems(canonical, storage)
    return list_sources(canonical, s3=filesystems.get("s3"), exclude=exclude), filesystems


def summarize_skipped(skipped: list[Skipped], limit: int = 10, *, listed: bool = True) -> str:
    """One line (limit=0) or a line and up to `limit` paths: inputs skipped whole, and apart from
    them the records skipped inside inputs that were used (those files are not skipped). listed:
    point to the manifest's list (False where no manifest is written)."""
    if not skipped:
        return ""
    whole = [s for s in skipped if not s.partial]
    partial = [s for s in skipped if s.partial]
    heads = []
    if whole:
        counts = Counter(s.reason.split(" (")[0].split(":")[0] for s in whole)
        heads.append(f"skipped {len(whole)} input(s): " + ", ".join(f"{n} {reason}" for reason, n in counts.most_common()))
    if len(partial) == 1:
        count, _, detail = partial[0].reason.partition(": ")
        heads.append(f"used {partial[0].path}; {count} in it: {detail}")
    elif partial:
        heads.append(f"used {len(partial)} inputs without some of their records")
    head = "; ".join(heads)
    where = f" (each listed under 'skipped' in {MANIFEST_NAME})" if listed else ""
    if limit == 0:  # one summary line; the paths are in the manifest
        return head + where
    lines = [head, *(f"  {s.path}: {s.reason}" for s in skipped[:limit])]
    if len(skipped) > limit:
        lines.append(f"  ... and {len(skipped) - limit} more{where.replace('each', 'all')}")
    return "\n".join(lines)
