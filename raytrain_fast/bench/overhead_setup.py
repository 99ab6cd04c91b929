"""What every variant of `raytrain-fast bench overhead` shares: the model sizes, the setup (model,
batch, precision, threads, steps), the run config our loop trains with, and one measurement record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


MODEL_SIZES: dict[str, dict[str, int]] = {
    "tiny": {"d_model": 128, "num_layers": 4, "num_heads": 4},  # the tiny preset
    "medium": {"d_model": 384, "num_layers": 6, "num_heads": 6},
    "large": {"d_model": 512, "num_layers": 8, "num_heads": 8},
}
"""Model shapes by name (the rest of the model is the tiny preset's: 320-row vocabulary, learned positions, tied embeddings)."""

SIZE_DEFAULTS: dict[str, dict[str, int]] = {
    # log_every divides warmup_steps and steps: the window holds whole log windows.
    "tiny": {"warmup_steps": 50, "steps": 200, "log_every": 50, "repeats": 3},
    "medium": {"seq_len": 256, "micro_batch": 8, "warmup_steps": 10, "steps": 40, "log_every": 10, "repeats": 3},
    "large": {"warmup_steps": 5, "steps": 30, "log_every": 5, "repeats": 3},
}
"""`raytrain-fast bench overhead` defaults per size, each variant's timed window a steady state of
20-40 s on 2 CPU cores: tiny 200 steps of ~0.12 s after 50 warm-up steps (the first
log windows of a run are its slowest: allocator, kernel selection, W&B start-up); medium
(d_model 384, 6 layers, seq 256, micro-batch 8) 40 steps of ~0.6 s after 10; large 30 steps of
~1.3 s after 5."""

TYPICAL_RAY_TRAIN_MAX_STEPS = 30
"""`typical_ray_train` reports every step and Ray Train takes one report per controller poll (2 s):
its rate is the poll's, known to 0.1% in 30 steps, so it times at most this many (its run record
says how many) instead of 200 tiny steps at 2 s each."""

VARIANTS = (
    "bare", "bare_deepspeed", "bare_in_ray_worker", "raytrain_fast_memory", "raytrain_fast", "typical_no_report",
    "typical_ray_train",
)
"""Every variant, in the order of the first round."""


@dataclass(kw_only=True)
class OverheadSetup:
    """What every variant trains, and for how long."""

    size: str = "tiny"
    """Label of the model size in the JSON (`tiny`, `large` or `custom`)."""
    d_model: int = 128
    """Width of the residual stream."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads."""
    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch: int = 16
    """Sequences per step (one micro-batch per step: no accumulation)."""
    warmup_steps: int = 10
    """Steps run before the clock starts (allocator, kernel selection, W&B start-up)."""
    steps: int = 30
    """Steps timed after warm-up."""
    log_every: int = 10
    """Our loop's log window (train.log_every)."""
    checkpoint_every: int | None = None
    """Our loop's checkpoint.every_steps; None = `steps` (exactly one checkpoint inside the timed window); 0 = none in it."""
    flops_every: int | None = None
    """typical loops: re-count FLOPs with FlopCounterMode every this many steps; None = `steps` (one in the window)."""
    precision: str = "auto"
    """bf16 or fp32; auto = what the package's engine picks on this machine."""
    threads: int = 0
    """torch threads on CPU (the same in every variant); 0 = this process's torch.get_num_threads()."""
    lr: float = 1e-3
    """AdamW learning rate."""
    grad_clip: float = 1.0
    """Gradient-norm clipping."""
    seed: int = 0
    """Seed of the model init and the in-memory token batches."""
    data_source: str = "stdlib"
    """Our full loop's data.source (prepared once per bench into its scratch storage, or data_cache_dir)."""
    data_cache_dir: str | None = None
    """Our full loop's data.cache_dir (None: under the bench's scratch storage)."""

    @classmethod
    def for_size(cls, name: str, /, **changes: Any) -> OverheadSetup:
        """The setup of a named model size with its default step counts; `changes` win (a changed
        shape should come with size="custom")."""
        if name not in MODEL_SIZES:
            raise ValueError(f"unknown model size {name!r}: one of {', '.join(MODEL_SIZES)}")
        defaults = {k: v for k, v in SIZE_DEFAULTS[name].items() if k != "repeats"}
        return cls(**{"size": name, **MODEL_SIZES[name], **defaults, **changes})

    def resolved(self) -> OverheadSetup:
        """Concrete precision, thread count and cadences (so every variant, in every process, uses the same)."""
        import torch

        from raytrain_fast.engine import resolve_precision

        precision = self.precision
        if precision == "auto":
            precision, _ = resolve_precision("auto", use_gpu=torch.cuda.is_available())
        threads = self.threads or torch.get_num_threads()
        return dataclasses.replace(
            self, precision=precision, threads=threads,
            checkpoint_every=self.steps if self.checkpoint_every is None else self.checkpoint_every,
            flops_every=self.steps if self.flops_every is None else self.flops_every,
        )

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def end_step(self) -> int:
        return self.warmup_steps + self.steps


def run_config(setup: OverheadSetup, *, storage_dir: str = "/tmp/raytrain-fast-bench", name: str = "bench-overhead"):
    """The package Config every variant trains: the tiny preset with the setup's model, batch,
    precision, threads and cadences (our loop runs one step past the timed window: see loop_clock)."""
    from raytrain_fast.config import load_config

    overrides = [
        f"model.d_model={setup.d_model}", f"model.num_layers={setup.num_layers}", f"model.num_heads={setup.num_heads}",
        f"model.max_seq_len={max(128, setup.seq_len)}", f"data.seq_len={setup.seq_len}", f"data.source={setup.data_source}",
        f"train.steps={setup.end_step + 1}", f"train.log_every={setup.log_every}", f"train.micro_batch={setup.micro_batch}",
        f"train.global_batch={setup.micro_batch}", f"train.seed={setup.seed}",
        f"optim.lr={setup.lr}", "optim.warmup_steps=1", f"optim.grad_clip={setup.grad_clip}",
        f"engine.precision={setup.precision}", "engine.compile=off",
        f"checkpoint.every_steps={setup.checkpoint_every or 0}", "eval.enabled=false",
        "metrics.wandb=true", "metrics.wandb_mode=offline", "metrics.peak_measure_s=0",
        "resources.num_workers=1", f"resources.cpus_per_worker={setup.threads}", "resources.max_failures=0",
        f"storage.uri={storage_dir}",
    ]
    if setup.data_cache_dir:
        overrides.append(f"data.cache_dir={setup.data_cache_dir}")
    return load_config("tiny", overrides, name=name)


def token_batches(micro_batch: int, seq_len: int, seed: int, device: Any = "cpu") -> Any:
    """The in-memory data every loop of the bench can train on: 8 (micro_batch, seq_len + 1) batches of byte tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 257, (8, micro_batch, seq_len + 1), generator=generator).to(device)


def model_parameters(setup: OverheadSetup) -> int:
    from raytrain_fast.model import build_model

    return sum(p.numel() for p in build_model(run_config(setup).model, "meta").parameters())


def measurement(setup: OverheadSetup, *, seconds: float, precision: str, threads: int, niceness: int, **extra: Any) -> dict[str, Any]:
    tokens = setup.steps * setup.tokens_per_step
    return {
        "tokens_per_sec": tokens / seconds, "tokens": tokens, "seconds": seconds, "steps": setup.steps,
        "warmup_steps": setup.warmup_steps, "precision": precision, "threads": threads, "niceness": niceness, **extra,
    }
