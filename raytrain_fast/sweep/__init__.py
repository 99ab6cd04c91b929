"""Ray Tune sweeps over micro-batch x gradient accumulation at a fixed global batch: early
stopping of trials clearly behind (beyond timing noise), concurrency derived from the resources a trial needs, a failed trial (out of memory,
over budget, invalid) recorded with its reason while the sweep goes on."""

from raytrain_fast.sweep.runner import SweepSpec, max_concurrent_trials, plan, run_sweep
