"""Each docs page against the code it describes: every drill, the metrics segment record, the tokenizers extra,
and the Python API (every name the docs use comes from the public surface, docs/api.md documents it all)."""

from __future__ import annotations

import json
import re
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


def _documented_python_names() -> dict[str, set[str]]:
    """Every `raytrain_fast` name the README and docs/*.md import or call: `from raytrain_fast[.x] import a, b`
    (the module it is imported from -> names) and `raytrain_fast.x.f(` (the module -> f)."""
    found: dict[str, set[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for module, names in re.findall(r"from (raytrain_fast[\w.]*) import ([\w, ]+)", text):
            found.setdefault(module, set()).update(n.strip() for n in names.split(",") if n.strip())
        for dotted in re.findall(r"(?<![\w/-])(raytrain_fast(?:\.\w+)+)\(", text):
            module, _, name = dotted.rpartition(".")
            found.setdefault(module, set()).add(name)
    return found


def test_every_python_name_the_docs_use_comes_from_the_public_surface():
    import raytrain_fast

    documented = _documented_python_names()
    assert {"load_exported", "read_metrics", "pretrain", "LoopHooks"} <= documented.get("raytrain_fast", set()), documented
    elsewhere = {module: names for module, names in documented.items() if module != "raytrain_fast"}
    assert not elsewhere, f"the docs import from internal modules: {elsewhere} (import from raytrain_fast)"
    missing = sorted(documented["raytrain_fast"] - set(raytrain_fast.__all__))
    assert not missing, f"the docs use names raytrain_fast does not export: {missing}"
    for name in documented["raytrain_fast"]:
        assert getattr(raytrain_fast, name) is not None


def test_the_api_page_documents_every_public_name_and_the_surface_imports_no_torch():
    import subprocess
    import sys

    import raytrain_fast

    page = (ROOT / "docs" / "api.md").read_text()
    undocumented = [name for name in raytrain_fast.__all__ if f"`{name}" not in page]
    assert not undocumented, f"docs/api.md does not document {undocumented}"
    code = "import sys, raytrain_fast; print(sorted(m for m in ('torch', 'ray', 'deepspeed') if m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
