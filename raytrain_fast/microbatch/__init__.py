"""Choosing the micro-batch: the plan and the classification of a try that `train.micro_batch: auto`
and `raytrain-fast sweep` share (plan.py, cheap to import: no torch, no Ray), and auto's probes in
fresh processes with their cache (auto.py, imported by the launcher when the config says `auto`)."""

from raytrain_fast.microbatch.plan import (
    FAILED,
    OK,
    OOM,
    OVER_BUDGET,
    MemoryBudgetExceeded,
    Outcome,
    candidate_micro_batches,
    classify_error,
    classify_peak,
    fastest,
    plan_candidates,
)
