"""What the command line prints, as a user reads it (issue 33's trial): nothing that contradicts what
happened, nothing from the Python API, no library chatter."""

from __future__ import annotations

import json

from raytrain_fast.cli import main


def test_prepare_data_does_not_call_a_used_jsonl_file_skipped(tmp_path, capsys):
    good = [json.dumps({"text": f"document number {i} " * 8}) for i in range(4)]
    (tmp_path / "d.jsonl").write_text("\n".join([good[0], "not json", good[1], "{}", '{"text": ""}', *good[2:]]) + "\n")
    assert main(["prepare-data", "--input", str(tmp_path / "d.jsonl"), "--output", str(tmp_path / "data"), "--seq-len", "8"]) == 0
    err = capsys.readouterr().err
    assert "skipped 1 input" not in err, err  # the file was used
    line = next(line for line in err.splitlines() if "JSONL records skipped" in line)
    assert "used " in line and "d.jsonl" in line and "3 JSONL records skipped" in line, line
    assert ", 0 skipped," in err or " skipped," not in err  # the progress line counts no skipped file


def test_prepare_data_over_other_data_names_the_flag_not_the_python_argument(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("some text to prepare " * 20)
    (tmp_path / "b.txt").write_text("other text to prepare " * 20)
    out = str(tmp_path / "data")
    assert main(["prepare-data", "--input", str(tmp_path / "a.txt"), "--output", out, "--seq-len", "8"]) == 0
    capsys.readouterr()
    assert main(["prepare-data", "--input", str(tmp_path / "b.txt"), "--output", out, "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "overwrite=True" not in err, err
