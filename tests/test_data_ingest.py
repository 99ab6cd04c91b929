"""Training-side ingest: manifest checks, the world-size-free sequence shuffle, and exact resume through Ray Data."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from raytrain_fast.data import BatchIterator, check_manifest_matches, load_manifest, prepare_data
from raytrain_fast.data.mixture import MixturePosition, Source
from raytrain_fast.data.order import SHUFFLE_WINDOW_SHARDS, EpochOrder, locate_absolute, rank_indexes, shard_order, usable_rows
from raytrain_fast.errors import DataError

pytestmark = pytest.mark.ray

SEQ_LEN = 8
MICRO_BATCH = 4
NUM_SEQUENCES = 64  # 4 files x (143 bytes + EOD) = 576 tokens = 64 rows of 9


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("ingest")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_bytes(bytes([97 + i]) * 143)
    # 7 rows per shard: 10 shards (the last has 1 row), so shard and rank boundaries never line up.
    manifest = prepare_data(inputs=[str(corpus)], output=str(root / "out"), seq_len=SEQ_LEN, rows_per_shard=7, verbose=False)
    assert manifest.num_sequences == NUM_SEQUENCES and len(manifest.shards) == 10
    return load_manifest(str(root / "out"))


def one(manifest, max_sequences=None) -> list[Source]:
    """A single data.source: a mixture of one."""
    return [Source(name="data", weight=1.0, manifest=manifest, max_sequences=max_sequences)]


def take(iterator: BatchIterator, n: int) -> tuple[list[int], list[MixturePosition]]:
    """seq_ids of the next n batches and the position after each."""
    ids, positions = [], []
    for _ in range(n):
        tokens, seq_ids = next(iterator)
        assert tokens.shape == (MICRO_BATCH, SEQ_LEN + 1) and str(tokens.dtype) == "torch.int64"
        ids += seq_ids.tolist()
        positions.append(iterator.position)
    return ids, positions


def test_manifest_mismatches_are_named(prepared):
    assert check_manifest_matches(prepared, seq_len=SEQ_LEN, vocab_size=320) == []
    problems = check_manifest_matches(prepared, seq_len=16, vocab_size=256)
    assert len(problems) == 2
    assert "data.seq_len is 16" in problems[0] and "seq_len 8" in problems[0]
    assert "model.vocab_size (256)" in problems[1] and "257" in problems[1]


def test_missing_manifest_says_how_to_prepare(tmp_path):
    with pytest.raises(DataError, match="prepare-data"):
        load_manifest(str(tmp_path))


def test_positions_of_earlier_versions_read_as_places_in_the_one_stream():
    first = {"name": "data", "weight": 1.0}

    def read(saved):
        return MixturePosition.from_dict(json.loads(json.dumps(saved)), first=first, first_rows=64)

    position = MixturePosition(consumed=200, sources=[first])
    assert read(position.to_dict()) == position
    # A single source's {epoch, consumed} is a place in its one stream; the older per-rank one ({epoch,
    # consumed per rank, world_size}) the same share of its epoch.
    assert read({"epoch": 3, "consumed": 40, "stream": "sequence-shuffle-v1"}) == MixturePosition(consumed=3 * 64 + 40, sources=[first])
    assert read({"epoch": 2, "consumed": 12, "world_size": 2}).consumed == 2 * 64 + 24
    for bad in ({"epoch": 1, "step": 2}, {"epoch": -1, "consumed": 0}, {"epoch": 1, "consumed": 0, "stream": "other"}):
        with pytest.raises(DataError):
            read(bad)


def stream_ids(prepared, *, seed, start, rank, world_size, micro_batch, batches, rows=None):
    """seq_ids of rank `rank`'s micro-batches of the single-source stream after global index `start`."""
    indexes = rank_indexes(start, rank=rank, world_size=world_size, micro_batch=micro_batch, batches=batches, first_batch=0)
    _, _, shards, in_shard = locate_absolute(rows or usable_rows(prepared), indexes, seed=seed, orders={})
    first = [s.first_seq_id for s in prepared.shards]
    return [first[s] + r for s, r in zip(shards.tolist(), in_shard.tolist())]


