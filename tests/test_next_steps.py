"""The next-step commands printed after prepare-data and train-tokenizer parse as the command line
reads them and validate for every vocabulary and window (tests/test_printed_commands.py runs them)."""

from __future__ import annotations

import shlex

import pytest

from raytrain_fast.cli import build_parser
from raytrain_fast.config import load_config, validate
from raytrain_fast.next_steps import model_vocab_size, prepare_command, train_command

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("vocab_size", [257, 400, 32000, 50257])
@pytest.mark.parametrize("seq_len", [32, 128, 1024])
def test_the_train_command_validates_for_the_data_it_names(vocab_size, seq_len, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my data").mkdir()  # validation checks that the source exists
    words = shlex.split(train_command(data="./my data", seq_len=seq_len, vocab_size=vocab_size))
    args = build_parser().parse_args(words[1:])
    assert args.command == "pretrain" and args.name == "my-data-run"
    config = load_config(args.config, args.overrides, name=args.name)
    validate(config)
    assert config.data.source == "./my data" and config.data.seq_len == seq_len
    assert config.model.vocab_size >= vocab_size and config.model.vocab_size % 64 == 0
    assert config.model.max_seq_len >= seq_len


def test_data_in_a_bucket_carries_the_endpoint_it_was_written_with():
    command = train_command(data="s3://bucket/data", seq_len=128, vocab_size=257,
                            storage={"endpoint_url": "http://127.0.0.1:9000", "region": None, "profile": None})
    config = load_config(None, build_parser().parse_args(shlex.split(command)[1:]).overrides)
    assert config.storage.endpoint_url == "http://127.0.0.1:9000" and config.storage.region is None


def test_the_prepare_command_takes_the_preset_window_the_tokenizer_and_the_text_field():
    words = shlex.split(prepare_command(inputs=["a dir", "b.parquet"], output="my tok-data", tokenizer="my tok",
                                        text_field="content,text"))
    args = build_parser().parse_args(words[1:])
    assert args.input == ["a dir", "b.parquet"] and args.output == "my tok-data" and args.tokenizer == "my tok"
    assert args.seq_len == load_config("tiny").data.seq_len and args.text_field == "content,text"
    assert model_vocab_size(300) == 320 and model_vocab_size(320) == 320 and model_vocab_size(321) == 384


@pytest.mark.parametrize("sequences", [1, 6, 15, 16, 100_000])
def test_the_train_command_fits_the_micro_batch_to_a_corpus_of_fewer_sequences_than_one(sequences, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    words = shlex.split(train_command(data="./data", seq_len=128, vocab_size=257, num_sequences=sequences))
    args = build_parser().parse_args(words[1:])
    config = load_config(args.config, args.overrides, name=args.name)
    validate(config)  # the global batch still splits into micro-batches x accumulation
    preset = load_config("tiny").train.micro_batch
    assert config.train.micro_batch == (preset if sequences >= preset else max(m for m in (1, 2, 4, 8) if m <= sequences))
