"""Document masking (data.document_masking, model/documents.py): a packed row of documents gives each
document the logits it gets alone (fp32, max abs difference <= 1e-5), for the GPT (learned and rotary
positions) and the Llama family (with Qwen2's q/k/v biases, Qwen3's per-head norms and head width,
Llama 3's RoPE scaling), with activation checkpointing, the chunked loss and compiled blocks;
the loss after an end-of-document id is masked; the GPU path (flex attention) agrees with the CPU's."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from raytrain_fast.config.data import DataConfig
from raytrain_fast.model import GPT, ModelConfig, build_model, document_masking
from raytrain_fast.model.documents import (
    DocumentMasking, attend, dense_block_causal_mask, document_ids, document_layout, document_positions, flex_block_causal_mask,
)

pytestmark = pytest.mark.unit

EOD = 256
SHAPES = {
    "gpt-learned": ModelConfig(num_layers=2, d_model=64, num_heads=4, max_seq_len=64),
    "gpt-rotary": ModelConfig(num_layers=2, d_model=64, num_heads=4, max_seq_len=64, positions="rotary"),
    "llama-gqa": ModelConfig(architecture="llama", num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, max_seq_len=64,
                             tie_embeddings=False),
    "qwen2": ModelConfig(architecture="llama", family="qwen2", qkv_bias=True, num_layers=2, d_model=64, num_heads=4,
                         num_kv_heads=2, max_seq_len=64),
    "qwen3-llama3-rope": ModelConfig(architecture="llama", family="qwen3", qk_norm=True, head_dim=24, num_layers=2, d_model=64,
                                     num_heads=4, num_kv_heads=2, max_seq_len=64, rope_scaling="llama3", rope_factor=32,
                                     rope_original_max_seq_len=16),
}


def packed_rows(lengths: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, list[list[tuple[int, int]]]]:
    """Rows of documents of the given lengths, each ended by EOD (the last one of a row may be cut,
    as packing cuts it); returns the rows (B, T) and each row's (start, end) spans."""
    generator = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for row_lengths in lengths:
        row, row_spans = [], []
        for length in row_lengths:
            doc = torch.randint(0, EOD, (length,), generator=generator).tolist() + [EOD]
            row_spans.append((len(row), len(row) + len(doc)))
            row += doc
        rows.append(row)
        spans.append(row_spans)
    width = min(len(r) for r in rows)
    spans = [[(a, min(b, width)) for a, b in row if a < width] for row in spans]
    return torch.tensor([r[:width] for r in rows]), spans


def masked(config: ModelConfig, **kwargs) -> GPT:
    torch.manual_seed(0)
    model = build_model(config, "cpu", documents=DocumentMasking(eod_id=EOD, **kwargs))
    with torch.no_grad():  # biases away from their zero init, so they take part
        for name, param in model.named_parameters():
            if name.endswith("qkv.bias"):
                param.normal_(0.0, 0.3)
    return model


@pytest.mark.parametrize("shape", SHAPES)
def test_a_packed_row_gives_each_document_its_logits_alone(shape):
    model = masked(SHAPES[shape]).eval()
    tokens, spans = packed_rows([[9, 20, 13, 17], [30, 4, 40]])
    with torch.no_grad():
        packed = model(tokens)
        model.documents = None  # each document alone, plain causal attention
        alone_diffs = [
            (packed[row, a:b] - model(tokens[row:row + 1, a:b])[0]).abs().max().item()
            for row, row_spans in enumerate(spans) for a, b in row_spans
        ]
        unmasked = model(tokens)
    assert max(alone_diffs) <= 1e-5, alone_diffs
    # The property can fail: without masking, every document after the first sees the one before it.
    later = [(row, a, b) for row, row_spans in enumerate(spans) for a, b in row_spans[1:]]
    assert min((packed[r, a:b] - unmasked[r, a:b]).abs().max().item() for r, a, b in later) > 1e-3


def test_document_ids_and_positions_restart_after_each_end_of_document():
    tokens = torch.tensor([[5, 6, EOD, 7, EOD, EOD, 8, 9]])
    assert document_ids(tokens, EOD).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3]]
    assert document_positions(document_ids(tokens, EOD)).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1]]
    mask = document_layout(tokens, DocumentMasking(eod_id=EOD), dtype=torch.float32).mask[0, 0] == 0
    assert mask[3].tolist() == [False, False, False, True, False, False, False, False]  # 7 sees itself only
    assert mask[7].tolist() == [False] * 6 + [True, True]


