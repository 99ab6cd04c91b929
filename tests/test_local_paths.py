"""Every local path a config names is made absolute against the driver's working directory before
anything leaves the driver (launch/checks.with_absolute_paths): the workers run in Ray Train's own
working directory, and the run config saved with each checkpoint must name the same files from any
directory. From a shell, with a mixture: tests/test_workflows_from_a_shell.py."""

from __future__ import annotations

import os

import pytest

from raytrain_fast.config import load_config
from raytrain_fast.launch.checks import with_absolute_paths
from raytrain_fast.launch.run_changes import run_changes

pytestmark = pytest.mark.unit

RELATIVE = [
    "storage.uri=runs", "data.source=corpus/*.txt", "data.tokenizer=tok", "data.val_input=val.jsonl.zst",
    "data.cache_dir=~/prepared", "checkpoint.init_from=../other/checkpoint_00000010",
]


def test_every_local_path_becomes_absolute_against_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = with_absolute_paths(load_config("tiny", [*RELATIVE, "data.sources=[{source: ./code, weight: 0.7}, {source: docs/, weight: 0.3}]"]))
    assert config.storage.uri == str(tmp_path / "runs")
    assert config.data.source == str(tmp_path / "corpus" / "*.txt")  # a glob stays a glob
    assert config.data.tokenizer == str(tmp_path / "tok")
    assert config.data.val_input == str(tmp_path / "val.jsonl.zst")
    assert config.data.cache_dir == os.path.expanduser("~/prepared")
    assert config.checkpoint.init_from == str(tmp_path.parent / "other" / "checkpoint_00000010")
    assert [s.source for s in config.data.sources] == [str(tmp_path / "code"), str(tmp_path / "docs")]
    assert with_absolute_paths(config) == config  # resolving twice changes nothing


def test_words_and_uris_stay_as_they_are(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    given = load_config("tiny", [
        "storage.uri=s3://bucket/runs", "data.source=stdlib", "data.tokenizer=byte", "data.cache_dir=file:///srv/prepared",
        "data.sources=[{source: stdlib, weight: 1}, {source: s3://bucket/code, weight: 1}]",
    ])
    assert with_absolute_paths(given) == given


def test_a_resume_compares_a_saved_relative_path_as_the_file_it_names(tmp_path, monkeypatch):
    """A run config saved with a path as typed (relative) and this command's absolute one are the same run."""
    monkeypatch.chdir(tmp_path)
    saved = load_config("tiny", ["data.source=corpus", "data.tokenizer=tok/tokenizer.json", "data.val_input=val"]).to_dict()
    current = with_absolute_paths(load_config("tiny", ["data.source=corpus", "data.tokenizer=tok/tokenizer.json", "data.val_input=val"]))
    assert run_changes(saved, current.to_dict()) == {}
    moved = with_absolute_paths(load_config("tiny", ["data.source=other", "data.tokenizer=tok/tokenizer.json", "data.val_input=val"]))
    assert [key for key, _, _ in run_changes(saved, moved.to_dict())["data"]] == ["data.source"]
