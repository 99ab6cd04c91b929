"""TrainMetrics in a small real step loop: host syncs, accumulated values, phase sampling, GC control,
and the two-rank drain over gloo."""

from __future__ import annotations

import gc
import json
import multiprocessing
import time
from collections import Counter
from contextlib import contextmanager

import pytest
import torch

from raytrain_fast.metrics import MetricsConfig, StepPlan, TrainMetrics
from raytrain_fast.metrics.gc_control import GcControl
from raytrain_fast.metrics.names import METRICS
from tests.s3_server import free_port

pytestmark = pytest.mark.unit


def is_documented(name: str) -> bool:
    """A metric the README's table (generated from METRICS) explains."""
    task = name.split("/")
    return name in METRICS or name.startswith("alert/slowdown_cause/") or (
        len(task) == 3 and task[0] == "eval" and f"eval/<task>/{task[2]}" in METRICS
    )


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Tiny ops: one thread is fastest, and on a busy shared CPU a second OpenMP thread spin-waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Every way Python code reads a tensor's value back to the host.
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


@contextmanager
def count_host_reads():
    counts: Counter[str] = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in _HOST_READS}

    def counting(name, original):
        def read(self, *args, **kwargs):
            counts[name] += 1
            return original(self, *args, **kwargs)

        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def _config(**overrides) -> MetricsConfig:
    defaults = {"profile_every": 4, "gc_every": 0, "slowdown_warmup_steps": 0}
    return MetricsConfig(**{**defaults, **overrides})


