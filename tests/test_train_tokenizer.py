"""`raytrain-fast train-tokenizer`: a byte-level BPE trained on prepare-data's input forms, written as
a directory that `transformers.AutoTokenizer` loads and that `prepare-data --tokenizer <dir>` takes.

No downloads: every corpus is written by the test. prepare-data runs in this process (a Hugging Face
tokenizer would otherwise start Ray Data tasks; the tokens are the same, see test_data_prepare)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.e2e

pytest.importorskip("tokenizers")

from raytrain_fast.cli import main  # noqa: E402
from raytrain_fast.config.data import EOD_TOKEN  # noqa: E402
from raytrain_fast.data.hf_tokenizer import BYTE_EOD_TEXT, hf_tokenizer_files  # noqa: E402
from raytrain_fast.data.tokenizer import byte_tokenizer, load_tokenizer  # noqa: E402
from raytrain_fast.data.train_tokenizer import train_tokenizer  # noqa: E402
from raytrain_fast.errors import DataError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 320  # 257 (bytes + end-of-document) + 63 merges: the corpus below has many more pairs than that
SAMPLES = [
    "the quick brown fox jumps over the lazy dog",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "héllo wörld: café, naïve, Ångström",
    "日本語のテキスト 中文 한국어",
    "emoji 🙂🚀 and symbols ∑∫√ ≠ ≤",
    "a word the corpus never had: zyzzyva",
    "",
]


def _words(rng: random.Random, n: int) -> str:
    syllables = ["ka", "to", "ri", "mu", "sen", "lo", "the", "and", "ing", "er", "qu", "é", "ö"]
    return " ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(n))


def write_corpus(root: Path) -> dict[str, list[str]]:
    """Plain-text files, a JSONL file (one bad record), a binary and a hidden file: the forms prepare-data reads."""
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    texts = {}
    for i in range(4):
        texts[f"doc{i}.txt"] = [_words(rng, 600) + "\n"]
        (root / f"doc{i}.txt").write_text(texts[f"doc{i}.txt"][0], encoding="utf-8")
    records = [_words(rng, 40) + " 你好 🙂" for _ in range(30)]
    lines = [json.dumps({"text": r}) for r in records] + ["not json", json.dumps({"title": "no text field"})]
    (root / "records.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    texts["records.jsonl"] = records
    (root / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    (root / ".hidden.txt").write_text("never read " * 50)
    return texts


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, "-m", "raytrain_fast.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd, env=env)


@contextlib.contextmanager
def _tokenizing_in_process(monkeypatch):
    """prepare-data tokenizes a HF tokenizer's inputs in Ray Data tasks; here in this process instead."""
    from raytrain_fast.data import prepare

    monkeypatch.setattr(prepare, "results_ray", prepare.results_local)
    monkeypatch.setattr(prepare, "ray_running", contextlib.nullcontext)
    yield


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, dict[str, list[str]], subprocess.CompletedProcess]:
    """(tokenizer dir, corpus dir, corpus texts, the finished command) of one train-tokenizer run from a fresh shell."""
    tmp = tmp_path_factory.mktemp("train-tokenizer")
    texts = write_corpus(tmp / "corpus")
    done = _cli("train-tokenizer", "--input", "corpus", "--output", "tok", "--vocab-size", str(VOCAB), cwd=tmp)
    assert done.returncode == 0, done.stderr
    return tmp / "tok", tmp / "corpus", texts, done


def test_the_command_writes_a_tokenizer_that_transformers_loads(trained):
    transformers = pytest.importorskip("transformers")
    out, _, texts, done = trained
    assert sorted(p.name for p in out.iterdir()) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["eos_token"] == BYTE_EOD_TEXT

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    # The vocabulary is exactly what was asked (this corpus has more than enough pairs to merge).
    assert len(tokenizer) == VOCAB
    # The package's end-of-document token at the byte tokenizer's id.
    assert tokenizer.eos_token == BYTE_EOD_TEXT and tokenizer.eos_token_id == EOD_TOKEN == 256
    # Ids round-trip text, the corpus's and text it never saw, with no BOS/EOS added.
    for text in SAMPLES + [texts["doc0.txt"][0], texts["records.jsonl"][3]]:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids) == text
        assert EOD_TOKEN not in ids and all(0 <= i < VOCAB for i in ids)
    # It learned merges: corpus text takes far fewer tokens than bytes.
    corpus_text = texts["doc1.txt"][0]
    assert len(tokenizer(corpus_text)["input_ids"]) < 0.6 * len(corpus_text.encode())
    # The byte tokenizer's layout: the token of byte b has id b.
    byte_vocab = json.loads(hf_tokenizer_files(byte_tokenizer(), model_max_length=None)["tokenizer.json"])["model"]["vocab"]
    assert all(tokenizer.convert_tokens_to_ids(char) == b for char, b in byte_vocab.items())

    # The progress and summary lines, prepare-data's style; the skipped inputs with their reasons.
    assert "train-tokenizer: 6/6 files" in done.stderr  # 4 texts, the JSONL and the binary; the hidden file is skipped unread
    assert f"train-tokenizer: a byte-level BPE of {VOCAB} tokens in {out}, from 5 files (34 documents" in done.stderr
    assert done.stderr.count("train-tokenizer: 6/6 files") == 1  # the progress once, not again at the end
    assert "binary file" in done.stderr and "hidden file" in done.stderr and "2 JSONL records skipped" in done.stderr
    assert "--tokenizer tok" in done.stdout and "model.vocab_size=320" in done.stdout  # 320: a multiple of 64


