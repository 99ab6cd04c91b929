"""What a new user meets first: every config problem in one message with
suggestions that themselves validate, a resume that would silently change the run refused, a
validation split `pretrain` can ask for, and the checkpoint saved / resume-from-step lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from raytrain_fast.checkpoint import list_runs
from raytrain_fast.cli import main
from raytrain_fast.config import load_config, presets, validate
from raytrain_fast.errors import ConfigError
from raytrain_fast.storage import StorageConfig

pytestmark = pytest.mark.unit


def _problems(config_name: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(load_config(config_name, overrides))
    return str(caught.value)


@pytest.mark.parametrize("preset", sorted(presets()))
@pytest.mark.parametrize("workers", ["4-1", "1-4", "3-x"])
def test_a_worker_count_suggestion_validates_for_the_config_at_hand(preset, workers):
    try:
        validate(load_config(preset, [f"resources.num_workers={workers}"]))
        return  # nothing to suggest
    except ConfigError as error:
        message = str(error)
    suggestions = re.findall(r"e\.g\. ((?:--set [\w.=-]+ ?)+)", message)
    assert suggestions, message
    for suggestion in suggestions:
        overrides = re.findall(r"--set ([\w.=-]+)", suggestion)
        validate(load_config(preset, [f"resources.num_workers={workers}", *overrides]))  # raises if it does not fit


def test_elastic_and_batch_problems_come_in_one_message():
    message = _problems("tiny", ["resources.num_workers=1-4"])
    assert "(2 problems)" in message
    assert "16 x 4 = 64" in message and "cannot be kept on 3 worker(s)" in message


def _complete_checkpoints(run: Path, steps: list[int], *, saved_config: dict) -> None:
    from raytrain_fast.checkpoint.rank_manifest import write_rank_manifest

    for step in steps:
        checkpoint = run / f"checkpoint_{step:08d}"
        checkpoint.mkdir(parents=True)
        (checkpoint / "train_state.json").write_text(json.dumps({"step": step, "world_size": 1, "precision": "fp32"}))
        (checkpoint / "config.yaml").write_text(yaml.safe_dump(saved_config))
        write_rank_manifest(str(checkpoint), rank=0, world_size=1, step=step)


def test_resume_from_a_step_sets_the_later_checkpoints_aside(tmp_path, monkeypatch, capsys):
    """checkpoint.resume=<step>: that checkpoint is the one resumed; the later ones are moved out of
    the run's checkpoint list (so retention and a restart never mix them with the new saves), kept."""
    monkeypatch.chdir(tmp_path)
    saved = load_config("tiny").to_dict()
    _complete_checkpoints(tmp_path / "runs" / "tiny", [100, 200, 300], saved_config=saved)
    code = main(["pretrain", "--set", "storage.uri=runs", "--resume", "100", "--set", "train.steps=100",
                 "--set", "optim.warmup_steps=10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert re.search(r"checkpoint.resume=100: moved the 2 later checkpoint\(s\) \(steps 200, 300\) to .*set-aside-", out)
    assert "checkpoint at step 100" in out
    [run] = [r for r in list_runs(str(tmp_path / "runs"), StorageConfig()) if r.name == "tiny"]
    assert [c.step for c in run.checkpoints] == [100]
    [aside] = (tmp_path / "runs" / "tiny").glob("set-aside-*")
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoint_00000200", "checkpoint_00000300"]
    assert (aside / "checkpoint_00000300" / "train_state.json").is_file()


def test_model_and_tokenizer_changes_are_listed_and_can_be_allowed(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    saved = load_config("tiny").to_dict()
    saved["model"]["num_layers"], saved["model"]["activation_checkpointing"] = 2, "full"  # the latter may change
    saved["data"]["tokenizer"] = "/old/tokenizer.json"
    _complete_checkpoints(tmp_path / "runs" / "tiny", [300], saved_config=saved)
    assert main(["pretrain", "--set", "storage.uri=runs"]) == 2
    err = capsys.readouterr().err
    assert "other tokenizer and model settings" in err
    assert "data.tokenizer: '/old/tokenizer.json' -> 'byte'" in err and "model.num_layers: 2 -> 4" in err
    assert "activation_checkpointing" not in err and "checkpoint.allow_changes=tokenizer,model" in err
    assert main(["pretrain", "--set", "storage.uri=runs", "--set", "checkpoint.allow_changes=tokenizer,model"]) == 0
    out = capsys.readouterr().out
    assert "Resuming with changed model settings (checkpoint.allow_changes): model.num_layers: 2 -> 4" in out


def test_pretrain_can_ask_for_the_validation_split_its_warning_names(tmp_path, capsys):
    """A corpus of one document prepared on the fly: the default share holds nothing out, and the
    warning names pretrain's own keys; data.val_fraction or data.val_input then give a split."""
    from raytrain_fast.data import ensure_prepared_corpus, load_manifest

    one = tmp_path / "one.txt"
    one.write_text("A single document, repeated. " * 40)
    plain = ensure_prepared_corpus(str(one), seq_len=16, cache_dir=str(tmp_path / "cache"))
    assert load_manifest(plain).validation is None
    warning = capsys.readouterr().err
    assert "Data: warning:" in warning and "raise data.val_fraction" in warning and "set data.val_input" in warning
    assert "--val-fraction" not in warning

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):  # the content decides which documents are held out: fixed here
        (corpus / f"doc{i}.txt").write_text(f"Document number {i} of a small corpus, line {i * 7}. " * 10)
    config = load_config("tiny", [f"data.source={corpus}", "data.seq_len=16", "data.val_fraction=0.5"])
    validate(config)
    split = ensure_prepared_corpus(str(corpus), seq_len=16, cache_dir=str(tmp_path / "cache"), val_fraction=config.data.val_fraction)
    validation = load_manifest(split).validation
    assert validation is not None and validation.fraction == 0.5 and validation.num_documents >= 3

    config = load_config("tiny", [f"data.source={one}", "data.seq_len=16", f"data.val_input={corpus}/doc0.txt"])
    validate(config)
    separate = ensure_prepared_corpus(str(one), seq_len=16, cache_dir=str(tmp_path / "cache"), val_input=config.data.val_input)
    assert separate != plain and load_manifest(separate).validation.method == "inputs"


def test_prepare_data_suggests_a_run_of_its_own(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("Some text to train on. " * 40)
    assert main(["prepare-data", "--input", str(tmp_path / "a.txt"), "--output", str(tmp_path / "my data"), "--seq-len", "16"]) == 0
    hint = re.search(r"Train on it: raytrain-fast (pretrain .*)", capsys.readouterr().out).group(1)
    assert "--name my-data-run" in hint
    import shlex

    from raytrain_fast.cli import build_parser

    args = build_parser().parse_args(shlex.split(hint))  # quoted for a shell: the path's space stays in it
    assert args.name == "my-data-run" and f"data.source={tmp_path}/my data" in args.overrides
