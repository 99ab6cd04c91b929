"""Mixtures (data.sources): the weighted interleave holds every source's share in every window, a
source that runs out starts its next epoch alone, a resume on another worker count continues the same
sequences of each source, a resume with other weights or sources continues each source where it stood
(with exact counts), and bad mixtures are refused before any worker starts.

The three tiny sources are written in distinct letters (web a-d, code k-l, papers x), so which source a
sequence came from is read from its tokens, not from the schedule under test."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from raytrain_fast.config import load_config
from raytrain_fast.data import BatchIterator, load_manifest, prepare_data
from raytrain_fast.data.mixture import MixturePosition, MixtureSchedule, Source, check_sources, load_sources, mixture_rank_stream
from raytrain_fast.data.order import locate_absolute, rank_indexes, usable_rows
from raytrain_fast.errors import ConfigError
from raytrain_fast.storage import StorageConfig

pytestmark = pytest.mark.ray

SEQ_LEN = 8
WEIGHTS = {"web": 0.5, "code": 0.3, "papers": 0.2}
LETTERS = {"web": "abcd", "code": "kl", "papers": "x"}  # 143 bytes + EOD per file = 16 rows of 9 tokens
STATED_BOUND = 2.0  # docs/data.md#mixtures: a window of G holds G * w +- 2 sequences of each source


def write_sources(root, *, output_of, storage=None) -> dict[str, str]:
    uris = {}
    for name, letters in LETTERS.items():
        corpus = root / f"text-{name}"
        corpus.mkdir()
        for letter in letters:
            (corpus / f"{letter}.txt").write_text(letter * 143)
        uris[name] = output_of(name)
        prepare_data(inputs=[str(corpus)], output=uris[name], seq_len=SEQ_LEN, rows_per_shard=5, storage=storage,
                     parallel=False, verbose=False)
    return uris


def sources_at(uris: dict[str, str], storage=None, weights=WEIGHTS) -> list[Source]:
    return [Source(name=n, weight=weights[n], manifest=load_manifest(uris[n], storage)) for n in uris]


@pytest.fixture(scope="module")
def local_uris(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    return write_sources(root, output_of=lambda name: str(root / name))


def source_of(tokens) -> list[str]:
    """The source of each row, read from its letters (EOD and nothing else may join them)."""
    names = []
    for row in tokens.tolist():
        letters = {chr(t) for t in row if t < 256}
        owners = {n for n, own in LETTERS.items() if letters <= set(own)}
        assert len(owners) == 1, f"row {row} mixes sources"
        names.append(owners.pop())
    return names


def take(iterator, batches: int) -> list[tuple[str, int]]:
    """(source, seq_id) of the next batches' sequences, in order."""
    out = []
    for _ in range(batches):
        tokens, seq_ids = next(iterator)
        out += list(zip(source_of(tokens), seq_ids.tolist()))
    return out


def assert_shares_hold_in_every_window(names: list[str], weights: dict[str, float], bound: float) -> None:
    """For every source and every window [a, a + G) of the sequence: |count - G * w| <= bound."""
    total = sum(weights.values())
    for name, weight in weights.items():
        prefix = np.concatenate([[0], np.cumsum([n == name for n in names])])
        n = len(names)
        for size in range(1, n + 1):
            counts = prefix[size:] - prefix[:-size]
            worst = np.abs(counts - size * weight / total).max()
            assert worst <= bound + 1e-9, f"{name}: a window of {size} holds {counts.min()}..{counts.max()}, share {size * weight / total:.2f}"


