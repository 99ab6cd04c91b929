"""The per-worker step loop that Ray's TorchTrainer runs on every worker.

`train_loop_per_worker` reads as a table of contents: set the worker up, restore the state, build
the parts in order (loop/parts.py), train (loop/rollback.py: the steps of loop/steps.py, again after
a rollback), and close the parts in reverse. Hot path: `train_step` only. Every side concern
(metrics, evaluation, checkpoint, preemption, run health) says whether this step is its step. The
loss stays on the device; the host reads it only on log steps.

What the loop takes from outside comes in its `LoopInputs` (loop/worker.py) as objects: a
`LoopHooks` (fault injection, drills, the sequence recorder; the default does nothing) and an
optional window callback (a sweep trial's Tune report). The loop imports nothing above it.
"""

from __future__ import annotations

from raytrain_fast.engine.program import prepare_process
from raytrain_fast.loop.parts import LoopParts
from raytrain_fast.loop.rollback import train_with_rollbacks
from raytrain_fast.loop.worker import LoopInputs, Worker
from raytrain_fast.metrics.host import run_at_normal_priority
from raytrain_fast.storage.filesystem import use_shipped_s3_filesystem
from raytrain_fast.watchdog.heartbeat import set_new_group_timeout


def train_loop_per_worker(inputs: LoopInputs) -> None:
    worker = setup_worker(inputs)
    with LoopParts(worker, inputs) as parts:  # what was built is closed in reverse, whatever happens
        restored = parts.restore()
        if parts.state.step >= worker.config.train.steps:
            return parts.nothing_to_do()
        parts.build(restored=restored)
        train_with_rollbacks(worker, parts)


def setup_worker(inputs: LoopInputs) -> Worker:
    """This worker's process (threads, priority, device, TF32, seeds: engine/program.py) and its place
    in the group, with the plan's batch split for the group's size."""
    import ray.train

    plan = inputs.plan
    config = plan.config
    if plan.remote:  # data and metrics are read and written through it, whatever this node's environment holds
        use_shipped_s3_filesystem(config.storage, plan.filesystem)
    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = prepare_process(threads=config.resources.cpus_per_worker, seed=config.train.seed)
    niceness = run_at_normal_priority()  # Ray starts workers at niceness 15: any other process would win the CPU
    if config.watchdog.enabled:  # DeepSpeed's own groups time out with the world group, just after the watchdog
        set_new_group_timeout(config.watchdog.process_group_timeout_s())
    return Worker(
        plan=plan, rank=rank, batch=plan.batch(context.get_world_size()), device=device,
        hooks=inputs.hooks.for_rank(rank), niceness=niceness,
    )
