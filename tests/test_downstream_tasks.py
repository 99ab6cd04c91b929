"""Tasks as data and their scoring, without Ray: the shipped standard tasks, a user's JSONL file and
each of its errors, the encoding (left cut, skipped items, tokenizers that cannot encode), the
device-side scorer against log-likelihoods computed here one sequence at a time, and the loop's
scoring equal to `evaluate`'s bit for bit, in fp32 and bf16, whatever the worker counts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from raytrain_fast.config import load_config
from raytrain_fast.config.validate import validate
from raytrain_fast.data.tokenizer import byte_tokenizer
from raytrain_fast.downstream.encode import Encoder, encode_task
from raytrain_fast.downstream.evaluate import evaluate
from raytrain_fast.downstream.in_loop import RunTasks
from raytrain_fast.downstream.models import ModelSource
from raytrain_fast.downstream.run import encoder_for
from raytrain_fast.downstream.score import ScoringPlan, choose
from raytrain_fast.downstream.tasks import STANDARD_TASKS, TaskError, load_task, load_tasks
from raytrain_fast.errors import ConfigError
from raytrain_fast.model import model_class

pytestmark = pytest.mark.unit

SIZES = {"arc_easy": 570, "arc_challenge": 299, "boolq": 3270, "csqa": 1221, "hellaswag": 10042, "openbookqa": 500,
         "piqa": 1838, "socialiqa": 1954, "winogrande": 1267}
"""Each validation split's size, as published with the datasets."""


def write_jsonl(path, items) -> str:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return str(path)


def test_every_standard_task_ships_with_its_whole_validation_split():
    assert set(STANDARD_TASKS) == set(SIZES)
    for name, size in SIZES.items():
        task = load_task(name, limit=None)
        assert (task.total, len(task.items)) == (size, size), name
        assert all(0 <= item.gold < len(item.continuations) for item in task.items)
        golds = np.bincount([item.gold for item in task.items])
        assert golds.max() < 0.75 * len(task.items), (name, golds)  # not a file of one answer
    arc = load_task("arc_easy", limit=None).items[0]
    assert arc.contexts[0] == "Question: Which technology was developed most recently?\nAnswer:"
    assert arc.continuations == (" cellular telephone", " television", " refrigerator", " airplane")
    wino = load_task("winogrande", limit=None).items[0]
    assert len(set(wino.contexts)) == 2 and len(set(wino.continuations)) == 1  # each choice fills the blank
    assert load_task("piqa", limit=None).chance == 0.5
    assert math.isclose(load_task("hellaswag", limit=None).chance, 0.25)


def test_a_limit_takes_the_same_evenly_spread_items_every_time():
    first = load_task("arc_easy", limit=10)
    assert [item.index for item in first.items] == [57 * i for i in range(10)]
    assert first.items == load_task("arc_easy", limit=10).items
    assert first.total == 570 and len(load_task("arc_easy", limit=5000).items) == 570


def test_an_unknown_task_is_named_with_the_ones_there_are():
    with pytest.raises(TaskError) as error:
        load_tasks(["arc_eazy"], limit=None)
    message = str(error.value)
    assert "unknown task 'arc_eazy'" in message and "did you mean 'arc_easy'" in message
    assert all(name in message for name in STANDARD_TASKS) and ".jsonl" in message


def test_a_users_jsonl_task_loads_and_the_boundary_space_goes_to_the_continuation(tmp_path):
    path = write_jsonl(tmp_path / "capitals.jsonl", [
        {"context": "The capital of France is ", "choices": ["Paris", "Rome"], "gold": 0},
        "",
        {"contexts": ["Ann thanked Bo because Ann", "Ann thanked Bo because Bo"], "continuation": " helped.", "gold": 1},
    ])
    task = load_task(path, limit=None)
    assert task.name == "capitals" and task.total == 2
    assert task.items[0].contexts == ("The capital of France is", "The capital of France is")
    assert task.items[0].continuations == (" Paris", " Rome")
    assert task.items[1].continuations == (" helped.", " helped.") and task.items[1].gold == 1


@pytest.mark.parametrize("line, says", [
    ('{"context": "a", "choices": [" b", " c"], "gold": 0', "line 2: not valid JSON"),
    ('["a", "b"]', "line 2: an item is a JSON object"),
    ('{"context": "a", "gold": 0}', 'line 2: an item needs "context" and "choices"'),
    ('{"context": "a", "choices": [" b"], "gold": 0}', 'line 2: "choices" must be a list of at least 2 strings'),
    ('{"context": "a", "choices": [" b", 3], "gold": 0}', 'line 2: "choices" must be a list of at least 2 strings'),
    ('{"context": "a", "choices": [" b", " c"], "gold": 2}', 'line 2: "gold" must be the index of the right choice, 0 to 1'),
    ('{"context": "a", "choices": [" b", " c"], "gold": true}', 'line 2: "gold" must be the index'),
    ('{"context": "a", "choices": [" b", "  "], "gold": 0}', "line 2: choice 1 is empty"),
    ('{"contexts": ["a", "b"], "gold": 0}', 'line 2: "continuation" must be a non-empty string'),
])
def test_a_malformed_jsonl_item_is_refused_with_its_line(tmp_path, line, says):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"context": "ok", "choices": [" a", " b"], "gold": 1}, line])
    with pytest.raises(TaskError) as error:
        load_tasks([path], limit=None)
    assert f"{path} {says}" in str(error.value)


