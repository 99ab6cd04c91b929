"""The JSONL metric files in a run's storage: their names (one numbered segment per (re)start and part,
`<run>/metrics/metrics-r<restart>-p<part>.jsonl`) and `read_metrics`, which merges the segments of
every (re)start into one series."""

from __future__ import annotations

import itertools
import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from raytrain_fast.storage import StorageConfig

METRICS_DIR = "metrics"
_SEGMENT = re.compile(r"^metrics-r(\d{4,})-p(\d{4,})\.jsonl$")


def segment_name(restart: int, part: int) -> str:
    return f"metrics-r{restart:04d}-p{part:04d}.jsonl"


def metrics_filesystem(uri: str, storage: StorageConfig | None) -> tuple[pafs.FileSystem, str]:
    from raytrain_fast.storage import StorageConfig, resolve_filesystem

    return resolve_filesystem(uri, storage or StorageConfig())


def list_segments(fs: pafs.FileSystem, directory: str) -> list[tuple[int, int, str]]:
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    except FileNotFoundError:
        return []
    segments = []
    for info in infos:
        match = _SEGMENT.match(info.base_name)
        if match and info.type == pafs.FileType.File:
            segments.append((int(match.group(1)), int(match.group(2)), info.path))
    return sorted(segments)


def read_metrics(run_uri: str, *, storage: StorageConfig | None = None) -> list[dict[str, Any]]:
    """Every metrics record of a run as one continuous series ordered by step, one record per step
    (records written for the same step, such as an evaluation's, are merged).

    Segments are replayed in (re)start order. When a restart resumed from step s, what earlier
    attempts logged after s was superseded (those steps ran again), so it is dropped.
    """
    fs, root = metrics_filesystem(run_uri, storage)
    records: list[dict[str, Any]] = []
    for _, parts in itertools.groupby(list_segments(fs, f"{root}/{METRICS_DIR}"), key=lambda found: found[0]):
        segment: list[dict[str, Any]] = []  # one (re)start's records, from all its parts
        start_step: int | None = None
        for _, _, path in parts:
            with fs.open_input_stream(path) as stream:
                text = stream.read().decode("utf-8", errors="replace")
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn line; never written by JsonlSink itself, but be lenient
                if "_segment" in record:
                    start_step = int(record["_segment"].get("start_step", 0))
                elif isinstance(record.get("step"), int):
                    segment.append(record)
        if start_step is None:
            start_step = min((r["step"] for r in segment), default=1) - 1
        records = [r for r in records if r["step"] <= start_step]
        records.extend(segment)
    records.sort(key=lambda r: r["step"])  # stable: keeps the order of equal steps
    merged: list[dict[str, Any]] = []
    for record in records:  # one record per step: an evaluation's values join that step's window record
        if merged and merged[-1]["step"] == record["step"]:
            merged[-1].update(record)
        else:
            merged.append(record)
    return merged
