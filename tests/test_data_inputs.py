"""prepare-data's inputs: Parquet (a text column), gzip and zstd JSONL, a configurable text field, read
as a stream, local and on the S3-compatible server; then a short training run on what was prepared."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_fast.data import load_manifest, prepare_data
from raytrain_fast.data.corpus import EOD_TOKEN
from raytrain_fast.data.readers import FileReader
from raytrain_fast.data.tokenizing import is_validation_document
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

pytestmark = pytest.mark.ray


def documents(prefix: str, count: int) -> list[str]:
    return [f"{prefix} {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(20 + i % 13)) + " é\N{SNAKE}" for i in range(count)]


def zstd_bytes(data: bytes) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.CompressedOutputStream(sink, "zstd") as stream:
        stream.write(data)
    return sink.getvalue().to_pybytes()


def jsonl(records: list) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()


def parquet_bytes(table: pa.Table, *, row_group_size: int) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group_size)
    return sink.getvalue().to_pybytes()


def corpus_files() -> tuple[dict[str, bytes], list[str]]:
    """(file name -> bytes, the documents prepare-data should use, in listing order)."""
    rows = documents("parquet", 40)
    texts: list = list(rows)
    texts[3], texts[10] = None, ""  # a null and an empty row: counted, listed, not used
    table = pa.table({"id": pa.array(range(40), pa.int64()), "text": pa.array(texts, pa.string())})
    gz, zst = documents("gzip", 25), documents("zstd", 30)
    files = {
        "a.parquet": parquet_bytes(table, row_group_size=7),  # 6 row groups
        "b.jsonl.gz": gzip.compress(jsonl([{"text": d} for d in gz] + ["not json", {"id": 1}])),
        "c.jsonl.zst": zstd_bytes(jsonl([{"text": d} for d in zst])),
    }
    used = [d for i, d in enumerate(rows) if i not in (3, 10)] + gz + zst
    return files, used


def packed_documents(manifest, storage: StorageConfig | None = None) -> list[str]:
    """Every complete document of the training shards, in stream order."""
    filesystem, root = resolve_filesystem(manifest.root, storage or StorageConfig())
    stream = np.concatenate([
        np.stack(pq.read_table(f"{root}/{shard.path}", filesystem=filesystem).column("tokens").to_numpy(zero_copy_only=False)).reshape(-1)
        for shard in manifest.shards
    ])
    pieces = np.split(stream, np.flatnonzero(stream == EOD_TOKEN) + 1)
    return [bytes(p[:-1].astype(np.uint8)).decode("utf-8") for p in pieces if len(p) and p[-1] == EOD_TOKEN]


def training(manifest, used: list[str]) -> list[str]:
    """The documents of `used` that the content hash leaves in training."""
    return [d for d in used if not is_validation_document(d.encode(), manifest.recipe.get("val_fraction", 0.0))]


def assert_prepared(manifest, used: list[str], storage: StorageConfig | None = None) -> None:
    got, train = packed_documents(manifest, storage), training(manifest, used)
    assert got == train[: len(got)] and len(got) >= len(train) - 1  # the tail that fills no row is dropped
    assert manifest.num_documents == len(train)
    reasons = {s.path.rsplit("/", 1)[-1]: s.reason for s in manifest.skipped}
    assert reasons["a.parquet"] == "2 Parquet rows skipped: 1 null 'text' (first at row 4), 1 empty 'text' (first at row 11)"
    assert reasons["b.jsonl.gz"].startswith("2 JSONL records skipped: 1 not valid JSON (first at line 26)")
    assert all(s.partial for s in manifest.skipped) and "c.jsonl.zst" not in reasons


def test_parquet_gzip_and_zstd_in_process_and_in_ray_data_agree(tmp_path, ray_session, capsys):
    files, used = corpus_files()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, data in files.items():
        (corpus / name).write_bytes(data)
    local = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "local"), seq_len=16, rows_per_shard=50, parallel=False)
    assert_prepared(local, used)
    progress = [line for line in capsys.readouterr().err.splitlines() if "3/3 files" in line]
    assert progress and f"{len(used):,} documents" in progress[-1] and "tokens/s" in progress[-1], progress

    # Ray Data tasks; a file past readers.BATCH_BYTES (8 MiB) goes through in several parts, in order.
    big = [f"line {i} " + "x" * (900 + i % 200) for i in range(10_000)]
    (corpus / "d.jsonl.zst").write_bytes(zstd_bytes(jsonl([{"text": d} for d in big])))
    in_ray = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "ray"), seq_len=16, rows_per_shard=5000, parallel=True)
    in_process = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "in-process"), seq_len=16, rows_per_shard=5000, parallel=False)
    train = training(in_ray, used + big)
    assert in_ray.sources_hash == in_process.sources_hash and in_ray.num_documents == len(train)
    assert packed_documents(in_ray) == packed_documents(in_process) == train[: len(packed_documents(in_ray))]


def test_a_large_file_is_read_in_bounded_batches(tmp_path):
    lines = [{"body": f"record {i} " + "y" * 3000} for i in range(600)]  # ~1.8 MB of text
    path = tmp_path / "big.ndjson.gz"
    path.write_bytes(gzip.compress(jsonl(lines)))
    reader = FileReader("local", str(path), {}, text_field="body", batch_bytes=100_000)
    batches = list(reader.batches())
    assert len(batches) >= 15 and max(sum(len(d) for d in b) for b in batches) < 100_000 + 3100
    assert [d.decode() for b in batches for d in b] == [r["body"] for r in lines]
    assert reader.sha256 and not (reader.skip_reason or reader.partial_reason or reader.fatal)

    table = pa.table({"body": [r["body"] for r in lines]})
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=50)
    reader = FileReader("local", str(tmp_path / "big.parquet"), {}, text_field="body", batch_bytes=100_000)
    batches = list(reader.batches())
    assert len(batches) >= 12 and [d.decode() for b in batches for d in b] == [r["body"] for r in lines]


def test_text_field_and_files_whose_every_record_is_bad(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = documents("body", 30)
    (corpus / "posts.jsonl").write_bytes(jsonl([{"id": i, "body": d} for i, d in enumerate(docs)]))
    pq.write_table(pa.table({"id": list(range(30)), "body": docs}), corpus / "posts.parquet")

    with pytest.raises(DataError) as error:  # the Parquet file's columns, before anything is tokenized
        prepare_data(inputs=[str(corpus)], output=str(tmp_path / "out"), seq_len=8, parallel=False)
    message = str(error.value)
    assert "posts.parquet" in message and "no column 'text'" in message and "'id' (int64), 'body' (string)" in message
    assert "--text-field" in message and not (tmp_path / "out" / "manifest.json").exists()

    with pytest.raises(DataError) as error:  # a JSONL file whose every record lacks the field
        prepare_data(inputs=[str(corpus / "posts.jsonl")], output=str(tmp_path / "out"), seq_len=8, parallel=False)
    message = str(error.value)
    assert "posts.jsonl" in message and "30 no string 'text' field (first at line 1)" in message
    assert "'id', 'body'" in message and "--text-field" in message

    made = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "body"), seq_len=8, parallel=False, text_field="body")
    train = training(made, docs + docs)
    assert made.num_documents == len(train) and not made.skipped and made.recipe["text_field"] == "body"
    assert packed_documents(made) == train[: len(packed_documents(made))]

    pq.write_table(pa.table({"body": list(range(5))}), corpus / "numbers.parquet")
    with pytest.raises(DataError, match=r"column 'body' holds int64, not text; set --text-field"):
        prepare_data(inputs=[str(corpus / "numbers.parquet")], output=str(tmp_path / "n"), seq_len=8, parallel=False, text_field="body")


def test_s3_inputs_prepare_and_train(s3_server, ray_session, monkeypatch, tmp_path):
    from raytrain_fast.config import load_config
    from raytrain_fast.launch.trainer import run

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.make_bucket("data-inputs")
    client = s3_server.client()
    files, used = corpus_files()
    for name, data in files.items():
        client.put_object(Bucket=bucket, Key=f"in/{name}", Body=data)
    storage = StorageConfig(endpoint_url=s3_server.endpoint_url)

    made = prepare_data(inputs=[f"s3://{bucket}/in/*"], output=f"s3://{bucket}/prepared", seq_len=32, storage=storage, val_fraction=0.1)
    manifest = load_manifest(f"s3://{bucket}/prepared", storage)
    assert manifest.num_sequences == made.num_sequences > 0
    assert manifest.validation is not None and manifest.num_documents + manifest.validation.num_documents == len(used)
    assert not [s for s in manifest.skipped if not s.partial]  # every format read from S3 too

    config = load_config("tiny", [
        "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32", "data.seq_len=32",
        f"data.source=s3://{bucket}/prepared", "train.micro_batch=4", "train.global_batch=4", "train.steps=4",
        "train.log_every=2", "checkpoint.every_steps=4", "optim.warmup_steps=1", "resources.num_workers=1",
        "engine.precision=fp32", "metrics.peak_measure_s=0.2", f"storage.uri=s3://{bucket}/runs",
        f"storage.endpoint_url={s3_server.endpoint_url}",
    ], name="from-parquet")
    result = run(config)
    steps = [metrics["step"] for _, metrics in result.checkpoints]
    assert steps == [4] and np.isfinite([m["train/loss"] for _, m in result.checkpoints]).all()


def test_train_tokenizer_reads_the_same_inputs(tmp_path):
    pytest.importorskip("tokenizers")
    from raytrain_fast.data.train_tokenizer import train_tokenizer

    docs = documents("body", 60)
    pq.write_table(pa.table({"body": docs}), tmp_path / "posts.parquet", row_group_size=10)
    (tmp_path / "more.jsonl.zst").write_bytes(zstd_bytes(jsonl([{"body": d} for d in docs[:20]] + [{"id": 1}])))
    made = train_tokenizer(inputs=[str(tmp_path / "posts.parquet"), str(tmp_path / "more.jsonl.zst")], output=str(tmp_path / "tok"),
                           vocab_size=300, text_field="body", verbose=False)
    assert made.num_files == 2 and made.num_documents == 80 and made.num_bytes == sum(len(d.encode()) for d in docs + docs[:20])
    assert [s.reason for s in made.skipped] == ["1 JSONL records skipped: 1 no string 'body' field (first at line 21)"]
    with pytest.raises(DataError, match="no column 'text'.*'body' \\(string\\)"):
        train_tokenizer(inputs=[str(tmp_path / "posts.parquet")], output=str(tmp_path / "tok2"), vocab_size=300, verbose=False)


def test_one_parquet_file_is_cut_into_row_group_pieces_for_every_cpu(tmp_path, ray_session):
    from raytrain_fast.data.inputs import list_inputs
    from raytrain_fast.data.tokenizing import _work_items
    from raytrain_fast.storage import StorageConfig as Storage

    rows: list = documents("row", 90)
    for i in (2, 47, 80):
        rows[i] = None  # nulls in the first and the second half: one count, the first row of all
    rows[50] = ""
    pq.write_table(pa.table({"text": rows}), tmp_path / "one.parquet", row_group_size=10)  # 9 row groups
    listing, filesystems = list_inputs([str(tmp_path / "one.parquet")], Storage())
    items = _work_items(listing.sources, filesystems, num_cpus=2)
    assert [(piece, row_groups) for _, piece, _, row_groups in items] == [(0, (0, 4)), (1, (4, 9))]
    enough_files = _work_items(listing.sources * 2, filesystems, num_cpus=2)
    assert [row_groups for *_, row_groups in enough_files] == [None, None]

    in_ray = prepare_data(inputs=[str(tmp_path / "one.parquet")], output=str(tmp_path / "ray"), seq_len=16, parallel=True)
    in_process = prepare_data(inputs=[str(tmp_path / "one.parquet")], output=str(tmp_path / "local"), seq_len=16, parallel=False)
    assert [(s.reason, s.partial) for s in in_ray.skipped] == [(s.reason, s.partial) for s in in_process.skipped] == [
        ("4 Parquet rows skipped: 3 null 'text' (first at row 3), 1 empty 'text' (first at row 51)", True)]
    assert in_ray.sources_hash == in_process.sources_hash and in_ray.sources == in_process.sources
    used = [r for r in rows if r]
    assert packed_documents(in_ray) == packed_documents(in_process) == training(in_ray, used)[: len(packed_documents(in_ray))]

    pq.write_table(pa.table({"text": [None] * 20 + [""] * 20}), tmp_path / "bad.parquet", row_group_size=10)
    with pytest.raises(DataError, match=r"no usable Parquet rows: 20 null 'text' \(first at row 1\), 20 empty 'text' \(first at row 21\)"):
        prepare_data(inputs=[str(tmp_path / "bad.parquet")], output=str(tmp_path / "bad"), seq_len=16, parallel=True)
