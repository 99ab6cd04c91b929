"""Every metric the step loop emits, with what it means (docs/metrics.md has a row for each; tests/test_docs.py checks it)."""

from __future__ import annotations

METRICS: dict[str, str] = {
    "train/loss": "Mean training loss over the log window (all micro-batches of all ranks).",
    "train/lr": "Learning rate at the log step.",
    "train/grad_norm": "Mean global gradient norm (before clipping) over the window's optimizer steps.",
    "throughput/tokens_per_sec": "Tokens trained per second across all ranks, over the window's wall time (checkpoint stalls included).",
    "throughput/mfu": "Model FLOPs utilisation against the datasheet peak of the device and dtype; absent where the peak is unknown (CPUs, unlisted GPUs).",
    "throughput/mfu_measured_peak": "Model FLOPs utilisation against the matmul peak measured on this device type in the training dtype (works on CPUs too).",
    "time/step_s": "Wall time per optimizer step over the window, exact (measured between two host syncs).",
    "time/data_wait_frac": "Share of the window spent waiting for the next batch, on the rank that waited most.",
    "time/data_wait_frac_rank_min": "The same on the rank that waited least (multi-rank runs): a large gap to time/data_wait_frac points at one rank's data.",
    "time/step_s_rank_spread": "Per step, how much later the slowest rank reached the log step than the fastest (multi-rank runs).",
    "time/forward_s": "Forward time of one optimizer step (all micro-batches), sampled every metrics.profile_every steps.",
    "time/backward_s": "Backward time of one optimizer step (gradient reduction overlapped with it included), sampled.",
    "time/optimizer_s": "Optimizer-step time of one optimizer step, sampled.",
    "checkpoint/blocked_s": "Seconds training was blocked per checkpoint saved in the window.",
    "checkpoint/upload_s": "Seconds the last checkpoint upload took (async uploads report it when done).",
    "memory/peak_gb": "Peak memory in GB: CUDA max_memory_reserved on GPU (what the allocator holds), peak RSS of the process on CPU.",
    "memory/peak_frac": "memory/peak_gb as a share of the device's total memory (GPU) or of resources.memory_budget_gb (CPU); absent when neither is known. Far below 1: a larger micro-batch (train.micro_batch=auto, `raytrain-fast sweep`) may train faster.",
    "memory/current_gb": "Memory in use at the log step (CUDA reserved, or RSS on CPU).",
    "gc/collect_s": "Seconds in Python garbage collection during the window (the rank with most).",
    "gc/collections": "Garbage collections (all generations) on rank 0 during the window.",
    "sink/dropped": "Records dropped so far because the sink queue was full (the oldest go first).",
    "sink/backlog": "Records waiting for the sink thread at the log step.",
    "sink/errors": "Sink calls that raised so far (the first one of each kind is logged).",
    "alert/slowdown": "1 while the rolling median step time is above the run's baseline by more than metrics.slowdown_threshold, else 0.",
    "alert/slowdown_ratio": "Rolling median step time (the last metrics.slowdown_windows windows) / baseline step time: what alert/slowdown compares with the threshold.",
    "alert/slowdown_cause/<cause>": "1 at the step a slowdown alert starts; <cause> is data_wait, gc, checkpoint, sink, memory or unexplained.",
}
