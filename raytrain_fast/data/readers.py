"""Reading one input's documents as a stream: plain text (one document a file), JSONL (one document a
line, in a text field), Parquet (one document a row, in a text column), each optionally gzip or zstd
compressed (`.gz`, `.zst`), never a whole JSONL or Parquet file in memory (docs/data.md, "Inputs").

A file that cannot be used is skipped with a reason; records that cannot be used are counted by
reason, and the file is used without them; a file where every record is bad is an error (`fatal`)
that names the fields or columns it has, so a wrong --text-field is never a silently empty corpus.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
import pyarrow.parquet as pq

JSONL_SUFFIXES = (".jsonl", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
CODECS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
"""Compressed inputs, by suffix (e.g. `.jsonl.zst`), decompressed as a stream by pyarrow's codecs."""
DEFAULT_TEXT_FIELD = "text"
BATCH_BYTES = 8 << 20
"""Text handed on (to the tokenizer) at a time: bounds the memory of reading a file of any size."""
_READ_BYTES = 4 << 20
_TEXT_TYPES = (pa.string(), pa.large_string(), pa.string_view())


TEXT_FIELD_SETTING = "--text-field"
"""How the messages name the text-field setting; a caller with another name for it (pretrain's
data.text_field) puts its own in (`name_settings`)."""


def text_fields(text_field: str) -> list[str]:
    """The names a text-field setting lists (comma-separated), in order of preference."""
    return [name.strip() for name in text_field.split(",") if name.strip()] or [DEFAULT_TEXT_FIELD]


def _quoted(text_field: str) -> str:
    return " or ".join(f"'{name}'" for name in text_fields(text_field))


def name_settings(message: str, names: dict[str, str]) -> str:
    """`message` with prepare-data's flags called by another command's settings ({"--input": "data.source"})."""
    for flag, setting in names.items():
        message = message.replace(f"{flag} ", f"{setting} ")
    return message


def input_format(path: str) -> tuple[str, str | None]:
    """(`text`, `jsonl` or `parquet`, the codec of a compressed file or None), from the file's name."""
    name, codec = path.lower(), None
    for suffix, name_codec in CODECS.items():
        if name.endswith(suffix):
            name, codec = name[: -len(suffix)], name_codec
            break
    if name.endswith(PARQUET_SUFFIXES) and codec is None:
        return "parquet", None
    return ("jsonl" if name.endswith(JSONL_SUFFIXES) else "text"), codec


class _HashingReader:
    """A file object that hashes what is read through it (a compressed file's own bytes)."""

    def __init__(self, raw) -> None:
        self.raw, self.digest, self.closed = raw, hashlib.sha256(), False

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read() if size is None or size < 0 else self.raw.read(size)
        self.digest.update(data)
        return data

    def drain(self) -> None:
        while self.read(_READ_BYTES):
            pass

    def close(self) -> None:
        self.closed = True


def _open_raw(location: str, path: str, filesystems: dict[str, pafs.FileSystem]):
    if location == "local":
        return open(path, "rb")
    return filesystems[location].open_input_stream(path, compression=None)  # the file as stored: its hash, our codec


def file_sha256(location: str, path: str, filesystems: dict[str, pafs.FileSystem]) -> str:
    """sha256 of a file as stored, read in chunks. Raises OSError."""
    with _open_raw(location, path, filesystems) as raw:
        reader = _HashingReader(raw)
        reader.drain()
    return reader.digest.hexdigest()


class _Records:
    """Counts a file's unusable records by reason, with the first place of each (line or row)."""

    def __init__(self, field: str, unit: str) -> None:
        self.field, self.unit = field, unit
        self.bad: Counter[str] = Counter()
        self.first: dict[str, int] = {}
        self.fields: Counter[str] = Counter()
        """Keys of the JSON objects seen: the fix for a wrong field names one of them."""

    def count(self, problem: str, where: int, num: int = 1) -> None:
        self.bad[problem] += num
        self.first.setdefault(problem, where)

    def summary(self) -> str:
        return ", ".join(f"{n} {problem} (first at {self.unit} {self.first[problem]})" for problem, n in self.bad.items())

    @classmethod
    def merged(cls, pieces: list[_Records]) -> _Records:
        """The records of a file read in pieces (each piece's, in file order)."""
        records = cls(pieces[0].field, pieces[0].unit)
        for piece in pieces:
            for problem, n in piece.bad.items():
                records.count(problem, piece.first[problem], n)
            records.fields.update(piece.fields)
        return records


