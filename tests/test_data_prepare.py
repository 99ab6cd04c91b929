"""prepare_data: text (local or S3) -> packed Parquet shards + manifest, and the corpus cache."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from raytrain_fast.data import ensure_prepared_corpus, load_manifest, prepare_data
from raytrain_fast.data.corpus import EOD_TOKEN
from raytrain_fast.data.manifest import MANIFEST_NAME
from raytrain_fast.data.tokenizing import is_validation_document
from raytrain_fast.errors import DataError
from raytrain_fast.storage import StorageConfig, resolve_filesystem

pytestmark = pytest.mark.ray

TEXTS = {
    "a.txt": "def hello():\n    return 'héllo wörld'\n",
    "b.md": "# Title\n\nSome prose with an emoji \N{SNAKE} and tabs\tinside.\n" * 3,
    "sub/c.py": "import os\nprint(os.getcwd())\n" * 5,
}
JSONL = [{"text": "first record"}, {"text": "second record, ünïcode"}, {"id": 3}, {"text": "third"}]


def write_corpus(root) -> None:
    for name, text in TEXTS.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in JSONL) + "\nnot json\n", encoding="utf-8")


def source_documents(manifest, storage: StorageConfig, *, split: str = "train") -> list[str]:
    """The documents prepare_data should have packed into `split` (train or val), in source order."""
    documents = []
    for source in manifest.sources:
        filesystem, path = resolve_filesystem(source.path, storage)
        with filesystem.open_input_stream(path) as stream:
            text = stream.read().decode("utf-8")
        if source.path.endswith(".jsonl"):
            records = []
            for line in text.splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
            documents += [r["text"] for r in records if isinstance(r.get("text"), str) and r["text"]]
        else:
            documents.append(text)
    fraction = manifest.recipe.get("val_fraction", 0.0)
    return [d for d in documents if is_validation_document(d.encode(), fraction) == (split == "val")]


def read_rows(manifest, storage: StorageConfig | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(seq_ids, tokens) of every shard, checking each shard holds its declared consecutive seq_ids."""
    filesystem, root = resolve_filesystem(manifest.root, storage or StorageConfig())
    all_ids, all_tokens = [], []
    for shard in manifest.shards:
        table = pq.read_table(f"{root}/{shard.path}", filesystem=filesystem)
        ids = table.column("seq_id").to_numpy()
        assert ids.dtype == np.int64
        assert list(ids) == list(range(shard.first_seq_id, shard.first_seq_id + shard.num_rows))
        tokens = np.stack(table.column("tokens").to_numpy(zero_copy_only=False))
        assert tokens.shape == (shard.num_rows, manifest.seq_len + 1)
        all_ids.append(ids)
        all_tokens.append(tokens)
    return np.concatenate(all_ids), np.concatenate(all_tokens)


def assert_round_trip(manifest, storage: StorageConfig | None = None) -> None:
    ids, tokens = read_rows(manifest, storage)
    order = np.argsort(ids)
    assert list(ids[order]) == list(range(manifest.num_sequences))
    stream = tokens[order].reshape(-1)
    documents = source_documents(manifest, storage or StorageConfig())
    expected = np.concatenate([np.append(np.frombuffer(d.encode(), np.uint8).astype(np.int64), EOD_TOKEN) for d in documents])
    assert len(expected) == len(stream) + manifest.num_dropped_tokens
    assert np.array_equal(stream, expected[: len(stream)])
    # Split at EOD: every complete document decodes back to its source text, in order.
    pieces = np.split(stream, np.flatnonzero(stream == EOD_TOKEN) + 1)
    decoded = [bytes(p[:-1].astype(np.uint8)).decode("utf-8") for p in pieces if len(p) and p[-1] == EOD_TOKEN]
    assert decoded == documents[: len(decoded)] and len(decoded) >= len(documents) - 1
    assert manifest.num_documents == len(documents)


def test_local_round_trip_in_process_and_ray_data_agree(tmp_path, ray_session, capsys):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    local = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "local"), seq_len=16, rows_per_shard=5, parallel=False)
    assert_round_trip(load_manifest(str(tmp_path / "local")))
    assert [os.path.relpath(s.path, corpus) for s in local.sources] == ["a.txt", "b.md", "d.jsonl", "sub/c.py"]
    assert len(local.shards) > 2 and all(s.num_rows == 5 for s in local.shards[:-1])
    assert {(os.path.basename(s.path), s.reason.split(":")[0]) for s in local.skipped} == {("d.jsonl", "2 JSONL records skipped")}
    err = capsys.readouterr().err
    assert "files" in err and "tokens" in err and "2 JSONL records skipped" in err

    ray_made = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "ray"), seq_len=16, rows_per_shard=5, parallel=True)
    assert_round_trip(ray_made)
    assert ray_made.sources_hash == local.sources_hash
    assert read_rows(ray_made)[1].tolist() == read_rows(local)[1].tolist()
    for name in ("seq_id", "tokens"):
        assert name in pq.read_schema(os.path.join(tmp_path, "ray", ray_made.shards[0].path)).names
    manifest = json.loads((tmp_path / "ray" / MANIFEST_NAME).read_text())
    assert manifest["tokenizer"]["vocab_size"] == 257 and manifest["num_sequences"] == ray_made.num_sequences
    assert sum(s["num_rows"] for s in manifest["shards"]) == manifest["num_sequences"]


