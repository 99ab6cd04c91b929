"""Downstream scoring on a GPU: the loop's share of the tasks is scored with no synchronising CUDA call
(torch's sync debug mode raises on one), gives the CPU's log-likelihoods and counts (to a near tie),
and times itself with CUDA events."""

from __future__ import annotations

import pytest
import torch

from raytrain_fast.config import load_config
from raytrain_fast.data.tokenizer import byte_tokenizer
from raytrain_fast.downstream.encode import encode_tasks
from raytrain_fast.downstream.in_loop import RunTasks
from raytrain_fast.downstream.run import encoder_for
from raytrain_fast.downstream.tasks import load_tasks
from raytrain_fast.model import model_class

pytestmark = [pytest.mark.gpu, pytest.mark.unit]


def scored(device: str, *, sync_check: bool) -> tuple[list[float], dict[str, float]]:
    torch.manual_seed(0)
    config = load_config("tiny").model
    model = model_class(config)(config).to(device).eval()
    encoded = encode_tasks(load_tasks(["arc_easy", "winogrande", "hellaswag"], limit=64), encoder_for(byte_tokenizer(), config))
    tasks = RunTasks(tasks=encoded, window=config.max_seq_len).for_rank(rank=0, world_size=1, device=device, micro_batch=32)
    with torch.no_grad():
        if sync_check:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")  # any synchronising call in the scoring raises
        try:
            loglikelihoods = tasks.score(model)
        finally:
            if sync_check:
                torch.cuda.set_sync_debug_mode("default")
        read = loglikelihoods.tolist()  # the evaluation's one read
    return read, tasks.values(read, tokens=None)


def test_the_tasks_score_on_a_gpu_without_a_sync_and_give_the_cpus_counts():
    gpu, values = scored("cuda", sync_check=True)
    cpu, on_cpu = scored("cpu", sync_check=False)
    names = ("arc_easy", "winogrande", "hellaswag")
    items = [values[f"eval/{name}/items"] for name in names]
    assert items[:2] == [64.0, 64.0] and items == [on_cpu[f"eval/{name}/items"] for name in names]  # hellaswag leaves out endings longer than 128 bytes
    assert max(abs(a - b) for a, b in zip(gpu, cpu)) < 0.05  # TF32 and the kernels' order move the last bits
    flipped = sum(abs(values[f"eval/{n}/acc"] - on_cpu[f"eval/{n}/acc"]) * values[f"eval/{n}/items"] for n in names)
    assert flipped <= 2  # ... which may flip a near tie
    assert 0 < values["time/eval_tasks_s"] < 60 and values["time/eval_tasks_ms_per_item"] > 0
