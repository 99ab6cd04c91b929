"""`raytrain-fast bench health`: what the divergence checks cost a training step. One bare step with
the two functions the loop calls (`skip_nonfinite_update`, `StepAccumulators.add_grad_norm`) and
without them, interleaved in rounds; what it measures and how: docs/health.md#cost.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from raytrain_fast.errors import ConfigError
from raytrain_fast.console import say


def bench_health(*, size: str = "tiny", steps: int = 20, rounds: int = 10, warmup_steps: int = 5,
                 precision: str = "auto", threads: int = 0, ops_calls: int = 5000) -> dict[str, Any]:
    import torch

    from raytrain_fast.bench.overhead_setup import OverheadSetup
    from raytrain_fast.engine.program import prepare_process
    from raytrain_fast.metrics.peak import cpu_model_name

    if steps < 1 or rounds < 2 or warmup_steps < 0 or ops_calls < 1:
        raise ConfigError(f"bench health needs --steps >= 1, --rounds >= 2 (a ratio per round, the median of them), --warmup-steps "
                          f">= 0 and --ops-calls >= 1; got --steps {steps} --rounds {rounds} --warmup-steps {warmup_steps} "
                          f"--ops-calls {ops_calls}")
    setup = OverheadSetup.for_size(size, precision=precision, threads=threads).resolved()
    device = prepare_process(threads=setup.threads, seed=setup.seed)
    bare = _BareStep(setup, device)
    for i in range(warmup_steps):
        bare.step(checked=i % 2 == 0)
    per_step: dict[str, list[float]] = {"without": [], "with": []}
    ratios, orders = [], []
    for r in range(rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        seconds = {name: bare.timed_round(checked=name == "with", steps=steps) for name in order}
        for name, value in seconds.items():
            per_step[name].append(value)
        ratios.append(seconds["with"] / seconds["without"])
        orders.append(list(order))
        say(f"[bench health] round {r + 1}/{rounds}: without {seconds['without'] * 1e3:.1f} ms/step, "
            f"with {seconds['with'] * 1e3:.1f} ms/step", stderr=True)  # progress on stderr: stdout is the JSON alone

    ops = _ops_cost(bare.optimizer, device, calls=ops_calls, rounds=rounds)
    without, with_checks = statistics.median(per_step["without"]), statistics.median(per_step["with"])
    return {
        "bench": "health",
        "what": "one bare training step with the divergence checks (found_inf for the fused AdamW, a where on the "
                "norm) vs without them; median over interleaved rounds",
        "model": size, "d_model": setup.d_model, "layers": setup.num_layers, "micro_batch": setup.micro_batch,
        "seq_len": setup.seq_len, "precision": setup.precision, "threads": torch.get_num_threads(),
        "fused_adamw": bool(bare.optimizer.defaults.get("fused")), "device": str(device),
        "cpu": cpu_model_name(), "cpu_cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
        "steps_per_round": steps, "rounds": rounds, "order": orders,
        "step_ms_without": without * 1e3, "step_ms_with": with_checks * 1e3,
        "ratio_with_over_without": statistics.median(ratios),
        "ratio_min": min(ratios), "ratio_max": max(ratios),
        **ops,
    }


class _BareStep:
    """The bare training step (engine/step.py's `train_step` on bench overhead's plain engine), with
    the divergence checks (the device-side update guard, the loop's on-device sums) or without them
    (plain sums)."""

    def __init__(self, setup: Any, device: Any) -> None:
        import itertools

        from raytrain_fast.bench.bare_loops import build_bare
        from raytrain_fast.metrics.accumulators import StepAccumulators

        self.device = device
        self.engine, batches = build_bare(setup, device)
        self.optimizer = self.engine.optimizer
        self.batches = itertools.cycle([(tokens, None) for tokens in batches])
        self.sums = StepAccumulators(device=device, profile_every=0, start_step=0)  # the loop's own sums
        self.plain = _PlainSums(device)

    def step(self, checked: bool) -> None:
        from raytrain_fast.engine.step import train_step

        self.engine.guard_nonfinite = checked
        train_step(self.engine, self.batches, grad_accum=1, metrics=self.sums if checked else self.plain)

    def sync(self) -> None:
        import torch

        float(self.sums.sums.sum() + self.plain.sums.sum())  # the clock stops when the device is done
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed_round(self, *, checked: bool, steps: int) -> float:
        """Seconds per step over `steps` steps."""
        if not checked:
            self.optimizer.__dict__.pop("found_inf", None)  # the kernel reads no flag at all
        self.sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.step(checked)
        self.sync()
        return (time.perf_counter() - start) / steps


class _PlainSums:
    """The loss and grad-norm sums as plain device adds: the step without the checks' `where`."""

    def __init__(self, device: Any) -> None:
        import torch

        self.sums = torch.zeros(2, device=device)

    def begin_step(self) -> None:
        pass

    def lap(self, phase: str) -> None:
        pass

    def add_loss(self, loss: Any) -> None:
        self.sums[0].add_(loss.detach())

    def add_grad_norm(self, grad_norm: Any) -> None:
        self.sums[1].add_(grad_norm.detach())


def _ops_cost(optimizer: Any, device: Any, *, calls: int, rounds: int) -> dict[str, float]:
    """The checks' own ops on a computed norm, per call (median over interleaved rounds), beside the
    plain add they replace."""
    import torch

    from raytrain_fast.engine.deepspeed_compat import skip_nonfinite_update
    from raytrain_fast.metrics.accumulators import StepAccumulators

    norm = torch.tensor(1.5, device=device)
    plain_sum = torch.zeros((), device=device)
    sums = StepAccumulators(device=device, profile_every=0, start_step=0)

    def plain() -> None:
        plain_sum.add_(norm)

    def checked() -> None:
        skip_nonfinite_update(optimizer, norm)
        sums.add_grad_norm(norm)

    times: dict[str, list[float]] = {"plain": [], "checked": []}
    for r in range(rounds):
        for name, call in ((("plain", plain), ("checked", checked)) if r % 2 == 0 else (("checked", checked), ("plain", plain))):
            start = time.perf_counter()
            for _ in range(calls):
                call()
            float(plain_sum + sums.sums.sum())  # the device is done with both (one read)
            times[name].append((time.perf_counter() - start) / calls)
    optimizer.__dict__.pop("found_inf", None)
    plain_us, checked_us = statistics.median(times["plain"]) * 1e6, statistics.median(times["checked"]) * 1e6
    return {"ops_us_plain": plain_us, "ops_us_checked": checked_us, "ops_us_added": checked_us - plain_us}