def test_s3_input_and_output_round_trip(s3_server, ray_session, monkeypatch):
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    bucket = s3_server.make_bucket("prep-data")
    client = s3_server.client()
    for name, text in TEXTS.items():
        client.put_object(Bucket=bucket, Key=f"in/{name}", Body=text.encode())
    client.put_object(Bucket=bucket, Key="in/d.jsonl", Body="\n".join(json.dumps(r) for r in JSONL).encode())
    storage = StorageConfig(endpoint_url=s3_server.endpoint_url)

    made = prepare_data(inputs=["s3://prep-data/in/"], output="s3://prep-data/out", seq_len=12, rows_per_shard=4, storage=storage)
    assert [s.path for s in made.sources] == [f"s3://prep-data/in/{n}" for n in ("a.txt", "b.md", "d.jsonl", "sub/c.py")]
    manifest = load_manifest("s3://prep-data/out", storage)
    assert manifest.root == "s3://prep-data/out" and manifest.num_sequences == made.num_sequences
    assert_round_trip(manifest, storage)
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="out/")["Contents"]}
    assert "out/manifest.json" in keys and "out/shard-00000.parquet" in keys


def test_bad_inputs_are_reported_with_reasons(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "good.txt").write_text("good text " * 20)
    (corpus / "empty.txt").write_bytes(b"")
    (corpus / "image.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (corpus / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (corpus / ".hidden").write_text("secret")
    (tmp_path / "empty_dir").mkdir()
    missing = str(tmp_path / "missing.txt")
    nothing = str(tmp_path / "*.nothing")

    manifest = prepare_data(
        inputs=[str(corpus), missing, str(tmp_path / "empty_dir"), nothing], output=str(tmp_path / "out"), seq_len=8,
    )
    reasons = {os.path.basename(s.path): s.reason for s in manifest.skipped}
    assert reasons == {
        "empty.txt": "empty file",
        "image.bin": "binary file (contains NUL bytes)",
        "latin1.txt": "not UTF-8 text (invalid byte at offset 3)",
        ".hidden": "hidden file (not read)",
        "missing.txt": "does not exist",
        "empty_dir": "directory has no (non-hidden) files",
        "*.nothing": "matched no files",
    }
    assert [os.path.basename(s.path) for s in manifest.sources] == ["good.txt"]
    err = capsys.readouterr().err
    summary = [line for line in err.splitlines() if "skipped 7 input(s)" in line]
    assert len(summary) == 1 and "1 does not exist" in summary[0] and "1 empty file" in summary[0]
    assert "missing.txt" not in err  # one summary line; each path is in the manifest

    with pytest.raises(DataError) as error:
        prepare_data(inputs=[missing, str(corpus / "empty.txt")], output=str(tmp_path / "out2"), seq_len=8)
    assert "the inputs hold no text (1 empty file(s)" in str(error.value)  # before anything is written
    assert "does not exist" in str(error.value) and not (tmp_path / "out2").exists()
    with pytest.raises(DataError, match="no inputs given"):
        prepare_data(inputs=[], output=str(tmp_path / "out3"), seq_len=8)
    (tmp_path / "short.txt").write_text("tiny")
    with pytest.raises(DataError, match="fewer than one sequence"):
        prepare_data(inputs=[str(tmp_path / "short.txt")], output=str(tmp_path / "out4"), seq_len=64)


def test_same_inputs_are_a_no_op_and_different_ones_are_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    out = str(tmp_path / "out")
    first = prepare_data(inputs=[str(corpus)], output=out, seq_len=16)
    shard = tmp_path / "out" / first.shards[0].path
    before = shard.stat().st_mtime_ns
    capsys.readouterr()

    again = prepare_data(inputs=[str(corpus)], output=out, seq_len=16)
    assert "nothing to do" in capsys.readouterr().err
    assert again.sources_hash == first.sources_hash and shard.stat().st_mtime_ns == before

    with pytest.raises(DataError, match=r"seq_len: 16 before, 32 now.*--overwrite"):
        prepare_data(inputs=[str(corpus)], output=out, seq_len=32)
    (corpus / "a.txt").write_text(TEXTS["a.txt"].replace("h", "j"), encoding="utf-8")  # same size, new content
    with pytest.raises(DataError, match="input files changed"):
        prepare_data(inputs=[str(corpus)], output=out, seq_len=16)
    assert load_manifest(out).seq_len == 16  # refused: nothing was touched

    replaced = prepare_data(inputs=[str(corpus)], output=out, seq_len=32, overwrite=True)
    assert load_manifest(out).seq_len == 32 and replaced.sources_hash != first.sources_hash
    assert sorted(p.name for p in (tmp_path / "out").glob("shard-*")) == [s.path for s in replaced.shards]


def test_huggingface_tokenizer_file(tmp_path, monkeypatch, ray_session):  # a HF tokenizer runs in Ray Data tasks
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from raytrain_fast.data import tokenizer as tokenizer_module

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    sentences = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"] * 5
    hf.train_from_iterator(sentences, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path / "tokenizer.json"
    hf.save(str(path))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    texts = ["the lazy fox packs a box", "five dozen dogs jump", "quick brown jugs"]
    for i, text in enumerate(texts):
        (corpus / f"{i}.txt").write_text(text)

    manifest = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "out"), seq_len=4, tokenizer=str(path))
    info = manifest.tokenizer
    assert info.kind == "hf" and info.vocab_size == hf.get_vocab_size() and info.eod_id == hf.token_to_id("<|endoftext|>")
    _, tokens = read_rows(manifest)
    stream = tokens.reshape(-1)
    pieces = np.split(stream, np.flatnonzero(stream == info.eod_id) + 1)
    decoded = [hf.decode(p[:-1].tolist()) for p in pieces if len(p) and p[-1] == info.eod_id]
    assert decoded == texts[: len(decoded)] and len(decoded) >= 2

    tokenizer_module._hf_tokenizer.cache_clear()
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if not installed
    with pytest.raises(DataError, match="pip install tokenizers"):
        prepare_data(inputs=[str(corpus)], output=str(tmp_path / "out2"), seq_len=4, tokenizer=str(path))
    with pytest.raises(DataError, match="cannot be read"):
        prepare_data(inputs=[str(corpus)], output=str(tmp_path / "out3"), seq_len=4, tokenizer=str(tmp_path / "none.json"))