@pytest.mark.parametrize("weights", [[0.7, 0.2, 0.1], [1, 1, 1], [0.5, 0.3, 0.2], [3.3, 1.1, 0.01], [98, 1, 1], [5, 4, 3, 2, 1]])
def test_the_schedule_holds_each_share_in_every_window(weights):
    schedule = MixtureSchedule(weights)
    assert schedule.max_deviation < 1 and 2 * schedule.max_deviation < STATED_BOUND
    length = 3 * schedule.period + 7  # windows across period boundaries too
    sources, _ = schedule.locate(np.arange(length))
    names = [str(s) for s in sources.tolist()]
    assert_shares_hold_in_every_window(names, {str(i): w for i, w in enumerate(weights)}, 2 * schedule.max_deviation)
    # The count at g is a pure function of g: the same from the pattern and from counts().
    for g in (0, 1, schedule.period - 1, schedule.period, length):
        assert schedule.counts(g).tolist() == [int((sources[:g] == s).sum()) for s in range(len(weights))]


def test_one_source_is_exactly_the_single_source_stream(local_uris):
    manifest = load_manifest(local_uris["web"])
    rows = usable_rows(manifest)
    for world_size, rank, start in ((1, 0, 0), (3, 2, 20)):
        sources, shards, in_shard, _ = mixture_rank_stream(
            [rows], MixtureSchedule([1.0]), seed=4, position=MixturePosition(consumed=start, sources=[{"name": "web", "weight": 1.0}]),
            rank=rank, world_size=world_size, micro_batch=4, batches=9,
        )
        indexes = rank_indexes(start, rank=rank, world_size=world_size, micro_batch=4, batches=9, first_batch=0)
        _, _, plain_shards, plain_rows = locate_absolute(rows, indexes, seed=4, orders={})
        assert not sources.any() and np.array_equal(shards, plain_shards) and np.array_equal(in_shard, plain_rows)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_three_source_run_holds_the_shares_and_sources_run_out_on_their_own(where, local_uris, request, ray_session, tmp_path):
    storage = None
    uris = local_uris
    if where == "s3":
        server = request.getfixturevalue("s3_server")
        request.getfixturevalue("aws_env")
        bucket = server.make_bucket("mixture-tests")
        storage = StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=server.endpoint_url)
        uris = write_sources(tmp_path, output_of=lambda name: f"s3://{bucket}/prepared/{name}", storage=storage)
    sources = sources_at(uris, storage)
    sizes = {s.name: s.manifest.num_sequences for s in sources}
    assert sizes == {"web": 64, "code": 32, "papers": 16}
    with BatchIterator(sources, rank=0, world_size=1, micro_batch=4, seed=3, storage=storage) as it:
        taken = take(it, 40)  # 160 sequences: papers 32 (2 epochs), code 48 (1.5), web 80 (1.25)
        metrics = it.source_metrics(seq_len=SEQ_LEN)
    names = [n for n, _ in taken]
    assert_shares_hold_in_every_window(names, WEIGHTS, STATED_BOUND)
    for name, size in sizes.items():
        ids = [i for n, i in taken if n == name]
        # Epoch after epoch of its own: every sequence once per epoch, reshuffled, while the others go on.
        epochs = [ids[e * size:(e + 1) * size] for e in range(len(ids) // size)]
        assert all(sorted(epoch) == list(range(size)) for epoch in epochs) and epochs
        assert len(epochs) < 2 or epochs[0] != epochs[1]
        tail = ids[len(epochs) * size:]
        assert len(set(tail)) == len(tail)
        # The counts say so: tokens and epochs per source, from the position alone, match what was read.
        assert metrics[f"data/tokens/{name}"] == len(ids) * SEQ_LEN
        assert metrics[f"data/epochs/{name}"] == pytest.approx(len(ids) / size)
    assert metrics["data/epochs/papers"] == 2.0 and metrics["data/epochs/web"] == 1.25
    assert {n: metrics[f"data/weight/{n}"] for n in WEIGHTS} == pytest.approx(WEIGHTS)


def global_order(sources, *, world_size: int, micro_batch: int, batches: int, position=None) -> tuple[list, list]:
    """The global stream as the ranks read it (round k: rank 0's batch, rank 1's, ...), and rank 0's
    positions after each batch."""
    shares, positions = [], []
    for rank in range(world_size):
        with BatchIterator(sources, rank=rank, world_size=world_size, micro_batch=micro_batch, seed=9, position=position) as it:
            share = []
            for _ in range(batches):
                share.append(take(it, 1))
                positions.append(it.position) if rank == 0 else None
        shares.append(share)
    return [item for k in range(batches) for rank in range(world_size) for item in shares[rank][k]], positions


def test_a_resume_on_another_worker_count_continues_the_same_sequences_of_each_source(local_uris, ray_session):
    sources = sources_at(local_uris)
    reference, positions = global_order(sources, world_size=2, micro_batch=4, batches=12)  # 96 sequences
    stop = 5  # after 5 rounds of 2 x 4: 40 sequences
    saved = json.loads(json.dumps(positions[stop - 1].to_dict()))  # what a checkpoint stores
    assert saved["consumed"] == 40
    resumed, _ = global_order(sources, world_size=3, micro_batch=2, batches=9, position=saved)  # 54 more
    assert reference[:40] + resumed[:56] == reference[:94]
    per_source = {n: [i for m, i in reference[40:94] if m == n] for n in WEIGHTS}
    assert per_source == {n: [i for m, i in resumed if m == n] for n in WEIGHTS}
    # The sources as the plan loads them from a config (launch/plan.py) resume the same way, on 1 worker.
    config = mixture_config(*local_uris.values(), weights=tuple(WEIGHTS.values()))
    loaded, problems = load_sources(config, list(local_uris.values()))
    assert not problems and [s.name for s in loaded] == list(WEIGHTS)
    with BatchIterator(loaded, rank=0, world_size=1, micro_batch=4, seed=9, position=saved) as it:
        assert take(it, 3) == reference[40:52]


def test_a_resume_with_other_weights_and_sources_continues_each_source_where_it_stood(local_uris, ray_session):
    """checkpoint.allow_changes=data: from the resume position a new schedule, each source going on
    in its own stream from the sequences it had given; a source left out keeps its count, a new one starts at 0."""
    sources = sources_at(local_uris)
    before, positions = global_order(sources, world_size=1, micro_batch=4, batches=25)  # 100 sequences
    saved = json.loads(json.dumps(positions[9].to_dict()))  # after 40
    given = {n: sum(m == n for m, _ in before[:40]) for n in WEIGHTS}
    changed = [Source(name="papers", weight=3.0, manifest=sources[2].manifest), Source(name="web", weight=1.0, manifest=sources[0].manifest)]
    with BatchIterator(changed, rank=0, world_size=1, micro_batch=4, seed=9, position=saved) as it:
        assert (it.position.start, it.position.before) == (40, given)
        after = take(it, 10)  # 40 more: papers 30, web 10
        metrics = it.source_metrics(seq_len=SEQ_LEN)
        again = json.loads(json.dumps(it.position.to_dict()))
    assert_shares_hold_in_every_window([n for n, _ in after], {"papers": 3.0, "web": 1.0}, STATED_BOUND)
    for name, source in (("papers", sources[2]), ("web", sources[0])):
        ids = [i for n, i in after if n == name]
        assert ids == own_stream(source.manifest, given[name] + len(ids))[given[name]:], name
        assert metrics[f"data/tokens/{name}"] == (given[name] + len(ids)) * SEQ_LEN
    assert metrics["data/tokens/code"] == given["code"] * SEQ_LEN and "data/weight/code" not in metrics  # left out: counted, not read
    assert metrics["data/weight/papers"] == 0.75
    # The changed position saved again resumes itself: the same schedule, no second change.
    with BatchIterator(changed, rank=0, world_size=1, micro_batch=4, seed=9, position=again) as it:
        assert it.position.start == 40 and take(it, 1)[0][0] in ("papers", "web")


def own_stream(manifest, count: int, *, seed: int = 9) -> list[int]:
    """The first `count` seq_ids of one source's own stream (its epochs one after the other)."""
    _, _, shards, rows = locate_absolute(usable_rows(manifest), np.arange(count), seed=seed, orders={})
    return [manifest.shards[s].first_seq_id + r for s, r in zip(shards.tolist(), rows.tolist())]


def mixture_config(*sources: str, weights=(0.7, 0.2, 0.1), overrides=()):
    items = ", ".join(f"{{source: '{s}', weight: {w}}}" for s, w in zip(sources, weights))
    return load_config("tiny", [f"data.sources=[{items}]", "data.seq_len=8", *overrides])


def test_bad_mixtures_are_named_with_the_fix(local_uris, tmp_path):
    web, code = local_uris["web"], local_uris["code"]
    with pytest.raises(ConfigError, match=r"data.sources '.*/missing' does not exist.*remove it from data.sources"):
        check_sources(mixture_config(web, code, str(tmp_path / "missing")))
    (tmp_path / "x.txt").write_text("x" * 300)
    prepare_data(inputs=[str(tmp_path / "x.txt")], output=str(tmp_path / "len16"), seq_len=16, parallel=False, verbose=False)
    with pytest.raises(ConfigError, match=r"prepared with seq_len 16 but data.seq_len is 8: .* prepare it again with --seq-len 8"):
        check_sources(mixture_config(web, code, str(tmp_path / "len16")))
    from raytrain_fast.data.train_tokenizer import train_tokenizer

    (tmp_path / "words.txt").write_text(" ".join(f"word{i % 50} text{i % 7}" for i in range(3000)))
    train_tokenizer(inputs=[str(tmp_path / "words.txt")], output=str(tmp_path / "tok"), vocab_size=300, verbose=False)
    prepare_data(inputs=[str(tmp_path / "words.txt")], output=str(tmp_path / "bpe"), seq_len=8, tokenizer=str(tmp_path / "tok"),
                 parallel=False, verbose=False)
    with pytest.raises(ConfigError, match=r"a mixture needs one tokenizer; prepare every source with the same --tokenizer"):
        check_sources(mixture_config(web, code, str(tmp_path / "bpe"), overrides=["model.vocab_size=320"]))
    (tmp_path / "empty-text").mkdir()
    (tmp_path / "empty-text" / "a.txt").write_text("")
    with pytest.raises(ConfigError, match=r"data.sources '.*empty-text' is empty .*add text to it, or remove it"):
        check_sources(mixture_config(web, code, str(tmp_path / "empty-text")))
    assert [s.name for s in check_sources(mixture_config(web, code, local_uris["papers"]))] == ["web", "code", "papers"]
    # A source smaller than a micro-batch (papers: 16 sequences) is fine: it cycles. A model too small for the vocabulary is not.
    check_sources(mixture_config(web, code, local_uris["papers"], overrides=["train.micro_batch=64"]))
    with pytest.raises(ConfigError, match=r"model.vocab_size \(200\) is smaller"):
        check_sources(mixture_config(web, code, local_uris["papers"], overrides=["model.vocab_size=200"]))


class _Recorded:
    """The two calls an Evaluator makes on the run's metrics: what it emitted, what left the window."""

    def __init__(self) -> None:
        self.emitted: dict[str, float] = {}

    def exclude_from_window(self, seconds: float) -> None:
        assert seconds >= 0

    def emit(self, step: int, values: dict[str, float]) -> None:
        self.emitted.update(values)


def test_val_loss_is_reported_per_source_where_each_has_a_validation_split(tmp_path):
    import torch

    from raytrain_fast.data.validation import load_validation
    from raytrain_fast.loop.evaluation import Evaluator
    from raytrain_fast.model import GPT, ModelConfig

    def prepared_with_split(name: str, text: str, val_fraction: float | None) -> Source:
        corpus = tmp_path / f"text-{name}"
        corpus.mkdir()
        for i in range(40):  # 40 documents: a 0.25 split holds some of them
            (corpus / f"{i}.txt").write_text(f"{text} {i} " * 6)
        prepare_data(inputs=[str(corpus)], output=str(tmp_path / name), seq_len=SEQ_LEN, parallel=False, verbose=False,
                     val_fraction=val_fraction)
        return Source(name=name, weight=WEIGHTS[name], manifest=load_manifest(str(tmp_path / name)))

    sources = [prepared_with_split("web", "the web page", 0.25), prepared_with_split("code", "def f(x): return x", 0.25)]
    assert all(s.manifest.validation is not None for s in sources)
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=320, max_seq_len=SEQ_LEN, num_layers=1, num_heads=2, d_model=32))

    def evaluate(tokens: np.ndarray, splits) -> dict[str, float]:
        recorded = _Recorded()
        evaluator = Evaluator(tokens=torch.from_numpy(tokens), sources=splits, every_steps=1, total_steps=1, micro_batch=3,
                              rank=0, world_size=1)
        evaluator.run(model, recorded, step=1)
        return recorded.emitted

    tokens, splits = load_validation(sources, count=8, rank=0, world_size=1)
    assert [s.name for s in splits] == ["web", "code"] and [s.weight for s in splits] == pytest.approx([0.5 / 0.8, 0.3 / 0.8])
    mixed = evaluate(tokens, splits)
    alone = {}
    for source, split in zip(sources, splits):
        own, own_split = load_validation([dataclasses.replace(source, weight=1.0)], count=8, rank=0, world_size=1)
        alone[source.name] = evaluate(own, own_split)["val/loss"]  # that source alone, as a single data.source
        assert mixed[f"val/loss/{source.name}"] == pytest.approx(alone[source.name], rel=1e-5)
    assert mixed["val/loss"] == pytest.approx(sum(s.weight * alone[s.name] for s in splits), rel=1e-5)
    assert alone["web"] != pytest.approx(alone["code"], rel=1e-3)  # two distributions, two losses
    # A source without a validation split gets no val/loss of its own.
    papers = prepared_with_split("papers", "an abstract", None)
    bare = Source(name="papers", weight=0.2, manifest=dataclasses.replace(papers.manifest, validation=None))
    _, splits = load_validation(sources + [bare], count=8, rank=0, world_size=1)
    assert [s.name for s in splits] == ["web", "code"]