@pytest.mark.parametrize("chunked", ["on", "off"])
def test_the_loss_after_an_end_of_document_is_masked_and_equals_the_documents_alone(chunked):
    config = ModelConfig(num_layers=2, d_model=64, num_heads=4, max_seq_len=64, positions="rotary", chunked_loss=chunked)
    model = masked(config)
    row, spans = packed_rows([[12, 7, 20, 9]], seed=1)
    tokens, targets = row[:, :-1], row[:, 1:]
    loss = model(tokens, targets)
    loss.backward()
    # Reference: each document alone, with the plain loss over the targets that do not follow an EOD.
    model.documents = None
    with torch.no_grad():
        logits = torch.cat([model(tokens[:, a:b])[0] for a, b in spans[0]])
    keep = tokens[0] != EOD
    reference = F.cross_entropy(logits[keep].float(), targets[0][keep])
    assert loss.item() == pytest.approx(reference.item(), abs=1e-5)
    assert int((~keep).sum()) == 3 and all  # the row ends with an EOD, a target only(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())
    kept = masked(config, mask_loss_after_eod=False)(tokens, targets)
    assert kept.item() != pytest.approx(loss.item(), abs=1e-4)


def test_chunked_loss_with_masked_targets_matches_the_plain_loss_and_its_gradients():
    from raytrain_fast.model.loss import chunked_cross_entropy

    torch.manual_seed(0)
    hidden = torch.randn(50, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    targets = torch.randint(0, 40, (50,))
    targets[::3] = -100
    chunked = chunked_cross_entropy(hidden, weight, targets, chunk_rows=8)
    grads = torch.autograd.grad(chunked, (hidden, weight))
    plain = F.cross_entropy(hidden @ weight.t(), targets)
    expected = torch.autograd.grad(plain, (hidden, weight))
    assert chunked.item() == pytest.approx(plain.item(), rel=1e-5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    assert grads[0][::3].abs().max().item() == 0.0  # an ignored row sends no gradient back
    with torch.no_grad():
        assert chunked_cross_entropy(hidden, weight, targets, chunk_rows=8).item() == pytest.approx(plain.item(), rel=1e-5)


@pytest.mark.parametrize("shape", ["gpt-learned", "llama-gqa", "qwen2", "qwen3-llama3-rope"])
def test_activation_checkpointing_keeps_the_masked_gradients(shape):
    tokens, _ = packed_rows([[9, 20, 13, 17], [30, 4, 40]], seed=2)
    grads = {}
    for setting in ("none", "full"):
        config = dataclasses.replace(SHAPES[shape], activation_checkpointing=setting)
        model = masked(config).train()
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        grads[setting] = [p.grad.clone() for p in model.parameters()]
    for plain, recomputed in zip(grads["none"], grads["full"]):
        torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-6)


@pytest.mark.e2e  # torch.compile of the blocks: 12-27 s on the 2-core machine
def test_compiled_blocks_give_the_eager_masked_loss_and_gradients():
    from raytrain_fast.engine.compile import compile_blocks

    tokens, _ = packed_rows([[9, 20, 13, 17], [30, 4, 40]], seed=3)
    # The llama with Qwen3's options and Llama 3's RoPE scaling (the GPT's compiled blocks: test_model_scale.py).
    eager, compiled = masked(SHAPES["qwen3-llama3-rope"]), masked(SHAPES["qwen3-llama3-rope"])
    assert compile_blocks(compiled, setting="on", device=torch.device("cpu"))[0]
    losses = []
    for model in (eager, compiled):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)
    for a, b in zip(eager.parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)


def test_the_run_config_turns_masking_on_with_the_manifests_end_of_document_id():
    assert document_masking(DataConfig(), eod_id=EOD) is None
    on = document_masking(DataConfig(document_masking=True, mask_loss_after_eod=False), eod_id=50_256)
    assert on == DocumentMasking(eod_id=50_256, mask_loss_after_eod=False)
    model = build_model(SHAPES["gpt-learned"], "cpu", documents=on)
    assert model.documents == on


