"""Each docs page against the code it describes: every drill, the metrics segment record, the tokenizers extra."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def test_errors_page_lists_every_drill():
    from raytrain_fast.drills.specs import PARSERS

    row = next(line for line in (ROOT / "docs" / "errors.md").read_text().splitlines() if line.startswith("| `bad-drill`"))
    missing = [name for name in PARSERS if name not in row]
    assert not missing, f"docs/errors.md's bad-drill row leaves out {missing}"


def test_metrics_page_describes_the_segment_record(tmp_path):
    from raytrain_fast.metrics.sinks import JsonlSink

    sink = JsonlSink(str(tmp_path), start_step=0)
    sink.log({"train/loss": 1.0}, 1)
    sink.close()
    first = json.loads(next(tmp_path.rglob("*.jsonl")).read_text().splitlines()[0])
    (key, header), = first.items()
    text = (ROOT / "docs" / "metrics.md").read_text()
    assert f'{{"{key}": {{' in text and all(f'"{field}"' in text for field in header), header


def test_data_page_names_the_tokenizers_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "tokenizers" in extras
    assert ".[tokenizers]" in (ROOT / "docs" / "data.md").read_text()
