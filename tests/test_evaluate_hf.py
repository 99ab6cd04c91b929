"""`raytrain-fast evaluate --hf DIR` against a scorer written here with transformers alone: every item's
choice and every choice's log-likelihood agree, on a Llama export with a trained BPE tokenizer and a
GPT-2 export with the byte tokenizer. And each bad input gets its one-line error before a model loads."""

from __future__ import annotations

import functools
import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from raytrain_fast.checkpoint.hf_export import write_hf_export
from raytrain_fast.cli import main
from raytrain_fast.config import load_config
from raytrain_fast.data.tokenizer import byte_tokenizer, load_tokenizer
from raytrain_fast.downstream.tasks import standard_task_path
from raytrain_fast.model import model_class

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
MINE = [
    {"context": "The capital of France is ", "choices": ["Paris", "Rome", "a city in Italy"], "gold": 0},
    {"context": "", "choices": [" def f(x):", " import os"], "gold": 1},  # an empty context: the eos token stands for it
    {"contexts": ["Ann thanked Bo because Ann", "Ann thanked Bo because Bo"], "continuation": " had helped her.", "gold": 1},
]


def export(tmp_path: Path, preset: str, tokenizer) -> str:
    """A randomly initialised model of `preset` (2 layers) exported in the Hugging Face format."""
    config = load_config(preset, ["model.num_layers=2"]).model
    torch.manual_seed(1)
    model = model_class(config)(config)
    out = tmp_path / preset
    write_hf_export(model.state_dict(), config, str(out), tokenizer=tokenizer, dtype="float32")
    return str(out)


def bpe_tokenizer(tmp_path: Path):
    from raytrain_fast.data.train_tokenizer import train_tokenizer

    out = tmp_path / "bpe"
    train_tokenizer(inputs=[str(ROOT / "raytrain_fast" / "model")], output=str(out), vocab_size=300, min_frequency=2)
    return load_tokenizer(str(out))


def items_of(task: str, path: str, index: int) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as lines:
        item = json.loads([line for line in lines if line.strip()][index])
    contexts = item.get("contexts") or [item.get("context", "")] * len(item["choices"])
    continuations = item["choices"] if "choices" in item else [item["continuation"]] * len(contexts)
    # The convention under test: a context's trailing spaces start its continuation instead.
    return {"pairs": [(c.rstrip(" "), " " * (len(c) - len(c.rstrip(" "))) + k) for c, k in zip(contexts, continuations)], "gold": item["gold"]}


@functools.lru_cache(maxsize=2)
def load(directory: str):
    return transformers.AutoTokenizer.from_pretrained(directory), transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()


def transformers_loglikelihoods(directory: str, pairs: list[tuple[str, str]]) -> list[float]:
    """The continuation's summed log-probability after its context, with nothing but transformers."""
    tokenizer, model = load(directory)
    window = model.config.max_position_embeddings
    encoded = [(tokenizer(c, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id],
                tokenizer(k, add_special_tokens=False)["input_ids"]) for c, k in pairs]
    # The convention under test: a context shared by every choice is cut once, to what the longest
    # choice leaves of the window + 1; a choice's own context, to what that choice leaves.
    shared = len({c for c, _ in pairs}) == 1
    out = []
    for context_ids, continuation_ids in encoded:
        keep = window + 1 - (max(len(k) for _, k in encoded) if shared else len(continuation_ids))
        sequence = context_ids[-keep:] + continuation_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([sequence[:-1]])).logits[0].float(), dim=-1)
        first = len(sequence) - 1 - len(continuation_ids)
        out.append(sum(float(logprobs[p, sequence[p + 1]]) for p in range(first, len(sequence) - 1)))
    return out


def evaluate_json(capsys, *argv: str) -> dict:
    assert main(["evaluate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("preset", ["llama-tiny", "tiny"])
def test_every_items_choice_and_loglikelihoods_equal_a_transformers_scorer(tmp_path, capsys, preset):
    tokenizer = bpe_tokenizer(tmp_path) if preset == "llama-tiny" else byte_tokenizer()
    directory = export(tmp_path, preset, tokenizer)
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps(item) + "\n" for item in MINE))
    result = evaluate_json(capsys, "--hf", directory, "--tasks", f"arc_easy,{mine}", "winogrande", "--limit", "8", "--micro-batch", "5")
    files = {"arc_easy": str(standard_task_path("arc_easy")), "winogrande": str(standard_task_path("winogrande")), "mine": str(mine)}
    assert [(r["task"], r["index"]) for r in result["items"]] == (
        [("arc_easy", i * 570 // 8) for i in range(8)] + [("mine", i) for i in range(3)] + [("winogrande", i * 1267 // 8) for i in range(8)]
    )
    assert result["tasks"]["arc_easy"]["cut"] > 0  # some contexts longer than the 128-token window: the cut is compared too
    for record in result["items"]:
        item = items_of(record["task"], files[record["task"]], record["index"])
        expected = transformers_loglikelihoods(directory, item["pairs"])
        assert record["loglikelihoods"] == pytest.approx(expected, abs=1e-4), record
        assert record["choice"] == max(range(len(expected)), key=expected.__getitem__)
        assert record["gold"] == item["gold"]
        per_char = [ll / max(1, len(k.lstrip())) for ll, (_, k) in zip(expected, item["pairs"])]
        assert record["choice_norm"] == max(range(len(per_char)), key=per_char.__getitem__)
    for name, task in result["tasks"].items():
        records = [r for r in result["items"] if r["task"] == name]
        assert task["acc"] == sum(r["choice"] == r["gold"] for r in records) / len(records)
        assert task["items"] == len(records) and task["skipped"] == 0


def run_cli(*argv: str, block_transformers: bool = False) -> subprocess.CompletedProcess:
    """The command in a fresh process (as a user runs it), optionally with transformers not importable."""
    block = "sys.modules['transformers'] = None; " if block_transformers else ""
    code = f"import sys; {block}from raytrain_fast.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "evaluate", *argv], capture_output=True, text=True, timeout=120)


def test_bad_input_gets_one_line_naming_the_problem_and_the_fix(tmp_path):
    directory = export(tmp_path, "tiny", byte_tokenizer())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "a", "choices": [" b", " c"], "gold": 0}\n{"context": "a", "choices": " b", "gold": 0}\n')
    cases = [
        (["--hf", directory, "--tasks", "hellaswagg"], "unknown task 'hellaswagg' (did you mean 'hellaswag'? standard tasks: arc_easy,"),
        (["--hf", directory, "--tasks", str(bad)], f"{bad} line 2: \"choices\" must be a list of at least 2 strings"),
        (["--hf", str(tmp_path), "--tasks", "piqa"], "no config.json there, so it is not a Hugging Face model directory"),
        (["--tasks", "piqa"], "evaluate needs either --storage and --name (a run's checkpoint) or --hf DIR"),
        (["--storage", str(tmp_path)], "evaluate --storage needs --name"),
    ]
    for argv, says in cases:
        done = run_cli(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        assert says in done.stderr, (argv, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    done = run_cli("--hf", directory, "--tasks", "piqa", block_transformers=True)
    assert done.returncode == 2
    assert "transformers, which is not installed: pip install 'raytrain_fast[eval]'" in done.stderr