def _train(metrics: TrainMetrics, *, steps: int, grad_accum: int = 2, start: int = 0, on_log=None, losses=None):
    """A real (tiny) model, forward/backward, clipping and an SGD update: the loop's shape."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    data = iter([torch.randn(8, 16) for _ in range(steps * grad_accum)])
    results = {}
    for step in range(start + 1, start + steps + 1):
        metrics.begin_step()
        for _ in range(grad_accum):
            x = next(data)
            metrics.lap("data")
            loss = model(x).pow(2).mean()
            metrics.lap("forward")
            loss.backward()
            metrics.lap("backward")
            metrics.add_loss(loss)
            if losses is not None:
                losses.append(loss.detach())
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.05)
                p.grad = None
        metrics.lap("optimizer")
        metrics.add_grad_norm(grad_norm)
        metrics.end_step(step)
        if metrics.is_log_step(step):
            results[step] = metrics.log(step, lr=0.05)
    return results


def test_one_host_read_per_log_window_and_exact_means():
    steps, log_every = 40, 10
    metrics = TrainMetrics(
        _config(), steps=StepPlan(log_every=log_every, total_steps=steps, start_step=0, tokens_per_step=1024),
        device="cpu", print_progress=False,
    )
    losses: list[torch.Tensor] = []
    with count_host_reads() as reads:
        results = _train(metrics, steps=steps, losses=losses)
    metrics.close()

    # One drain (a single .tolist()) per log window, nothing else in the loop reads the device.
    assert sum(reads.values()) == steps // log_every, dict(reads)
    assert reads["tolist"] == steps // log_every
    # ... and what it drained is exactly the mean of the window's micro-batch losses.
    per_step = torch.stack(losses).view(steps, 2).mean(dim=1)
    for step, record in results.items():
        expected = per_step[step - log_every: step].mean().item()
        assert record["train/loss"] == pytest.approx(expected, rel=1e-5)
        assert record["train/grad_norm"] > 0
        assert record["train/lr"] == 0.05
        assert record["throughput/tokens_per_sec"] > 0
        assert record["memory/peak_gb"] > 0
    assert sorted(results) == [10, 20, 30, 40]
    assert all(is_documented(name) for record in results.values() for name in record)


def test_last_step_is_a_log_step_and_windows_follow_a_resume():
    metrics = TrainMetrics(
        _config(), steps=StepPlan(log_every=10, total_steps=125, start_step=100, tokens_per_step=100), device="cpu", print_progress=False
    )
    results = _train(metrics, steps=25, start=100)
    metrics.close()
    assert sorted(results) == [110, 120, 125]


def test_phases_are_sampled_on_profile_steps_only():
    metrics = TrainMetrics(
        _config(profile_every=5), steps=StepPlan(log_every=10, total_steps=10, start_step=0, tokens_per_step=100),
        device="cpu", print_progress=False,
    )
    for step in range(1, 11):
        metrics.begin_step()
        time.sleep(0.002)
        metrics.lap("data")
        time.sleep(0.05 if step in (5, 10) else 0.0)  # only the profiled steps run a slow forward
        metrics.lap("forward")
        metrics.lap("backward")
        metrics.lap("optimizer")
        metrics.add_loss(torch.tensor(1.0))
        metrics.end_step(step)
    record = metrics.log(10)
    metrics.close()
    # 0.05 s: only the two profiled (slow) steps are averaged; 0.01 s if every step had been sampled.
    # The upper bounds leave room for a loaded machine to oversleep, and still tell the phases apart.
    assert 0.05 <= record["time/forward_s"] < 1.0
    assert record["time/backward_s"] < 0.04
    # Data wait is measured on every step: at least 10 x 2 ms, less than the whole window.
    data_wait_s = record["time/data_wait_frac"] * record["time/step_s"] * 10
    assert 0.02 <= data_wait_s and record["time/data_wait_frac"] < 0.9


def test_checkpoint_time_is_reported_and_counted():
    metrics = TrainMetrics(
        _config(), steps=StepPlan(log_every=5, total_steps=5, start_step=0, tokens_per_step=100), device="cpu", print_progress=False
    )
    for step in range(1, 6):
        metrics.begin_step()
        metrics.add_loss(torch.tensor(2.0))
        metrics.end_step(step)
        if step == 3:
            metrics.record_checkpoint(blocked_s=0.03)
            metrics.record_checkpoint(upload_s=1.5)
    record = metrics.log(5)
    metrics.close()
    assert record["checkpoint/blocked_s"] == 0.03
    assert record["checkpoint/upload_s"] == 1.5
    assert record["train/loss"] == 2.0


def test_gc_control_freezes_times_and_restores():
    before = gc.get_threshold()
    control = GcControl(every_steps=3)
    control.start()
    try:
        assert gc.get_threshold()[2] >= 2**30  # no automatic full collections
        assert gc.get_freeze_count() > 0
        collected = [control.step(step) for step in range(1, 10)]
        assert collected == [False, False, True] * 3
        assert control.num_collections >= 3
        assert control.collect_s > 0
    finally:
        control.close()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0



def _rank_main(rank: int, world_size: int, port: int, out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    metrics = TrainMetrics(
        _config(profile_every=0), steps=StepPlan(log_every=5, total_steps=10, start_step=0, tokens_per_step=1000),
        device="cpu", rank=rank, world_size=world_size, print_progress=False,
    )
    grad = torch.zeros(4)
    results = {}
    for step in range(1, 11):
        metrics.begin_step()
        if rank == 1:
            time.sleep(0.02)  # rank 1's data is slow: a straggler
        metrics.lap("data")
        metrics.add_loss(torch.tensor(float(rank + 1)))  # mean over ranks = 1.5
        metrics.add_grad_norm(torch.tensor(3.0))  # the global norm: the same on every rank
        dist.all_reduce(grad)  # the gradient all-reduce that couples the ranks every step
        metrics.end_step(step)
        if metrics.is_log_step(step):
            flags = (1 << rank) if step == 10 else 0  # e.g. rank 0: "my timer is due", rank 1: "stop requested"
            results[step] = metrics.log(step, flags=flags)
            results[step]["flags_any_rank"] = float(metrics.agreed_flags)
    metrics.close()
    if rank == 0:
        with open(out_path, "w") as out:
            json.dump(results, out)
    dist.destroy_process_group()


@pytest.mark.ray
def test_two_ranks_drain_with_one_collective(tmp_path):
    out_path = str(tmp_path / "rank0.json")
    port = free_port()
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_rank_main, args=(rank, 2, port, out_path)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
        assert process.exitcode == 0
    results = json.loads(open(out_path).read())
    assert [results[step].pop("flags_any_rank") for step in ("5", "10")] == [0.0, 3.0]  # both ranks' bits, ORed
    for record in results.values():
        assert record["train/loss"] == pytest.approx(1.5)
        assert record["train/grad_norm"] == pytest.approx(3.0)
        # Rank 1 waited ~20 ms per step for data, rank 0 none: the max sets the pace, the min shows who.
        assert record["time/data_wait_frac"] > 0.5
        assert record["time/data_wait_frac_rank_min"] < 0.2
        assert "time/step_s_rank_spread" in record
        assert all(is_documented(name) for name in record)