def test_the_report_shows_the_realised_mixture_against_the_weights():
    from raytrain_fast.report.load import from_records
    from raytrain_fast.report.mixture import mixture_lines, mixture_stretches

    schedule, names, global_batch, log_every = MixtureSchedule(list(WEIGHTS.values())), list(WEIGHTS), 12, 10
    config = {"data": {"sources": [{"source": f"/data/{n}", "weight": w} for n, w in WEIGHTS.items()]},
              "train": {"log_every": log_every}}

    def tokens(counts) -> dict[str, float]:
        return {f"data/tokens/{n}": float(c * SEQ_LEN) for n, c in zip(names, counts.tolist())}

    records = [{"step": step, "time": float(step), **tokens(schedule.counts(step * global_batch))} for step in range(log_every, 201, log_every)]
    [stretch] = mixture_stretches(from_records(records, config=config))  # records without data/weight: the config's
    shares = {s.name: s for s in stretch.shares}
    window = log_every * global_batch  # sequences per log window
    for name, weight in WEIGHTS.items():
        assert shares[name].weight == pytest.approx(weight)
        assert abs(shares[name].share - weight) <= STATED_BOUND / (200 * global_batch)
        assert abs(shares[name].worst_window_share - weight) <= STATED_BOUND / window
    # A window whose counts were skewed (planted: web took 30 more sequences at step 100) is the one named.
    for record in records[9:]:
        record["data/tokens/web"] += 30 * SEQ_LEN
    run = from_records(records, config=config)
    skewed = {s.name: s for s in mixture_stretches(run)[0].shares}
    assert skewed["web"].worst_window_step == 100 and skewed["web"].worst_window_share == pytest.approx((60 + 30) / (window + 30))
    lines = mixture_lines(run)
    assert lines[0].startswith("Mixture") and any(line.strip().startswith("web: weight 50%") for line in lines)
    assert mixture_stretches(from_records([{"step": 10, "time": 1.0, "train/loss": 2.0}])) == []  # not a mixture


