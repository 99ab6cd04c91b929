"""eval.tasks in a real run (Ray Train, DeepSpeed on the CPU): a tiny model trained on the gold
continuations of a small task scores above 0.9 on it while the same model untrained scores near
chance; the figures the loop records at a step equal `raytrain-fast evaluate` on that step's
checkpoint, in bf16 (the run's precision, which evaluate takes by default); two evaluate workers
give one worker's accuracy with each item scored once; and the report draws the accuracy against
the tokens trained on."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from raytrain_fast.cli import main
from raytrain_fast.config import load_config
from raytrain_fast.data.tokenizer import byte_tokenizer
from raytrain_fast.downstream.encode import encode_tasks
from raytrain_fast.downstream.evaluate import evaluate
from raytrain_fast.downstream.models import ModelSource
from raytrain_fast.downstream.run import encoder_for
from raytrain_fast.downstream.tasks import load_tasks
from raytrain_fast.launch.trainer import run
from raytrain_fast.model import model_class
from raytrain_fast.report import make_report

pytestmark = [pytest.mark.slow, pytest.mark.ray]

STEPS, SAVE_EVERY, ITEMS = 200, 100, 32
SETTINGS = [
    "data.seq_len=64", "model.max_seq_len=64", "model.d_model=64", "model.num_heads=2", "model.num_layers=2",
    f"train.steps={STEPS}", "train.log_every=20", f"checkpoint.every_steps={SAVE_EVERY}", "optim.lr=0.003",
    "optim.warmup_steps=10", f"eval.task_limit={ITEMS}", "eval.every_steps=50", "engine.precision=bf16",
    "metrics.peak_measure_s=0.2", "resources.max_failures=0",
]


def code_words(folder: Path) -> Path:
    """A task of 32 made-up facts ("The code word for mynbi is qpmz"), four equally long choices each,
    and a corpus of its gold continuations: 8 files, each with every fact once, in its own order."""
    rng = random.Random(0)
    word = lambda n: "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))  # noqa: E731
    items = [{"context": f"The code word for {word(5)} is", "choices": [f" {word(4)}" for _ in range(4)], "gold": rng.randrange(4)}
             for _ in range(ITEMS)]
    (folder / "corpus").mkdir()
    for part in range(8):
        order = rng.sample(items, len(items))
        (folder / "corpus" / f"part{part}.txt").write_text("".join(f"{i['context']}{i['choices'][i['gold']]}.\n" for i in order))
    task = folder / "codes.jsonl"
    task.write_text("".join(json.dumps(item) + "\n" for item in items))
    return task


@pytest.fixture(scope="module")
def trained(ray_session, tmp_path_factory):
    """(storage root, the run's config, the task file): run 'codes', trained on the task's gold continuations."""
    root = tmp_path_factory.mktemp("downstream")
    task = code_words(root)
    config = load_config("tiny", [*SETTINGS, f"data.source={root / 'corpus'}", f"eval.tasks={task},arc_easy",
                                  f"storage.uri={root / 'runs'}"], name="codes")
    run(config)
    return root / "runs", config, task


def records(storage: Path) -> list[dict]:
    files = sorted((storage / "codes" / "metrics").glob("*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]


def evaluate_json(capsys, *argv: str) -> dict:
    assert main(["evaluate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_model_trained_on_the_gold_continuations_scores_above_0_9_and_untrained_near_chance(trained):
    storage, config, task = trained
    scored = [r for r in records(storage) if "eval/codes/acc" in r]
    assert [r["step"] for r in scored] == [60, 100, 160, 200]  # the first log step at or after each 50, and the last
    last = scored[-1]
    assert last["eval/codes/items"] == ITEMS and last["eval/codes/chance"] == 0.25
    assert last["eval/codes/acc"] >= 0.9 and last["eval/codes/acc_norm"] >= 0.9
    assert last["eval/tokens"] == STEPS * config.train.global_batch * config.data.seq_len
    torch.manual_seed(config.train.seed)
    untrained = model_class(config.model)(config.model)  # the run's model as its first step found it
    encoded = encode_tasks(load_tasks([str(task)], limit=None), encoder_for(byte_tokenizer(), config.model))
    result = evaluate(ModelSource(description="untrained", state=untrained.state_dict(), config=config.model), encoded,
                      window=config.model.max_seq_len, device="cpu")
    noise = 3 * math.sqrt(0.25 * 0.75 / ITEMS)  # three standard deviations of a random guess's accuracy
    assert abs(result.tasks[0].acc - 0.25) <= noise and abs(result.tasks[0].acc_norm - 0.25) <= noise, result.tasks[0]


def test_the_in_loop_figure_at_a_step_equals_evaluate_on_that_steps_checkpoint(trained, capsys):
    storage, _, _ = trained
    by_step = {r["step"]: r for r in records(storage) if "eval/codes/acc" in r}
    for step in (SAVE_EVERY, STEPS):
        result = evaluate_json(capsys, "--storage", str(storage), "--name", "codes", "--step", str(step))  # the run's own tasks and limit
        assert result["step"] == step and set(result["tasks"]) == {"codes", "arc_easy"}
        assert (result["precision"], result["micro_batch"]) == ("bf16", 16)  # the run's precision and evaluation micro-batch
        for name, task in result["tasks"].items():
            loop = by_step[step]
            # loglikelihood: the right choice's, summed over the items; any item scored otherwise changes it
            keys = ("acc", "acc_norm", "loglikelihood", "items", "cut")
            assert tuple(task[k] for k in keys) == tuple(loop[f"eval/{name}/{k}"] for k in keys), (name, step, task, loop)
        assert result["tasks"]["arc_easy"]["cut"] > 0  # a 64-token window: ARC's contexts are cut
    # Scored in fp32 (as evaluate scored every checkpoint before), the figures are not the loop's: the check can fail.
    fp32 = evaluate_json(capsys, "--storage", str(storage), "--name", "codes", "--step", str(STEPS), "--precision", "fp32")
    assert fp32["tasks"]["arc_easy"]["loglikelihood"] != by_step[STEPS]["eval/arc_easy/loglikelihood"]


def test_evaluate_of_the_runs_hugging_face_export_scores_the_runs_tasks_by_default(trained, capsys, tmp_path):
    pytest.importorskip("transformers")
    storage, _, _ = trained
    out = tmp_path / "codes-hf"
    assert main(["export", "--storage", str(storage), "--name", "codes", "--format", "hf", "--out", str(out)]) == 0
    capsys.readouterr()
    of_run = evaluate_json(capsys, "--storage", str(storage), "--name", "codes")
    of_export = evaluate_json(capsys, "--hf", str(out))
    # The same items chosen (the export's tokenizer may leave out an item whose choice it encodes longer than the window).
    chosen = lambda result: {name: task["items"] + task["skipped"] for name, task in result["tasks"].items()}  # noqa: E731
    assert chosen(of_export) == chosen(of_run) == {"codes": ITEMS, "arc_easy": ITEMS}, (of_export["tasks"], of_run["tasks"])
    assert {(r["task"], r["index"]) for r in of_export["items"]} <= {(r["task"], r["index"]) for r in of_run["items"]}


def test_two_workers_give_one_workers_accuracy_and_score_each_item_once(trained, capsys):
    storage, _, _ = trained
    argv = ["--storage", str(storage), "--name", "codes", "--tasks", "arc_easy,piqa", "--limit", "40"]
    one = evaluate_json(capsys, *argv)
    two = evaluate_json(capsys, *argv, "--workers", "2")
    assert one["tasks"].keys() == two["tasks"].keys()
    for name in one["tasks"]:
        assert two["tasks"][name]["acc"] == one["tasks"][name]["acc"]
        assert two["tasks"][name]["acc_norm"] == one["tasks"][name]["acc_norm"]
    keys = [(r["task"], r["index"]) for r in two["items"]]
    assert len(keys) == len(set(keys)) == len(one["items"])  # every item once, none twice
    assert set(keys) == {(r["task"], r["index"]) for r in one["items"]}
    assert {r["worker"] for r in two["items"]} == {0, 1} and {r["worker"] for r in one["items"]} == {0}
    assert [r["choice"] for r in two["items"]] == [r["choice"] for r in one["items"]]


def test_the_report_draws_accuracy_against_tokens_with_chance_and_lists_the_tasks(trained, tmp_path):
    storage, _, _ = trained
    report = make_report(str(storage), "codes", out_dir=str(tmp_path / "report"))
    assert str(tmp_path / "report" / "tasks.png") in report.pngs
    assert "Downstream tasks" in report.text and "codes: first" in report.text
    html = Path(report.html_path).read_text()
    assert "<h2>Downstream tasks</h2>" in html and 'id="tasks.png"' in html