def test_shuffle_is_deterministic_per_seed_and_epoch_and_covers_every_sequence_once(prepared):
    rows = usable_rows(prepared)
    orders = set()
    for epoch in range(3):
        order = EpochOrder(rows, seed=7, epoch=epoch)
        shards, in_shard = order.locate(np.arange(NUM_SEQUENCES))
        again = EpochOrder(rows, seed=7, epoch=epoch).locate(np.arange(NUM_SEQUENCES))
        assert np.array_equal(shards, again[0]) and np.array_equal(in_shard, again[1])  # same (seed, epoch), same order
        ids = [prepared.shards[s].first_seq_id + r for s, r in zip(shards.tolist(), in_shard.tolist())]
        assert sorted(ids) == list(range(NUM_SEQUENCES))  # every sequence exactly once per epoch
        orders.add(tuple(ids))
    assert len(orders) == 3  # a new order every epoch
    other_seed = EpochOrder(rows, seed=8, epoch=0).locate(np.arange(NUM_SEQUENCES))[1]
    assert not np.array_equal(other_seed, EpochOrder(rows, seed=7, epoch=0).locate(np.arange(NUM_SEQUENCES))[1])
    assert shard_order(10, seed=1, epoch=0) == shard_order(10, seed=1, epoch=0) != shard_order(10, seed=2, epoch=0)
    assert usable_rows(prepared, max_sequences=10) == [7, 3] + [0] * 8
    # Windows: with more shards than a window, sequences only move within their window.
    many = [5] * (2 * SHUFFLE_WINDOW_SHARDS + 3)
    order = EpochOrder(many, seed=1, epoch=0)
    shards, _ = order.locate(np.arange(5 * SHUFFLE_WINDOW_SHARDS))
    assert set(shards.tolist()) == set(shard_order(len(many), seed=1, epoch=0)[:SHUFFLE_WINDOW_SHARDS])


def test_ranks_slice_one_stream_that_knows_no_world_size(prepared):
    """Micro-batch k of rank r is stream[(k * W + r) * B : +B]: any W slices the same global stream,
    and the epochs follow each other without dropping a sequence."""
    start = 0
    single = stream_ids(prepared, seed=3, start=start, rank=0, world_size=1, micro_batch=4, batches=40)
    for world_size in (2, 3):
        shares = [stream_ids(prepared, seed=3, start=start, rank=r, world_size=world_size, micro_batch=4, batches=6) for r in range(world_size)]
        interleaved = [i for k in range(6) for r in range(world_size) for i in shares[r][k * 4 : (k + 1) * 4]]
        assert interleaved == single[: len(interleaved)]
    assert sorted(single[:64]) == sorted(single[64:128]) == list(range(64))
    # A resize mid-epoch: 2 ranks take 3 rounds (24 sequences), then 3 ranks with micro-batch 2 go on.
    taken = [i for r in range(2) for i in stream_ids(prepared, seed=3, start=start, rank=r, world_size=2, micro_batch=4, batches=3)]
    resumed = 24
    rest = [i for r in range(3) for i in stream_ids(prepared, seed=3, start=resumed, rank=r, world_size=3, micro_batch=2, batches=6)]
    assert len(taken + rest) == len(set(taken + rest)) == 60  # none twice
    assert set(taken + rest) == set(single[:60])