def test_corpus_cache_prepares_once_and_notices_changes(tmp_path, monkeypatch, capsys):
    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    cache = str(tmp_path / "cache")
    uri = ensure_prepared_corpus(str(corpus), seq_len=16, cache_dir=cache)
    manifest_file = os.path.join(uri, MANIFEST_NAME)
    written = os.stat(manifest_file).st_mtime_ns
    assert "Preparing" in capsys.readouterr().err

    assert ensure_prepared_corpus(str(corpus), seq_len=16, cache_dir=cache) == uri
    assert os.stat(manifest_file).st_mtime_ns == written and capsys.readouterr().err == ""
    assert ensure_prepared_corpus(str(corpus), seq_len=8, cache_dir=cache) != uri  # seq_len is part of the key

    (corpus / "new.txt").write_text("a new file " * 10)
    assert ensure_prepared_corpus(str(corpus), seq_len=16, cache_dir=cache) == uri
    assert any(s.path.endswith("new.txt") for s in load_manifest(uri).sources)
    assert ensure_prepared_corpus(uri, seq_len=16, cache_dir=cache) == uri  # prepared data is used as is
    assert not [p for p in os.listdir(cache) if ".tmp-" in p or ".stale-" in p]

    from raytrain_fast.data import cache as cache_module
    from raytrain_fast.data.corpus import stdlib_files

    monkeypatch.setattr(cache_module, "stdlib_files", lambda: [p for p in stdlib_files() if p.name in ("this.py", "keyword.py")])
    stdlib = ensure_prepared_corpus("stdlib", seq_len=16, cache_dir=cache)
    assert os.path.basename(stdlib).startswith("stdlib-") and len(load_manifest(stdlib).sources) == 2
    with pytest.raises(DataError, match="does not exist"):
        ensure_prepared_corpus(str(tmp_path / "nope"), seq_len=16, cache_dir=cache)


def _decoded(stream: np.ndarray) -> list[str]:
    """The complete documents of a byte-token stream."""
    pieces = np.split(stream, np.flatnonzero(stream == EOD_TOKEN) + 1)
    return [bytes(p[:-1].astype(np.uint8)).decode("utf-8") for p in pieces if len(p) and p[-1] == EOD_TOKEN]


def _split_documents(manifest) -> tuple[list[str], list[str]]:
    """(training documents, validation documents) as stored in the shards."""
    _, train = read_rows(manifest)
    filesystem, root = resolve_filesystem(manifest.root, StorageConfig())
    val = [np.stack(pq.read_table(f"{root}/{s.path}", filesystem=filesystem).column("tokens").to_numpy(zero_copy_only=False))
           for s in manifest.validation.shards]
    return _decoded(train.reshape(-1)), _decoded(np.concatenate(val).reshape(-1))