def test_missing_and_empty_files_and_two_tasks_of_one_name_are_refused(tmp_path):
    with pytest.raises(TaskError, match="does not exist"):
        load_tasks([str(tmp_path / "absent.jsonl")], limit=None)
    with pytest.raises(TaskError, match="holds no items"):
        load_tasks([write_jsonl(tmp_path / "empty.jsonl", [""])], limit=None)
    (tmp_path / "b").mkdir()
    one = write_jsonl(tmp_path / "t.jsonl", [{"context": "", "choices": [" a", " b"], "gold": 0}])
    two = write_jsonl(tmp_path / "b" / "t.jsonl", [{"context": "", "choices": [" a", " b"], "gold": 0}])
    with pytest.raises(TaskError, match="two tasks are named 't'"):
        load_tasks([one, two], limit=None)


def test_the_config_takes_tasks_as_a_list_or_a_comma_separated_string_and_checks_the_limit():
    config = load_config("tiny", ["eval.tasks=arc_easy, ./mine.jsonl"])
    assert config.eval.tasks == ["arc_easy", "./mine.jsonl"]
    assert load_config("tiny", ["eval.tasks=[piqa, boolq]"]).eval.tasks == ["piqa", "boolq"]
    with pytest.raises(ConfigError, match="eval.task_limit must be >= 1"):
        validate(load_config("tiny", ["eval.task_limit=0"]))


def byte_encoder(window: int, vocab_size: int = 320) -> Encoder:
    spec = byte_tokenizer()
    return Encoder(encode=spec.encode_text, eod_id=spec.info.eod_id, vocab_size=vocab_size, window=window, name="byte")


def test_long_contexts_are_cut_from_the_left_and_counted_and_a_choice_longer_than_the_window_is_left_out(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [
        {"context": "x" * 30 + "END", "choices": [" ab", " cd"], "gold": 0},
        {"context": "short", "choices": [" ab", " cd"], "gold": 1},
        {"context": "", "choices": [" ab", " abcdefghijklmnopqrstu"], "gold": 0},
        {"context": "", "choices": [" ok", " no"], "gold": 0},
    ])
    encoded = encode_task(load_task(path, limit=None), byte_encoder(window=16))
    assert encoded.skipped == [2] and encoded.num_items == 3  # its second choice alone is 22 tokens
    assert encoded.cut.tolist() == [1, 0, 0]
    first = encoded.sequences[0]
    assert len(first) == 17 and bytes(first.tolist()).endswith(b"END ab")
    assert encoded.sequences[4].tolist()[0] == 256  # an empty context: the end-of-document id
    assert encoded.continuation_tokens.tolist()[:2] == [3, 3]
    assert encoded.characters.tolist()[:2] == [2, 2]  # " ab": its leading space not counted


def test_a_tokenizer_that_cannot_encode_an_item_is_named_with_the_item(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({"[UNK]": 0, "yes": 1, "no": 2, "Q": 3}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    encoder = Encoder(encode=lambda t: words.encode(t).ids, eod_id=3, vocab_size=4, window=32, unknown_id=0, name="words")
    good = write_jsonl(tmp_path / "good.jsonl", [{"context": "Q", "choices": [" yes", " no"], "gold": 0}])
    assert encode_task(load_task(good, limit=None), encoder).num_items == 1
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"context": "Q", "choices": [" yes", " no"], "gold": 0},
                                               {"context": "Q", "choices": [" yes", " maybe"], "gold": 0}])
    with pytest.raises(TaskError, match=r"task bad, item 1, choice 1.*no token for part of ' maybe'"):
        encode_task(load_task(bad, limit=None), encoder)
    with pytest.raises(TaskError, match=r"gives id 3.*vocabulary has 3 ids"):
        encode_task(load_task(good, limit=None), Encoder(encode=encoder.encode, eod_id=0, vocab_size=3, window=32, name="words"))
    silent = Encoder(encode=lambda text: [] if text == " \u200b" else [1], eod_id=3, vocab_size=4, window=32, name="silent")
    blank = write_jsonl(tmp_path / "blank.jsonl", [{"context": "Q", "choices": [" yes", " \u200b"], "gold": 0}])
    with pytest.raises(TaskError, match="task blank, item 0, choice 1: the tokenizer .silent. turns ' .+' into no tokens"):
        encode_task(load_task(blank, limit=None), silent)


