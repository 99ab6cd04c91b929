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

from dataclasses import replace

from raytrain_fast.config import Config
from raytrain_fast.engine.program import prepare_process
from raytrain_fast.loop.evaluation import resolve_eval
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
    """This worker's process (threads, priority, device, TF32, seeds: engine/program.py), the data's
    manifest and the config for the group's size."""
    import ray.train

    from raytrain_fast.data import load_manifest

    config = inputs.config
    if inputs.s3_filesystem is not None:
        use_shipped_s3_filesystem(config.storage, inputs.s3_filesystem)
    manifest = load_manifest(inputs.data_uri, config.storage)
    config, _ = resolve_eval(config, manifest)  # the driver printed the notes and raised the errors
    context = ray.train.get_context()
    rank = context.get_world_rank()
    device = prepare_process(threads=config.resources.cpus_per_worker, seed=config.train.seed)
    niceness = run_at_normal_priority()  # Ray starts workers at niceness 15: any other process would win the CPU
    if config.watchdog.enabled:  # DeepSpeed's own groups time out with the world group, just after the watchdog
        set_new_group_timeout(config.watchdog.process_group_timeout_s())
    world_size = context.get_world_size()
    config = keep_global_batch(config, world_size)
    return Worker(
        config=config, rank=rank, world_size=world_size, grad_accum=config.grad_accum(),
        device=device, hooks=inputs.hooks.for_rank(rank), niceness=niceness, manifest=manifest,
    )


def keep_global_batch(config: Config, world_size: int) -> Config:
    """An elastic run's worker group may be smaller than resources.num_workers (its MAX): the global
    batch stays the configured one, with micro_batch x grad_accum refitted for the group's size (the
    driver checked that every size of the range fits)."""
    from raytrain_fast.checkpoint.resize import fit_batch

    resources, train = config.resources, config.train
    if world_size == resources.num_workers:
        return config
    global_batch = int(train.micro_batch) * config.grad_accum() * resources.num_workers
    micro_batch, grad_accum = fit_batch(
        global_batch=global_batch, micro_batch=int(train.micro_batch), num_workers=world_size,
        saved_workers=resources.num_workers, uri=config.name or "run",
    )
    return replace(
        config, train=replace(train, global_batch=global_batch, micro_batch=micro_batch, grad_accum=grad_accum),
        resources=replace(resources, num_workers=world_size, min_workers=None),
    )