def test_a_micro_batch_mixes_documents_and_files(prepared, ray_session):
    """The corpus is 4 files of one repeated byte each (16 sequences per file). A shard-order stream
    gave 16 consecutive sequences of one file; the sequence shuffle draws from all of them."""
    with BatchIterator(one(prepared), rank=0, world_size=1, micro_batch=16, seed=0) as it:
        for _ in range(4):
            tokens, seq_ids = next(it)
            files = {int(b) for b in tokens[:, :-1].flatten().tolist() if 97 <= b < 101}
            assert len(files) >= 3, f"a batch of 16 drew from {len(files)} files only: {seq_ids.tolist()}"
            assert len({i // 16 for i in seq_ids.tolist()}) >= 3


def test_ranks_cover_every_sequence_once_per_epoch(prepared, ray_session):
    per_epoch = NUM_SEQUENCES // 2 // MICRO_BATCH
    seen = {}
    for rank in (0, 1):
        with BatchIterator(one(prepared), rank=rank, world_size=2, micro_batch=MICRO_BATCH, seed=5, prefetch_batches=2) as it:
            ids, positions = take(it, 2 * per_epoch)
            assert [p.consumed for p in positions] == [(k + 1) * MICRO_BATCH * 2 for k in range(2 * per_epoch)]
            assert it.epochs == 2.0
        assert ids == stream_ids(prepared, seed=5, start=0, rank=rank, world_size=2, micro_batch=MICRO_BATCH, batches=2 * per_epoch)
        seen[rank] = ids
    half = per_epoch * MICRO_BATCH
    for epoch in (0, 1):
        both = seen[0][epoch * half : (epoch + 1) * half] + seen[1][epoch * half : (epoch + 1) * half]
        assert sorted(both) == list(range(NUM_SEQUENCES))
    assert seen[0][:half] != seen[0][half:]  # reshuffled between epochs

    with BatchIterator(one(prepared, max_sequences=20), rank=0, world_size=1, micro_batch=MICRO_BATCH, seed=5) as it:
        ids, _ = take(it, 10)  # 20 sequences = 5 batches an epoch
    assert sorted(ids[:20]) == sorted(ids[20:]) == list(range(20))


def test_resume_continues_exactly_where_it_stopped(prepared, ray_session):
    per_epoch = NUM_SEQUENCES // 2 // MICRO_BATCH  # 8 batches
    total = 3 * per_epoch
    # Stop points: mid-epoch, mid next epoch, exactly at an epoch boundary, just after one.
    stops = {0: (3, per_epoch + 5), 1: (per_epoch, 2 * per_epoch + 1)}
    reference_rank0 = []
    for rank in (0, 1):
        with BatchIterator(one(prepared), rank=rank, world_size=2, micro_batch=MICRO_BATCH, seed=11) as it:
            reference, positions = take(it, total)
        reference_rank0 = reference_rank0 or reference
        for k in stops[rank]:
            saved = json.loads(json.dumps(positions[k - 1].to_dict()))  # what a checkpoint stores after k batches
            with BatchIterator(one(prepared), rank=rank, world_size=2, micro_batch=MICRO_BATCH, seed=11, position=saved) as it:
                assert it.position == positions[k - 1]
                rest, _ = take(it, total - k)
            assert reference[: k * MICRO_BATCH] + rest == reference, f"rank {rank}, resumed after {k} batches"
    # A checkpoint of an earlier version holds the single-source stream's {epoch, consumed}: the same place.
    legacy = {"epoch": 1, "consumed": 3 * 2 * MICRO_BATCH, "stream": "sequence-shuffle-v1"}
    with BatchIterator(one(prepared), rank=0, world_size=2, micro_batch=MICRO_BATCH, seed=11, position=legacy) as it:
        assert take(it, 2)[0] == reference_rank0[(per_epoch + 3) * MICRO_BATCH:(per_epoch + 5) * MICRO_BATCH]


def test_the_loop_takes_micro_batches_from_its_own_buffer_between_hand_overs(prepared, ray_session):
    """Ray Data delivers HANDOVER_BATCHES micro-batches at a time and the producer thread hands them
    over as one group: after the first next(), the rest of the group waits in the iterator's own
    buffer, so the next steps touch no queue and wake no thread. The order and positions
    across group and chunk boundaries are the tests above."""
    from raytrain_fast.data.ingest import HANDOVER_BATCHES

    with BatchIterator(one(prepared), rank=0, world_size=1, micro_batch=MICRO_BATCH, seed=3) as it:
        assert it._batches_per_chunk >= HANDOVER_BATCHES  # a whole group fits in the chunk
        tokens, _ = next(it)
        assert len(it._ready) == HANDOVER_BATCHES - 1
        for left in range(HANDOVER_BATCHES - 2, -1, -1):
            next_tokens, _ = next(it)
            assert len(it._ready) == left
            assert next_tokens.data_ptr() == tokens.data_ptr() + tokens.numel() * tokens.element_size()  # views of one batch
            tokens = next_tokens
        next(it)
        assert len(it._ready) == HANDOVER_BATCHES - 1  # the next group


def test_a_source_smaller_than_a_micro_batch_goes_on_into_its_next_epoch(prepared, ray_session):
    with BatchIterator(one(prepared), rank=0, world_size=1, micro_batch=NUM_SEQUENCES + 8, seed=2) as it:
        _, seq_ids = next(it)
    ids = seq_ids.tolist()
    assert sorted(ids[:NUM_SEQUENCES]) == list(range(NUM_SEQUENCES)) and len(set(ids[NUM_SEQUENCES:])) == 8
    with pytest.raises(DataError, match="holds no training sequences"):
        BatchIterator(one(dataclasses.replace(prepared, shards=[])), rank=0, world_size=1, micro_batch=4)


def test_bench_data_reports_both_paths(tmp_path, ray_session):
    from raytrain_fast.bench.data import bench_data

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "text.txt").write_text("some text to train on. " * 400)
    result = bench_data(steps=3, warmup_steps=1, rounds=1, micro_batch=4, seq_len=32, source=str(corpus), cache_dir=str(tmp_path / "cache"), verbose=False)
    assert result["steps_measured"] == 3 and json.loads(json.dumps(result)) == result
    for key in ("data_wait_frac", "data_wait_frac_baseline", "data_wait_frac_mixture"):
        assert 0 <= result[key] < 1
    assert result["tokens_per_sec"] > 0 and result["tokens_per_sec_baseline"] > 0 and result["tokens_per_sec_mixture"] > 0
    realised, weights = result["mixture"]["realised"], result["mixture"]["weights"]
    assert set(realised) == set(weights) == {"a", "b", "c"} and sum(realised.values()) == pytest.approx(1)
