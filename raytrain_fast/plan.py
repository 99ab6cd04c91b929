"""A run's plan: every setting derived from its config, resolved once on the driver (launch/plan.py)
into one frozen object that pickles, printed as the run's start-up lines and handed to every worker
in its `LoopInputs`. Workers and side concerns read it; none derives a setting from the config again."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raytrain_fast.config import Config
from raytrain_fast.config.train import Batch

if TYPE_CHECKING:
    from raytrain_fast.data.mixture import Source


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    config: Config
    """The run's config, resolved: local paths absolute, train.micro_batch and grad_accum numbers (the
    checkpoint's global batch on a resize), resources.use_gpu and cpus_per_worker, engine.precision (a
    resumed run's kept), eval.* and checkpoint.best_metric concrete. Saved with every checkpoint."""
    run_uri: str
    """`<storage.uri>/<name>`: the run's directory as the user names it."""
    filesystem: Any
    """The storage's pyarrow filesystem, built from storage.* on the driver (S3's carries its credentials:
    pyarrow ignores AWS_ENDPOINT_URL, so a bare s3:// path could go to AWS instead of MinIO)."""
    run_path: str
    """The run's directory inside `filesystem`."""
    batches: dict[int, Batch]
    """The batch split of every worker count the run may train on (each of an elastic range), all
    keeping one global batch."""
    sources: list[Source]
    """The data: every source (data.sources, or data.source as a mixture of one) with its manifest."""
    tasks: Any = None
    """eval.tasks encoded for the data's tokenizer (downstream/in_loop.py `RunTasks`), or None."""
    resume_step: int | None = None
    """The checkpoint's step a resumed run starts from; None for a new run."""
    summary: str = ""
    """The run's line: its workers, batch and storage."""
    lines: tuple[str, ...] = ()
    """The other start-up lines: what a resume changes, the precision, the data, the evaluation."""

    def batch(self, world_size: int) -> Batch:
        """The batch split of a worker group of `world_size`."""
        return self.batches[world_size]

    @property
    def remote(self) -> bool:
        """The storage is S3 (else a local or shared directory)."""
        return self.config.storage.uri.startswith("s3://")


def batch_table(config: Config, *, saved_workers: int | None = None, checkpoint: str = "") -> dict[int, Batch]:
    """The batch split of every worker count the run may train on (resources.num_workers, and each of
    an elastic range), each keeping train.global_batch: the configured micro_batch where it fits,
    else the largest below it that does (checkpoint/resize.py `fit_batch`, which names the counts that
    work when a checkpoint of `saved_workers` workers cannot be resumed on one)."""
    from raytrain_fast.checkpoint.resize import fit_batch

    train, resources = config.train, config.resources
    assert isinstance(train.micro_batch, int), "train.micro_batch=auto is resolved before the batch is split"
    table = {}
    for workers in range(max(1, min(resources.fewest_workers, resources.num_workers)), resources.num_workers + 1):
        micro_batch, grad_accum = fit_batch(
            global_batch=train.global_batch, micro_batch=train.micro_batch, num_workers=workers,
            saved_workers=saved_workers or resources.num_workers, uri=checkpoint or config.name or "run",
        )
        table[workers] = Batch(micro_batch=micro_batch, grad_accum=grad_accum, world_size=workers)
    return table