def verdict(records: _Records | list[_Records], *, num_documents: int, text_field: str) -> tuple[str, str, str]:
    """(skip_reason, partial_reason, fatal) of a file once read: used (maybe without some records),
    skipped (nothing in it), or an error (every record bad). `records`: a file's, or the `records` of
    each piece of a Parquet file read in pieces (FileReader.row_groups)."""
    records = _Records.merged(records) if isinstance(records, list) else records
    what, none = ("JSONL records", "no JSONL records") if records.unit == "line" else ("Parquet rows", "no rows")
    summary = records.summary()
    if num_documents:
        return "", (f"{sum(records.bad.values())} {what} skipped: {summary}" if records.bad else ""), ""
    if not records.bad:
        return none, "", ""
    found = ", ".join(f"'{name}'" for name, _ in records.fields.most_common(8)) or "none (no line is a JSON object)"
    return "", "", (
        f"no usable {what}: {summary}. The fields its records have: {found}; "
        f"set {TEXT_FIELD_SETTING} to the one that holds the text (now '{text_field}'; several names, comma-separated, "
        "take the first each record has)"
    )


class FileReader:
    """One input's documents (UTF-8 bytes) in batches of about BATCH_BYTES, read as a stream.

    After `batches()` ends: `sha256` (of the file as stored), `skip_reason` (the file was not used),
    `partial_reason` (some of its records were not), `fatal` (every record was bad: an error message).
    """

    def __init__(
        self, location: str, path: str, filesystems: dict[str, pafs.FileSystem], *,
        text_field: str = DEFAULT_TEXT_FIELD, batch_bytes: int = BATCH_BYTES, row_groups: tuple[int, int] | None = None,
    ) -> None:
        self.location, self.path, self.filesystems = location, path, filesystems
        self.text_field, self.batch_bytes = text_field, batch_bytes
        self.fields = text_fields(text_field)
        self.row_groups = row_groups
        """A Parquet file's row groups [first, end) only: a piece of a file read by several tasks. Its
        records are left in `records` for the verdict over all pieces (`verdict`), and only the
        first piece hashes the file."""
        self.sha256 = self.skip_reason = self.partial_reason = self.fatal = ""
        self.records: _Records | None = None
        self.num_documents = 0

    def batches(self) -> Iterator[list[bytes]]:
        kind, codec = input_format(self.path)
        try:
            if kind == "parquet":
                yield from self._counted(self._parquet())
                return
            with _open_raw(self.location, self.path, self.filesystems) as raw:
                hashing = _HashingReader(raw)
                stream = pa.CompressedInputStream(pa.PythonFile(hashing, mode="r"), codec) if codec else hashing
                yield from self._counted(self._jsonl(stream) if kind == "jsonl" else self._text(stream))
                hashing.drain()  # bytes past the end of a compressed stream belong to the file too
                self.sha256 = hashing.digest.hexdigest()
        except (OSError, pa.ArrowException) as error:
            if self.num_documents:
                self.partial_reason = f"reading stopped after {self.num_documents} documents ({error}); those were used"
            else:
                self.skip_reason = f"cannot be read ({error})"

    def _counted(self, batches: Iterator[list[bytes]]) -> Iterator[list[bytes]]:
        for batch in batches:
            self.num_documents += len(batch)
            yield batch

    def _text(self, stream) -> Iterator[list[bytes]]:
        """A plain-text file is one document, so it is read whole."""
        data = stream.read()
        self.skip_reason = _not_text(data)
        if not self.skip_reason:
            try:
                data.decode("utf-8")
            except UnicodeDecodeError as error:
                self.skip_reason = f"not UTF-8 text (invalid byte at offset {error.start})"
                return
            yield [data]

    def _lines(self, chunk: bytes, stream) -> Iterator[tuple[int, int, bytes]]:
        """(line number, byte offset, line) of a stream whose first `chunk` is read already, read in chunks."""
        remainder, number, offset = b"", 0, 0
        while True:
            lines = (remainder + chunk).split(b"\n") if chunk else [remainder]
            remainder = lines.pop() if chunk else b""
            for line in lines:
                number += 1
                yield number, offset, line
                offset += len(line) + 1
            if not chunk:
                return
            chunk = stream.read(_READ_BYTES)

    def _jsonl(self, stream) -> Iterator[list[bytes]]:
        records = _Records(self.text_field, "line")
        batch: list[bytes] = []
        size = 0
        first = stream.read(_READ_BYTES)
        self.skip_reason = _not_text(first)
        if self.skip_reason:
            return
        for number, offset, line in self._lines(first, stream):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as error:
                if not self.num_documents and not batch and not records.bad:
                    self.skip_reason = f"not UTF-8 text (invalid byte at offset {offset + error.start})"
                    return
                records.count("not UTF-8", number)
                continue
            document = self._json_record(text, number, records)
            if document:
                batch.append(document)
                size += len(document)
                if size >= self.batch_bytes:
                    yield batch
                    batch, size = [], 0
        if batch:
            yield batch
        self._conclude(records)

    def _json_record(self, line: str, number: int, records: _Records) -> bytes | None:
        try:  # not splitlines() upstream: JSON strings may hold U+2028
            record = json.loads(line)
        except json.JSONDecodeError:
            records.count("not valid JSON", number)
            return None
        if isinstance(record, dict):
            records.fields.update(record.keys())
        value = next((record[n] for n in self.fields if isinstance(record.get(n), str)), None) if isinstance(record, dict) else None
        if not isinstance(value, str):
            records.count(f"no string {_quoted(self.text_field)} field", number)
        elif not value:
            records.count(f"empty {_quoted(self.text_field)}", number)
        else:
            return value.encode("utf-8")
        return None

    def _conclude(self, records: _Records) -> None:
        if self.row_groups is not None:
            self.records = records
            return
        skip, self.partial_reason, self.fatal = verdict(records, num_documents=self.num_documents, text_field=self.text_field)
        self.skip_reason = self.skip_reason or skip

    def _parquet(self) -> Iterator[list[bytes]]:
        # Parquet is read by random access (footer first), so the file's hash is a pass of its own.
        if self.row_groups is None or self.row_groups[0] == 0:
            self.sha256 = file_sha256(self.location, self.path, self.filesystems)
        with contextlib.ExitStack() as stack:
            handle = self.path if self.location == "local" else stack.enter_context(
                self.filesystems[self.location].open_input_file(self.path))
            try:
                parquet = pq.ParquetFile(handle)
            except (OSError, pa.ArrowException) as error:
                empty = "size is 0" in str(error) or "empty" in str(error).lower()
                self.skip_reason = "empty file" if empty else f"not a Parquet file ({error})"
                return
            problem = parquet_column_problem(parquet.schema_arrow, self.text_field)
            if problem:
                self.fatal = problem
                return
            yield from self._parquet_batches(parquet, parquet_text_column(parquet.schema_arrow, self.text_field))

    def _parquet_batches(self, parquet: pq.ParquetFile, column_name: str) -> Iterator[list[bytes]]:
        records = _Records(column_name, "row")
        metadata = parquet.metadata
        row_bytes = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups)) / max(1, metadata.num_rows)
        rows = max(1, min(65536, int(self.batch_bytes / max(1.0, row_bytes))))
        first, end = self.row_groups or (0, metadata.num_row_groups)
        start = sum(metadata.row_group(i).num_rows for i in range(first))
        batches = parquet.iter_batches(batch_size=rows, row_groups=range(first, end), columns=[column_name], use_threads=False)
        for record_batch in batches:
            column = record_batch.column(0)
            if pa.types.is_dictionary(column.type):
                column = column.dictionary_decode()
            column = column.cast(pa.large_binary())
            null = np.asarray(column.is_null(), dtype=bool)
            empty = ~null & np.asarray(pc.equal(pc.binary_length(column), 0).fill_null(False), dtype=bool)
            for problem, mask in ((f"null '{column_name}'", null), (f"empty '{column_name}'", empty)):
                if mask.any():
                    records.count(problem, start + int(np.argmax(mask)) + 1, int(mask.sum()))
            start += len(column)
            documents = [value for value in column.to_pylist() if value]
            if documents:
                yield documents
        self._conclude(records)


