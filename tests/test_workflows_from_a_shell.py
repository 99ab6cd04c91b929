"""Workflows typed as a user types them, in a fresh shell, from the project's own directory with
relative paths (tests/shell.py).

- A mixture (data.sources): the workers run in Ray Train's working directory, not the shell's, so
  every local path must reach them absolute; sources of every kind data.source takes (prepared
  datasets, `.jsonl.zst` / `.jsonl.gz` files, text) train as a mixture. Its weights changed on a
  resume are refused in seconds, before Ray starts, and with checkpoint.allow_changes=data the run
  trains on under the new weights, the report showing both stretches.
- A damaged prepared dataset found by a worker ends the run in one attempt, exit 2 (an error that
  will repeat is not retried: tests/test_errors_that_repeat.py).
- `export --format hf` from the README's install, without the `tokenizers` extra, loads in
  transformers and pads a batch; an export that fails leaves nothing behind.

The training commands join one head node started from a fresh shell for this file (`RAY_ADDRESS`, as
on a cluster; tests/shell.py's RayHead), so Ray starts once, not once per command.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import yaml

from tests.shell import SETS, package_texts, shell, without_modules

pytestmark = [pytest.mark.slow, pytest.mark.e2e]


def _saved_run_config(runs: Path, name: str) -> dict:
    [checkpoint] = sorted(p for p in (runs / name).glob("checkpoint_*") if p.is_dir())[-1:]
    return yaml.safe_load((checkpoint / "config.yaml").read_text())


def _jsonl_zst(path: Path, package: str) -> None:
    import importlib

    import pyarrow as pa

    folder = Path(importlib.import_module(package).__file__).parent
    path.parent.mkdir(parents=True, exist_ok=True)
    with pa.CompressedOutputStream(str(path), "zstd") as out:
        for source in sorted(folder.glob("*.py")):
            out.write((json.dumps({"text": source.read_text()}) + "\n").encode())


def test_a_mixture_of_a_relative_prepared_directory_and_a_jsonl_zst_file_trains_from_the_project_directory(tmp_path, ray_head):
    """Both kinds of source in one mixture, named relative to the project directory: a dataset made by
    prepare-data and a `.jsonl.zst` file prepared on the fly into a relative data.cache_dir."""
    project, home = tmp_path / "project", tmp_path / "home"
    package_texts(project / "texts" / "code", "email")
    _jsonl_zst(project / "corpora" / "docs.jsonl.zst", "json")
    prepared = shell("raytrain-fast prepare-data --input texts/code --output data/code --seq-len 32", cwd=project, home=home)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    done = shell(
        f"raytrain-fast pretrain --name mix {SETS} --set storage.uri=runs --set data.cache_dir=cache "
        "--set 'data.sources=[{source: ./data/code, weight: 0.7}, {source: corpora/docs.jsonl.zst, weight: 0.3}]'",
        cwd=project, home=home, env=ray_head.env,
    )
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown
    assert "code 70% (" in shown and "docs.jsonl.zst 30% (" in shown
    assert "Done. Run directory:" in shown and "Traceback" not in shown
    prepared_on_the_fly = sorted(p.name for p in (project / "cache").iterdir())
    assert [p.split("-seq32-")[0] for p in prepared_on_the_fly] == ["docs.jsonl.zst"], prepared_on_the_fly
    saved = _saved_run_config(project / "runs", "mix")
    sources = [str(project / "data" / "code"), str(project / "corpora" / "docs.jsonl.zst")]
    assert [s["source"] for s in saved["data"]["sources"]] == sources
    assert saved["storage"]["uri"] == str(project / "runs") and saved["data"]["cache_dir"] == str(project / "cache")

    # An annealing phase on another mix: the same run, on to step 8 with other weights.
    anneal = (f"raytrain-fast pretrain --name mix {SETS} --set storage.uri=runs --set data.cache_dir=cache --set train.steps=8 "
              "--set 'data.sources=[{source: ./data/code, weight: 0.3}, {source: corpora/docs.jsonl.zst, weight: 0.7}]'")
    started = time.monotonic()
    refused = shell(anneal, cwd=project, home=home, env=ray_head.env)
    seconds, shown = time.monotonic() - started, refused.stdout + refused.stderr
    assert refused.returncode == 2 and seconds < 30, (seconds, shown)  # before Ray starts or a checkpoint downloads
    assert "data.sources: code 0.7, docs.jsonl.zst 0.3 -> code 0.3, docs.jsonl.zst 0.7" in refused.stderr, shown
    assert "--set checkpoint.allow_changes=data" in refused.stderr and "Resumed from checkpoint" not in shown, shown
    done = shell(f"{anneal} --set checkpoint.allow_changes=data", cwd=project, home=home, env=ray_head.env)
    shown = done.stdout + done.stderr
    assert done.returncode == 0 and "The mixture changes at step 4" in shown and "Done. Run directory:" in shown, shown
    report = shell("raytrain-fast report --storage runs --name mix", cwd=project, home=home)
    stretches = report.stdout.split("Mixture (realised to step ")[1:]
    assert report.returncode == 0 and len(stretches) == 2, report.stdout + report.stderr
    assert stretches[0].startswith("4 ") and "code: weight 70%" in stretches[0], report.stdout
    assert stretches[1].startswith("8 ") and "steps 4-8" in stretches[1] and "code: weight 30%" in stretches[1], report.stdout


def _damage_the_only_shard(data: Path) -> Path:
    [shard] = data.glob("shard-*.parquet")
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut short
    return shard


def test_a_damaged_shard_ends_the_run_in_one_attempt_with_exit_2(tmp_path, ray_head):
    project, home = tmp_path / "project", tmp_path / "home"
    package_texts(project / "texts", "email")
    prepared = shell("raytrain-fast prepare-data --input texts --output data --seq-len 32", cwd=project, home=home)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    shard = _damage_the_only_shard(project / "data")
    done = shell(f"raytrain-fast pretrain --name damaged {SETS} --set resources.max_failures=3 "
                 "--set data.source=data --set storage.uri=runs", cwd=project, home=home, env=ray_head.env)
    shown = done.stdout + done.stderr
    assert done.returncode == 2, shown
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("raytrain-fast: error: the prepared data's shard") and str(shard.resolve()) in last, shown
    assert "prepare-data" in last  # the fix
    assert "Traceback" not in shown and "max_errored_blocks" not in shown, shown
    workers = set(re.findall(r"\(RayTrainWorker pid=(\d+)", shown))
    assert len(workers) == 1, f"one attempt, one worker process; saw {sorted(workers)}:\n{shown}"


def _leftovers(project: Path) -> list[str]:
    return sorted(p.name for p in project.iterdir() if "export" in p.name)


def test_an_hf_export_without_the_tokenizers_extra_loads_in_transformers_and_pads_a_batch(tmp_path, ray_head):
    project, home = tmp_path / "project", tmp_path / "home"
    project.mkdir()
    trained = shell(f"raytrain-fast pretrain --config llama-tiny --name lt {SETS} --set storage.uri=runs", cwd=project, home=home,
                    env=ray_head.env)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    export = "raytrain-fast export --storage runs --name lt --out exported --format hf"

    failed = shell(export, cwd=project, home=home, env=without_modules(tmp_path / "site", "safetensors"))  # fails mid-way
    assert failed.returncode != 0 and "safetensors" in failed.stderr, failed.stdout + failed.stderr
    assert _leftovers(project) == [], "a failed export leaves nothing behind"

    done = shell(export, cwd=project, home=home, env=without_modules(tmp_path / "site", "tokenizers"))
    assert done.returncode == 0, done.stdout + done.stderr  # no --overwrite needed after the failure
    assert _leftovers(project) == ["exported"]

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(project / "exported")
    model = AutoModelForCausalLM.from_pretrained(project / "exported").eval()
    assert tokenizer.pad_token is not None and tokenizer.pad_token_id < model.config.vocab_size
    texts = ["def f(x):", "import os\nprint(os.getcwd())"]
    assert tokenizer(texts[0])["input_ids"] == list(texts[0].encode())  # the byte tokenizer's ids
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    short = int(batch["attention_mask"][0].sum())
    assert batch["input_ids"].shape[1] > short  # the short text was padded
    with torch.no_grad():
        padded = model(**batch).logits[0, :short]
        alone = model(**tokenizer(texts[:1], return_tensors="pt")).logits[0]
    torch.testing.assert_close(padded, alone, atol=1e-4, rtol=1e-4)  # padding changes nothing it should not