def test_prepare_data_takes_the_directory(trained, tmp_path, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    out, corpus, texts, _ = trained
    data = tmp_path / "data"
    with _tokenizing_in_process(monkeypatch):
        code = main(["prepare-data", "--input", str(corpus / "doc0.txt"), str(corpus / "records.jsonl"), "--output", str(data),
                     "--seq-len", "32", "--tokenizer", str(out)])
    assert code == 0, capsys.readouterr().err
    manifest = json.loads((data / "manifest.json").read_text())
    info = manifest["tokenizer"]
    assert info["kind"] == "hf" and info["name"] == str(out)
    assert info["vocab_size"] == VOCAB and info["eod_id"] == EOD_TOKEN
    assert info["hash"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    assert manifest["num_sequences"] > 0 and manifest["max_token_id"] < VOCAB

    # The shards hold the tokenizer's ids of the documents, each ended by 256, in input order.
    rows = pq.read_table(data / manifest["shards"][0]["path"]).column("tokens").to_pylist()
    stream = np.concatenate([np.asarray(r) for r in rows])
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    first = tokenizer(texts["doc0.txt"][0])["input_ids"]
    assert list(stream[: len(first)]) == first and stream[len(first)] == EOD_TOKEN

    # A model of the tokenizer's size takes this data; one of the byte vocabulary is refused with the fix.
    from raytrain_fast.data import check_manifest_matches, load_manifest

    loaded = load_manifest(str(data))
    assert check_manifest_matches(loaded, seq_len=32, vocab_size=VOCAB) == []
    problems = check_manifest_matches(loaded, seq_len=32, vocab_size=257)
    assert problems and f"{VOCAB} tokens" in problems[0]
    # pretrain's data.tokenizer takes the directory too (config validation).
    assert main(["show-config", "--set", f"data.tokenizer={out}"]) == 0


def test_an_hf_export_directory_is_a_tokenizer(tmp_path):
    """What `export --format hf` writes (here the byte tokenizer's files) is a tokenizer for prepare-data:
    the same identity as its tokenizer.json, which prepare-data took before."""
    export = tmp_path / "export"
    export.mkdir()
    for name, text in hf_tokenizer_files(byte_tokenizer(), model_max_length=128).items():
        (export / name).write_text(text)
    (export / "config.json").write_text("{}")
    from_dir, from_file = load_tokenizer(str(export)), load_tokenizer(str(export / "tokenizer.json"))
    assert from_dir.info.identity() == from_file.info.identity()
    assert (from_dir.info.vocab_size, from_dir.info.eod_id) == (257, EOD_TOKEN)
    assert list(from_dir.encode_documents(["hé".encode()])) == [104, 195, 169, EOD_TOKEN]

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError, match="is a directory without a tokenizer.json"):
        load_tokenizer(str(empty))


def test_a_directory_names_its_own_end_of_document_token(tmp_path):
    """A tokenizer whose eos is none of EOD_CANDIDATES: its directory's tokenizer_config.json names it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate("abc")}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|my_eos|>"])
    (tmp_path / "tokenizer.json").write_text(hf.to_str())
    with pytest.raises(DataError, match="no end-of-document token"):
        load_tokenizer(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|my_eos|>"}}))
    assert load_tokenizer(str(tmp_path)).info.eod_id == 3


def test_options_inputs_and_a_small_corpus(tmp_path, capsys):
    corpus = tmp_path / "in"
    texts = write_corpus(corpus)
    # The output inside the input directory is never read as input; a second run needs --overwrite.
    out = corpus / "tok"
    first = train_tokenizer(inputs=[str(corpus)], output=str(out), vocab_size=300, eod_token="</s>", verbose=False)
    assert (first.num_files, first.num_documents) == (5, 4 + len(texts["records.jsonl"]))
    assert {s.reason.split(" (")[0] for s in first.skipped} >= {"binary file", "hidden file"}
    with pytest.raises(DataError, match="already holds a tokenizer .*--overwrite"):
        train_tokenizer(inputs=[str(corpus)], output=str(out), vocab_size=300, verbose=False)
    again = train_tokenizer(inputs=[str(corpus)], output=str(out), vocab_size=300, eod_token="</s>", overwrite=True, verbose=False)
    assert (again.num_files, again.vocab_size) == (5, 300)
    spec = load_tokenizer(str(out))  # prepare-data finds </s> as the end-of-document token, at 256
    assert spec.info.eod_id == EOD_TOKEN and spec.info.vocab_size == 300

    # A corpus too small for the vocabulary asked: fewer tokens, and the summary says why.
    (tmp_path / "small.txt").write_text("abab abab cdcd")
    small = train_tokenizer(inputs=[str(tmp_path / "small.txt")], output=str(tmp_path / "small"), vocab_size=1000)
    assert 257 < small.vocab_size < 1000 and small.asked_vocab_size == 1000
    assert "asked for 1,000" in capsys.readouterr().err

    # Only unusable inputs: an error after reading them, naming why each was skipped.
    with pytest.raises(DataError, match="(?s)no usable text.*binary file"):
        train_tokenizer(inputs=[str(corpus / "blob.bin")], output=str(tmp_path / "none"), verbose=False)
    assert not (tmp_path / "none").exists()
