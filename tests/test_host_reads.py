"""The real step loop (`train_loop_per_worker`: Ray Data ingest, DeepSpeed ZeRO-2, metrics, sinks,
checkpoint) in Ray Train's local mode, with every host read of a tensor counted.

A host read (`.item()`, `.tolist()`, `.cpu()`, `float(t)`, `int(t)`, `bool(t)`) waits for all queued
device work: one per step is what makes "fast" loops slow on GPUs. The loop may read once per log
window (the drain), plus one per evaluation (its loss sum and the downstream tasks' counts together),
plus whatever a checkpoint save needs.
"""

from __future__ import annotations

import json
import multiprocessing
from collections import Counter
from pathlib import Path

import pytest

from raytrain_fast.checkpoint import list_runs
from raytrain_fast.config import load_config
from raytrain_fast.launch.checks import check_run
from raytrain_fast.launch.plan import plan_run
from raytrain_fast.loop.worker import LoopInputs
from raytrain_fast.storage import StorageConfig
from tests.s3_server import free_port

pytestmark = pytest.mark.ray

READS = ("item", "tolist", "cpu", "__float__", "__int__", "__bool__")



def _train_counting_reads(address: str, inputs: LoopInputs, port: int, out_path: str) -> None:
    """In a fresh process: Ray Train local mode (the loop runs right here), reads counted by phase."""
    import functools
    import os
    import sys

    import ray
    import ray.train
    import torch
    from ray.train.torch import TorchTrainer

    from raytrain_fast.checkpoint import Checkpointer
    from raytrain_fast.loop import steps, train_loop
    from raytrain_fast.downstream.in_loop import RankTasks
    from raytrain_fast.loop.evaluation import Evaluator
    from raytrain_fast.metrics import TrainMetrics

    # Local mode builds a real (1-process gloo) process group from torchrun's variables; DeepSpeed needs one.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ray.init(address=address)

    phase = ["setup"]
    reads: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def counting(name, original):
        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_name == "_get_value" and caller.co_filename.endswith(os.path.join("optim", "optimizer.py")):
                # torch's (non-capturable) Adam keeps its step counters on the host, on GPUs too:
                # reading them never waits for the device.
                reads["host-only:step-counter"] += 1
            else:
                reads[f"{phase[0]}:{name}"] += 1
            return original(self, *args, **kwargs)
        return wrapper

    for name in READS:
        setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))

    def in_phase(name, original):
        def wrapper(*args, **kwargs):
            outer, phase[0] = phase[0], name
            calls[name] += 1
            try:
                return original(*args, **kwargs)
            finally:
                phase[0] = "loop" if outer == "setup" and name == "step" else outer
        return wrapper

    steps.train_step = in_phase("step", steps.train_step)  # looked up by name on every step
    TrainMetrics.log = in_phase("log", TrainMetrics.log)
    Checkpointer.save = in_phase("checkpoint", Checkpointer.save)
    Evaluator.run = in_phase("eval", Evaluator.run)
    RankTasks.score = in_phase("tasks", RankTasks.score)  # inside an evaluation: its reads would be "tasks:"

    trainer = TorchTrainer(
        functools.partial(train_loop.train_loop_per_worker, inputs),
        scaling_config=ray.train.ScalingConfig(num_workers=0),  # local mode
    )
    trainer.fit()
    Path(out_path).write_text(json.dumps({"reads": reads, "calls": calls}))


def test_the_step_loop_reads_from_the_device_once_per_log_window(ray_session, tmp_path):
    steps, log_every = 12, 4
    config = load_config("tiny", [
        "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
        "data.seq_len=32", "data.max_tokens=60000", "train.micro_batch=4", "train.global_batch=8",
        f"train.steps={steps}", f"train.log_every={log_every}", "checkpoint.every_steps=0", "eval.every_steps=8",
        "eval.sequences=16", "eval.tasks=arc_easy", "eval.task_limit=8",
        "metrics.profile_every=5", "resources.num_workers=1", "resources.cpus_per_worker=1",
        "engine.precision=bf16", "optim.warmup_steps=2", f"storage.uri={tmp_path / 'runs'}",
    ], name="reads")
    inputs = LoopInputs(plan=plan_run(check_run(config)))  # eval.tasks scored at every evaluation, in its one read
    out_path = tmp_path / "reads.json"

    process = multiprocessing.get_context("spawn").Process(
        target=_train_counting_reads,
        args=(ray_session.get_runtime_context().gcs_address, inputs, free_port(), str(out_path)),
    )
    process.start()
    process.join(300)
    assert process.exitcode == 0
    counted = json.loads(out_path.read_text())
    reads, calls = Counter(counted["reads"]), counted["calls"]

    assert calls["step"] == steps
    assert calls["log"] == steps // log_every
    assert calls["eval"] == 2  # step 8 (eval.every_steps) and the last step, which also saves
    # 2 micro-batches x 12 steps, phases sampled on 2 of them: not one read in the steps or between them.
    # (bf16, as on GPUs: in fp32 DeepSpeed's ZeRO optimizer itself checks the grad norm for inf/NaN
    # with a host read every step, which no setting turns off.)
    in_loop = {key: n for key, n in reads.items() if key.split(":")[0] in ("step", "loop")}
    assert in_loop == {}, reads
    # The drain: exactly one read per log window.
    assert sum(n for key, n in reads.items() if key.startswith("log:")) == calls["log"]
    # An evaluation: exactly one read (its loss sums and task counts), none per micro-batch or item.
    assert sum(n for key, n in reads.items() if key.startswith("eval:")) == calls["eval"]
    assert calls["tasks"] == calls["eval"] and not [key for key in reads if key.startswith("tasks:")], reads
    # Local mode still saved the final checkpoint, complete, in the run's storage.
    [run] = [r for r in list_runs(str(tmp_path / "runs"), StorageConfig()) if r.name == "reads"]
    assert [(c.step, c.complete) for c in run.checkpoints] == [(steps, True)]
