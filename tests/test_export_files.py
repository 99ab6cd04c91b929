"""What an export writes, without a training run: the tokenizer files (plain JSON, no `tokenizers`
import; checked against the library here) and the folder written aside and moved into place.
A whole export from a shell, without the `tokenizers` extra: tests/test_workflows_from_a_shell.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raytrain_fast.checkpoint.export import _staged
from raytrain_fast.data.hf_tokenizer import BYTE_EOD_TEXT, byte_tokenizer_json, hf_tokenizer_files, token_text
from raytrain_fast.data.tokenizer import byte_tokenizer, load_tokenizer

pytestmark = pytest.mark.unit

TEXT = "def f(x):\n\treturn x  # naïve 価格 \x00\x7f é\u200b" + "".join(chr(c) for c in range(32, 600, 7))


def test_the_byte_tokenizer_file_encodes_every_byte_to_its_own_id():
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer.from_str(byte_tokenizer_json())
    assert tokenizer.encode(TEXT, add_special_tokens=False).ids == list(TEXT.encode())
    assert tokenizer.decode(list(TEXT.encode())) == TEXT
    assert tokenizer.token_to_id(BYTE_EOD_TEXT) == 256 and tokenizer.get_vocab_size(with_added_tokens=True) == 257
    assert tokenizer.encode(f"a{BYTE_EOD_TEXT}b", add_special_tokens=False).ids == [97, 256, 98]


def test_tokenizer_files_name_the_end_of_document_token_as_eos_and_pad(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors, trainers

    bpe = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    bpe.train_from_iterator([TEXT] * 20, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    bpe.save(str(tmp_path / "tokenizer.json"))
    spec = load_tokenizer(str(tmp_path / "tokenizer.json"))
    files = hf_tokenizer_files(spec, model_max_length=64)
    special = json.loads(files["special_tokens_map.json"])
    # A <s> before each text is how such a family trains: the data puts it before every document, the export keeps it.
    assert special == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>"} and spec.info.eod_id == bpe.token_to_id("</s>")
    assert spec.info.bos_id == bpe.token_to_id("<s>") and json.loads(files["tokenizer.json"])["post_processor"] is not None
    assert json.loads(files["tokenizer_config.json"])["pad_token"] == "</s>"
    bpe.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])  # not a BOS
    bpe.save(str(tmp_path / "tokenizer.json"))
    other = hf_tokenizer_files(load_tokenizer(str(tmp_path / "tokenizer.json")), model_max_length=64)
    assert json.loads(other["tokenizer.json"])["post_processor"] is None  # no token the model never saw there
    assert json.loads(other["special_tokens_map.json"]) == {"eos_token": "</s>", "pad_token": "</s>"}
    word = next(t for t in bpe.get_vocab() if len(t) > 1)
    assert token_text(files["tokenizer.json"], bpe.token_to_id(word)) == word  # from the vocabulary
    byte = json.loads(hf_tokenizer_files(byte_tokenizer(), model_max_length=None)["special_tokens_map.json"])
    assert byte == {"eos_token": BYTE_EOD_TEXT, "pad_token": BYTE_EOD_TEXT}


def _write(folder: str, names: list[str]) -> None:
    for name in names:
        Path(folder, name).write_text(name)


def test_an_export_folder_appears_whole_or_not_at_all(tmp_path):
    out = tmp_path / "new" / "export"
    with pytest.raises(RuntimeError):
        with _staged(str(out)) as staging:
            _write(staging, ["model.safetensors"])
            raise RuntimeError("the export failed half-way")
    assert not out.exists() and list((tmp_path / "new").iterdir()) == []
    with _staged(str(out)) as staging:
        _write(staging, ["model.safetensors", "config.yaml"])
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors"]


def test_an_export_into_a_folder_with_other_files_replaces_only_the_exports(tmp_path):
    _write(str(tmp_path), ["notes.txt", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                           "model.safetensors.index.json", "config.json"])
    with pytest.raises(KeyboardInterrupt):
        with _staged(str(tmp_path)) as staging:
            _write(staging, ["model.safetensors"])
            raise KeyboardInterrupt
    assert len(list(tmp_path.iterdir())) == 5  # as it was: nothing removed, nothing left behind
    with _staged(str(tmp_path)) as staging:
        _write(staging, ["model.safetensors", "config.json", "config.yaml"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "config.yaml", "model.safetensors", "notes.txt"]