def test_the_report_shows_each_stretch_of_a_mixture_changed_on_resume():
    """Weights and sources changed at step 100 (checkpoint.allow_changes=data): the records carry the
    weights in force, and the report compares each stretch with its own weights."""
    from raytrain_fast.report.load import from_records
    from raytrain_fast.report.mixture import mixture_facts, mixture_lines, mixture_stretches

    first, second = MixtureSchedule([0.5, 0.3, 0.2]), MixtureSchedule([0.25, 0.75])  # web, code, papers; then web, papers
    global_batch, records = 12, []
    for step in range(10, 201, 10):
        if step <= 100:
            counts, weights = dict(zip(WEIGHTS, first.counts(step * global_batch).tolist())), dict(WEIGHTS)
        else:
            given = dict(zip(WEIGHTS, first.counts(100 * global_batch).tolist()))
            now = dict(zip(("web", "papers"), second.counts((step - 100) * global_batch).tolist()))
            counts, weights = {n: given[n] + now.get(n, 0) for n in WEIGHTS}, {"web": 0.25, "papers": 0.75}
        records.append({"step": step, "time": float(step), **{f"data/tokens/{n}": float(c * SEQ_LEN) for n, c in counts.items()},
                        **{f"data/weight/{n}": w for n, w in weights.items()}})
    before, after = mixture_stretches(from_records(records))
    assert (before.first, before.last, after.first, after.last) == (0, 100, 100, 200)
    assert {s.name: round(s.share, 2) for s in before.shares} == WEIGHTS
    assert {s.name: round(s.share, 2) for s in after.shares} == {"web": 0.25, "code": 0.0, "papers": 0.75}
    assert sum(s.tokens for s in after.shares) == 100 * global_batch * SEQ_LEN  # exactly the stretch's tokens
    lines = mixture_lines(from_records(records))
    headers = [line for line in lines if line.startswith("Mixture (")]  # the second stretch alone says the weights changed
    assert [("steps 0-100" in h, "steps 100-200" in h, "weights changed on resume" in h) for h in headers] == [
        (True, False, False), (False, True, True)]
    assert "  papers: weight 75%, realised 75%" in "\n".join(lines)
    facts = mixture_facts(from_records(records))  # the report's table: every stretch, not only the last
    assert facts["mixture: web (steps 0-100)"] == "weight 50%, realised 50%"
    assert facts["mixture: papers (steps 100-200)"] == "weight 75%, realised 75%"


