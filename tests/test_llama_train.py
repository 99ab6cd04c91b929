"""The llama keeps what the GPT has in the loop, from a Mistral-style Hugging Face directory: a 2-worker
ZeRO-2 bf16 run continued from the weights and byte-level BPE tokenizer that transformers' Mistral saved
(`checkpoint.init_from`, `data.tokenizer`), scoring `eval.tasks` at each checkpoint, fails after its
step-10 checkpoint and resumes on 1 worker (a resize: the universal checkpoint conversion). It trains
every step on exactly the sequences an uninterrupted run trained on, with its LR and, within the
resize's stated 2% (tests/test_train.py::test_resize_round_trip_two_one_two_workers says why), its
loss; its export loads in transformers as MistralForCausalLM and generates. Real Ray, real DeepSpeed."""

from __future__ import annotations

import pytest

from raytrain_fast.launch.trainer import run
from raytrain_fast.drills import LoopHooks, RecordSequences, parse_drills
from tests.families import assert_generates, family_start
from tests.test_train import by_step, micro_config, recorded_sequences

pytestmark = [pytest.mark.slow, pytest.mark.ray]

def test_a_mistral_run_resumes_on_another_worker_count_on_the_same_data_lr_and_loss(ray_session, tmp_path, capfd):
    from raytrain_fast.checkpoint.export import export_checkpoint
    from raytrain_fast.storage import StorageConfig

    straight_dir, before, after = tmp_path / "straight", tmp_path / "before", tmp_path / "after"
    for directory in (straight_dir, before, after):
        directory.mkdir()
    # A Mistral-style directory: transformers' own model, random weights, and a byte-level BPE with
    # Mistral's special tokens, `<s>` before each text.
    start = ("model.architecture=llama", "model.tie_embeddings=false",
             *family_start("mistral", tmp_path / "mistral-style", bos=True, mistral=True),
             "eval.tasks=[arc_easy]", "eval.task_limit=4", "train.steps=20")
    straight = run(micro_config(tmp_path, "mistral-straight", *start), hooks=LoopHooks(RecordSequences(str(straight_dir))))

    marker = f"15:{tmp_path / 'failed-once'}:0"
    with pytest.raises(Exception, match="injected failure at step 15"):
        run(micro_config(tmp_path, "mistral-resized", *start), hooks=parse_drills([f"fail_once_at={marker}", f"record_sequences={before}"]))
    resumed = run(micro_config(tmp_path, "mistral-resized", *start, "resources.num_workers=1"),
                  hooks=parse_drills([f"fail_once_at={marker}", f"record_sequences={after}"]))
    assert "Resized at step 10: 2 -> 1 workers" in capfd.readouterr().out

    reference, final = by_step(straight), by_step(resumed)
    assert final[20]["start_step"] == 10 and final[20]["tokens"] == reference[20]["tokens"]
    assert final[20]["train/lr"] == pytest.approx(reference[20]["train/lr"], rel=1e-6)
    assert final[20]["train/loss"] == pytest.approx(reference[20]["train/loss"], rel=0.02)
    assert final[20]["train/loss"] < reference[10]["train/loss"]
    assert final[20]["eval/arc_easy/items"] == 4
    # Every step trained on the uninterrupted run's sequences (ranks pooled: the 1-worker phase reads both ranks' share).
    expected = {s: sorted(i for rank in recorded_sequences(straight_dir).values() for i in rank[s]) for s in range(1, 21)}
    seen: dict[int, list[int]] = {}
    for directory, steps in ((before, range(1, 11)), (after, range(11, 21))):  # steps 11-15 of the failed run were redone
        for by_rank in recorded_sequences(directory).values():
            for step in steps:
                seen.setdefault(step, []).extend(by_rank[step])
    assert {s: sorted(ids) for s, ids in seen.items()} == expected

    out = tmp_path / "hf"
    export_checkpoint(storage_uri=str(tmp_path / "runs"), storage=StorageConfig(), name="mistral-resized", step=None,
                      out_dir=str(out))
    assert_generates(out, "MistralForCausalLM")