def _not_text(head: bytes) -> str:
    """Why a file that starts with `head` holds no text ("": it may)."""
    return "empty file" if not head else "binary file (contains NUL bytes)" if b"\x00" in head else ""


def parquet_text_column(schema: pa.Schema, text_field: str) -> str | None:
    """The first of the text field's names that `schema` has a column of (None: none)."""
    return next((name for name in text_fields(text_field) if name in schema.names), None)


def parquet_column_problem(schema: pa.Schema, text_field: str) -> str:
    """Why `schema` has no text column among `text_field`'s names (naming the columns it has and the fix), or ""."""
    column = parquet_text_column(schema, text_field)
    if column is None:
        columns = ", ".join(f"'{name}' ({schema.field(name).type})" for name in schema.names[:12]) or "none"
        return (
            f"the Parquet file has no column {_quoted(text_field)}; its columns: {columns}. "
            f"Set {TEXT_FIELD_SETTING} to the column that holds the text (several names, comma-separated, take the "
            "first each file has, e.g. content,text)"
        )
    column_type = schema.field(column).type
    value_type = column_type.value_type if pa.types.is_dictionary(column_type) else column_type
    if value_type not in _TEXT_TYPES:
        return f"the Parquet column '{column}' holds {column_type}, not text; set {TEXT_FIELD_SETTING} to a string column"
    return ""