def test_the_gpu_paths_block_mask_keeps_the_same_documents_as_the_cpu_mask():
    # Flex attention runs on the CPU too, forward only (torch 2.13 has no CPU backward): the
    # BlockMask's rule (flex_block_causal_mask, the CUDA path) against the dense mask SDPA gets here.
    from torch.nn.attention.flex_attention import flex_attention

    tokens = torch.randint(0, EOD, (2, 256), generator=torch.Generator().manual_seed(4))
    tokens[0, [10, 50, 130, 200]] = EOD
    tokens[1, [128]] = EOD
    doc_ids = document_ids(tokens, EOD)
    q, k, v = (torch.randn(2, 4, 256, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_causal_mask(doc_ids))
    block_mask = flex_block_causal_mask(doc_ids)
    flex = flex_attention(q, k, v, block_mask=block_mask)
    assert (dense - flex).abs().max().item() <= 1e-5
    # As a compiled block calls it on a GPU (engine.compile: auto is on there): flex inside the compile.
    compiled = torch.compile(lambda q, k, v, mask: attend(q, k, v, mask, dropout_p=0.0))(q, k, v, block_mask)
    assert (dense - compiled).abs().max().item() <= 1e-5
    unmasked = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (flex - unmasked).abs().max().item() > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", SHAPES)
def test_on_a_gpu_flex_attention_gives_each_document_its_logits_alone(shape):
    from torch.nn.attention.flex_attention import BlockMask

    torch.manual_seed(0)
    model = build_model(SHAPES[shape], "cuda", documents=DocumentMasking(eod_id=EOD)).eval()
    tokens, spans = packed_rows([[9, 20, 13, 17], [30, 4, 40]])
    tokens = tokens.cuda()
    assert isinstance(document_layout(tokens, model.documents, dtype=torch.float32).mask, BlockMask)
    with torch.no_grad():
        packed = model(tokens)
        model.documents = None
        diffs = [(packed[r, a:b] - model(tokens[r:r + 1, a:b])[0]).abs().max().item() for r, s in enumerate(spans) for a, b in s]
    assert max(diffs) <= 1e-4, diffs  # fp32 on a GPU: TF32 is off by default for plain torch


@pytest.mark.ray
def test_a_real_run_trains_with_masking_on_through_the_loop(ray_session, tmp_path):
    """From a Qwen3-style Hugging Face directory (its weights and tokenizer), scoring eval.tasks: the
    masked run fails once after step 4, resumes from step 3, and its export loads in transformers as
    Qwen3 and generates."""
    import json
    from pathlib import Path

    import transformers

    from raytrain_fast.checkpoint.export import export_checkpoint
    from raytrain_fast.config import load_config
    from raytrain_fast.drills import parse_drills
    from raytrain_fast.launch.trainer import run
    from raytrain_fast.storage import StorageConfig
    from tests.families import FAMILIES, RUN_SHAPE, family_model, family_tokenizer
    from tests.test_train import by_step

    # Short documents (one per JSON line, ~70 bytes), so that most 32-token rows hold an end of document.
    lines = [json.dumps({"text": f"doc {i}: " + "the quick brown fox jumps over the lazy dog "[: 20 + i % 40]}) for i in range(3000)]
    (tmp_path / "short.jsonl").write_text("\n".join(lines) + "\n")
    start = tmp_path / "qwen3-style"
    family_model("qwen3").save_pretrained(str(start))
    source = Path(__file__).resolve().parent.parent / "raytrain_fast" / "model"
    family_tokenizer(start, bos=False, texts=[path.read_text() for path in source.glob("*.py")])
    common = (*RUN_SHAPE, *FAMILIES["qwen3"][2], f"checkpoint.init_from={start}", f"data.tokenizer={start}",
              "resources.num_workers=1", "train.micro_batch=8", "train.global_batch=8", "train.steps=6",
              "train.log_every=3", "checkpoint.every_steps=3", "optim.warmup_steps=3", "optim.lr=0.01",
              "engine.precision=fp32", f"data.source={tmp_path / 'short.jsonl'}", "data.seq_len=32", "data.max_tokens=0",
              "eval.sequences=8", "eval.tasks=[arc_easy]", "eval.task_limit=4", "resources.max_failures=1", f"storage.uri={tmp_path / 'runs'}")
    losses = {}
    for masking in (False, True):
        drills = parse_drills([f"fail_once_at=4:{tmp_path / 'failed-once'}"] if masking else [])
        result = run(load_config("llama-tiny", [*common, f"data.document_masking={masking}"], name=f"masking-{masking}"),
                     hooks=drills)
        steps = by_step(result)
        losses[masking] = [steps[s]["train/loss"] for s in (3, 6)]
        assert all(map(math.isfinite, losses[masking])) and math.isfinite(steps[6]["val/loss"])
    assert steps[6]["start_step"] == 3  # the masked run failed after step 4 and went on from step 3
    assert steps[6]["eval/arc_easy/items"] == 4
    out = tmp_path / "hf"
    export_checkpoint(storage_uri=str(tmp_path / "runs"), storage=StorageConfig(), name="masking-True", step=None,
                      out_dir=str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.config.head_dim == 24
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    tokens = tokenizer("doc 7: the quick brown", return_tensors="pt")["input_ids"]
    generated = model.generate(tokens, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] > tokens.shape[1] and tokenizer.decode(generated[0, :tokens.shape[1]]) == "doc 7: the quick brown"
    # Same seed, same data, same weights at step 0: only masking differs. A loop that dropped the setting
    # would train the masked run to the unmasked run's losses.
    assert abs(losses[True][0] - losses[False][0]) > 1e-3, losses