def reference_loglikelihood(model, sequence: np.ndarray, continuation: int) -> float:
    """One sequence at a time, no batching or padding: sum of log p(continuation token | the tokens before)."""
    tokens = torch.tensor(sequence[:-1]).unsqueeze(0)
    logprobs = torch.log_softmax(model(tokens)[0].float(), dim=-1)
    return sum(float(logprobs[p, sequence[p + 1]]) for p in range(len(sequence) - 1 - continuation, len(sequence) - 1))


def test_the_batched_scorer_equals_one_sequence_at_a_time_and_two_ranks_count_each_item_once():
    torch.manual_seed(0)
    config = load_config("tiny", ["model.num_layers=2"]).model
    model = model_class(config)(config).eval()
    tasks = [encode_task(load_task(name, limit=12), encoder_for(byte_tokenizer(), config)) for name in ("arc_easy", "winogrande")]
    plan = ScoringPlan(tasks, micro_batch=5, device="cpu")
    with torch.no_grad():
        lls = plan.loglikelihoods(model)
        expected = [reference_loglikelihood(model, t.sequences[r], int(t.continuation_tokens[r]))
                    for t in tasks for r in range(len(t.sequences))]
        assert np.allclose(lls.numpy(), expected, atol=1e-4)
        unpacked = ScoringPlan(tasks, micro_batch=5, device="cpu", packed=False)
        assert np.allclose(unpacked.loglikelihoods(model).numpy(), expected, atol=1e-4)
        read = lambda p: sum(b.tokens.numel() for b in p.batches)  # noqa: E731
        assert read(plan) < 0.75 * read(unpacked)  # ARC's context read once for its 3-5 choices (winogrande: one row each)
        choice, _ = choose(tasks[0], lls.numpy()[: len(tasks[0].sequences)].astype(np.float64))
        starts = np.searchsorted(tasks[0].request_item, np.arange(13))
        assert choice.tolist() == [int(np.argmax(expected[a:b])) for a, b in zip(starts[:-1], starts[1:])]
        one = plan.figures(lls.tolist())
        ranks = [ScoringPlan(tasks, micro_batch=3, device="cpu", rank=r, world_size=2) for r in (0, 1)]
        assert all(p.batches for p in ranks)
        two = plan.figures(sum(p.loglikelihoods(model) for p in ranks).tolist())
    assert [f["items"] for f in one] == [f["items"] for f in two] == [12.0, 12.0]  # each item counted once over the two ranks
    assert [f["acc"] for f in one] == [f["acc"] for f in two]
    assert one[0]["acc"] == sum(int(c == g) for c, g in zip(choice.tolist(), tasks[0].gold)) / 12
    gold = [expected[int(a) + int(g)] for a, g in zip(starts[:-1], tasks[0].gold)]  # the right choice's, one item at a time
    assert one[0]["loglikelihood"] == pytest.approx(sum(gold) / 12, abs=1e-4)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_loop_and_evaluate_give_every_request_the_same_loglikelihood_whatever_the_worker_counts(precision):
    """The same weights at the same precision and micro-batch: the loop's share of the tasks on 1 or 3
    ranks (summed as its all-reduce sums them) and `evaluate` in one process (each task on its own) or
    split over 2 workers give every request the same log-likelihood, bit for bit, and so the same
    accuracy. A batch of other rows (another micro-batch) would change the last bits."""
    from raytrain_fast.downstream.evaluate import score_shard

    torch.manual_seed(0)
    config = load_config("tiny", ["model.num_layers=2"]).model
    source = ModelSource(description="test", state=model_class(config)(config).state_dict(), config=config, precision=precision)
    tasks = [encode_task(load_task(name, limit=12), encoder_for(byte_tokenizer(), config)) for name in ("arc_easy", "winogrande", "piqa")]
    model = source.build("cpu")
    run_tasks = RunTasks(tasks=tasks, window=config.max_seq_len)

    def loop(world_size: int) -> tuple[list[float], dict[str, float]]:
        shares = [run_tasks.for_rank(rank=r, world_size=world_size, device="cpu", micro_batch=5) for r in range(world_size)]
        with torch.no_grad():
            summed = sum(share.score(model) for share in shares).tolist()
        return summed, shares[0].values(summed, tokens=None)

    (by_loop, values), (on_three, _) = loop(1), loop(3)
    assert on_three == by_loop
    result = evaluate(source, tasks, window=config.max_seq_len, micro_batch=5, device="cpu")
    assert [ll for r in result.items for ll in r["loglikelihoods"]] == by_loop
    halves = [score_shard(source, tasks, rank=r, world_size=2, micro_batch=5, device="cpu")["values"] for r in (0, 1)]
    split = [a if a is not None else b for t in tasks for a, b in zip(halves[0][t.name], halves[1][t.name])]
    assert split == by_loop
    assert all((a is None) != (b is None) for t in tasks for a, b in zip(halves[0][t.name], halves[1][t.name]))  # one worker each
    for task in result.tasks:
        keys = ("acc", "acc_norm", "loglikelihood", "items")
        assert (task.acc, task.acc_norm, task.loglikelihood, task.items) == tuple(values[f"eval/{task.name}/{k}"] for k in keys)