def test_validation_split_is_disjoint_by_document_and_stable(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    records = [{"text": f"record {i}: " + "word " * (i % 9 + 2)} for i in range(300)]
    records += records[:20]  # duplicates: a document and its copy must land in the same split
    (corpus / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    first = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "a"), seq_len=8, val_fraction=0.1, parallel=False)
    train, val = _split_documents(first)
    assert val and not set(train) & set(val)  # no document in both splits
    unique = {r["text"] for r in records}
    assert set(train) | set(val) <= unique and len(unique - set(train) - set(val)) <= 2  # only the packing tails are cut
    assert first.validation.num_documents + first.num_documents == len(records)
    assert 0.03 < first.validation.num_documents / len(records) < 0.25  # about the fraction asked for
    assert first.validation.num_sequences == sum(s.num_rows for s in first.validation.shards) > 0

    again = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "b"), seq_len=8, val_fraction=0.1, parallel=False)
    assert _split_documents(again) == (train, val)  # preparing again chooses the same documents
    assert load_manifest(str(tmp_path / "a")).validation == first.validation

    (tmp_path / "held.txt").write_text(("a separate validation text " * 7)[:161])  # + EOD: 18 rows of 9
    separate = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "c"), seq_len=8, val_inputs=[str(tmp_path / "held.txt")])
    train_c, val_c = _split_documents(separate)
    assert separate.validation.method == "inputs" and val_c == [(tmp_path / "held.txt").read_text()]
    assert set(train_c) == unique  # with --val-input, every training document trains


def test_validation_split_bad_input_and_old_manifests(tmp_path):
    from raytrain_fast.config import load_config
    from raytrain_fast.errors import ConfigError
    from raytrain_fast.data.mixture import Source
    from raytrain_fast.launch.plan import resolve_eval

    corpus = tmp_path / "corpus"
    write_corpus(corpus)
    for bad in (0.0, 0.6, -0.1):
        with pytest.raises(DataError, match=r"--val-fraction must be in \(0, 0.5\], got"):
            prepare_data(inputs=[str(corpus)], output=str(tmp_path / "bad"), seq_len=8, val_fraction=bad)
    with pytest.raises(DataError, match="either --val-fraction .* or --val-input"):
        prepare_data(inputs=[str(corpus)], output=str(tmp_path / "bad"), seq_len=8, val_fraction=0.1, val_inputs=[str(corpus)])
    # Five documents: an explicit 1% chooses none. Asked for explicitly, that is an error naming the fix;
    # with the default, the data is prepared without a split and a warning.
    with pytest.raises(DataError, match="validation split came out empty.*raise --val-fraction"):
        prepare_data(inputs=[str(corpus)], output=str(tmp_path / "bad"), seq_len=8, val_fraction=0.01)
    old = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "old"), seq_len=8)
    assert old.validation is None

    # A manifest written before splits existed (no `validation` key) still loads and trains.
    path = tmp_path / "old" / MANIFEST_NAME
    data = json.loads(path.read_text())
    del data["validation"]
    path.write_text(json.dumps(data))
    manifest = load_manifest(str(tmp_path / "old"))
    assert manifest.validation is None and manifest.num_sequences == old.num_sequences
    config, notes = resolve_eval(load_config("tiny"), [Source(name="old", weight=1.0, manifest=manifest)])
    assert config.eval.enabled is False and config.checkpoint.best_metric == "train/loss"
    assert len(notes) == 1 and "no validation split" in notes[0]
    with pytest.raises(ConfigError, match="eval.enabled=true, but .* no validation split.*prepare-data"):
        resolve_eval(load_config("tiny", ["eval.enabled=true"]), [Source(name="old", weight=1.0, manifest=manifest)])

    split = prepare_data(inputs=[str(corpus)], output=str(tmp_path / "split"), seq_len=8, val_fraction=0.5)
    n = split.validation.num_sequences
    sources = [Source(name="split", weight=1.0, manifest=split)]
    with pytest.raises(ConfigError, match=rf"eval.sequences \({n + 1}\) is larger than the validation split of split \({n} sequences\)"):
        resolve_eval(load_config("tiny", ["eval.enabled=true", f"eval.sequences={n + 1}"]), sources)
    config, notes = resolve_eval(load_config("tiny", [f"eval.sequences={n + 1}"]), sources)  # auto: the whole split
    assert config.eval.enabled and config.eval.every_steps == 100 and config.checkpoint.best_metric == "val/loss"
    assert f"split ({n} sequences) holds fewer: evaluating all of it" in notes[0] and f"Eval: {n} validation sequences" in notes[1]