def test_a_mixture_trains_through_the_loop_and_logs_tokens_per_source(local_uris, ray_session, tmp_path):
    """pretrain on data.sources: the workers read the mixture, and the records' tokens per source hold the weights."""
    from raytrain_fast.launch.trainer import run
    from raytrain_fast.metrics.sinks import read_metrics
    from tests.test_train import micro_config

    items = ", ".join(f"{{source: '{local_uris[n]}', weight: {w}, name: {n}}}" for n, w in WEIGHTS.items())
    steps, global_batch = 10, 8
    config = micro_config(tmp_path, "mixed", f"data.sources=[{items}]", f"data.seq_len={SEQ_LEN}", "data.max_tokens=0",
                          f"train.steps={steps}", "checkpoint.every_steps=10", "resources.num_workers=1")
    result = run(config)
    records = [r for r in read_metrics(result.run_dir) if "data/tokens/web" in r]
    assert [r["step"] for r in records] == [5, 10]  # one per log window
    sequences = {n: records[-1][f"data/tokens/{n}"] / SEQ_LEN for n in WEIGHTS}
    assert sum(sequences.values()) == steps * global_batch
    for name, weight in WEIGHTS.items():
        assert abs(sequences[name] - weight * steps * global_batch) <= STATED_BOUND, (name, sequences)
    assert result.checkpoint is not None and result.metrics["step"] == steps
