"""Every check of a Config that can run before a worker starts (`validate`), each section's in a
function of its own; one ConfigError lists every problem found."""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

from raytrain_fast.config.checkpoint import CheckpointConfig, allowed_groups
from raytrain_fast.config.data import BYTE_VOCAB_SIZE, DataConfig, data_sources_problems, document_masking_problems
from raytrain_fast.config.engine import OptimConfig, fp8_problems, wsd_decay_steps
from raytrain_fast.errors import ConfigError
from raytrain_fast.config.resources import ResourcesConfig
from raytrain_fast.config.train import TrainConfig
from raytrain_fast.config.metrics import metrics_config_problems
from raytrain_fast.config.model import ModelConfig, head_size, llama_option_problems
from raytrain_fast.config.storage import uri_problem
from raytrain_fast.config.root import NAME_PATTERN, Config
from raytrain_fast.config.watchdog import watchdog_config_problems


def validate(config: Config, *, cluster_cpus: float | None = None, cluster_gpus: float | None = None) -> None:
    """Every check that can run before a worker starts. Raises one ConfigError listing all problems."""
    problems: list[str] = _worker_range_problems(config)
    if problems:  # the checks below count workers: let them count one, the problem is already named
        config = dataclasses.replace(config, resources=dataclasses.replace(config.resources, num_workers=1, min_workers=None))
    if config.name is not None and not NAME_PATTERN.match(config.name):
        problems.append(f"name '{config.name}': use letters, digits, '.', '_' or '-' (it becomes a directory name)")
    for section, names in _POSITIVE.items():
        problems += _not_positive(section, getattr(config, section), names)
    problems += _model_problems(config.model, config.data)
    problems += _data_problems(config.data)
    problems += data_sources_problems(config.data)
    problems += document_masking_problems(config.data, dropout=config.model.dropout, use_gpu=config.resources.use_gpu, cluster_gpus=cluster_gpus)
    problems += fp8_problems(config.engine, use_gpu=config.resources.use_gpu, cluster_gpus=cluster_gpus)
    problems += _optim_problems(config)
    problems += _batch_problems(config.train, config.resources)
    problems += _elastic_batch_problems(config)
    problems += _resources_problems(config, cluster_cpus=cluster_cpus, cluster_gpus=cluster_gpus)
    problems += metrics_config_problems(config.metrics)
    problems += watchdog_config_problems(config.watchdog)
    problems += _checkpoint_problems(config.checkpoint)
    problems += _eval_problems(config)
    problems += _uri_problems(config)
    if problems:
        raise ConfigError(problems)


def _uri_problems(config: Config) -> list[str]:
    """Every storage location in the config: a local path, file:// or s3:// (a typo such as
    `s3:/bucket` would otherwise become a local folder, another scheme hang without a timeout)."""
    locations = {
        "storage.uri": config.storage.uri, "data.source": config.data.source,
        "data.cache_dir": config.data.cache_dir, "data.val_input": config.data.val_input, "checkpoint.init_from": config.checkpoint.init_from,
    }
    found = (uri_problem(value, setting=setting) for setting, value in locations.items() if isinstance(value, str))
    return [problem for problem in found if problem]


_POSITIVE = {
    "model": ("vocab_size", "max_seq_len", "num_layers", "num_heads", "d_model", "mlp_ratio", "init_std"),
    "data": ("seq_len", "prefetch_batches"),
    "train": ("steps", "global_batch", "micro_batch", "grad_accum", "log_every"),
    "optim": ("lr", "eps"),
    "checkpoint": ("keep_last",),
    "resources": ("num_workers",),
}
"""Fields that must be > 0 when set (None and strings such as `auto` are checked elsewhere)."""


def _not_positive(section: str, obj: Any, names: tuple[str, ...]) -> list[str]:
    problems = []
    for n in names:
        value = getattr(obj, n)
        if value is not None and not isinstance(value, str) and value <= 0:
            problems.append(f"{section}.{n} must be > 0, got {value}")
    return problems


def _model_problems(m: ModelConfig, d: DataConfig) -> list[str]:
    problems = []
    if m.num_heads > 0 and not m.head_dim and m.d_model % m.num_heads:
        heads = max(h for h in range(1, m.num_heads + 1) if m.d_model % h == 0)
        problems.append(
            f"model.d_model ({m.d_model}) must be divisible by model.num_heads ({m.num_heads}); "
            f"e.g. --set model.num_heads={heads}"
        )
    elif (m.positions == "rotary" or m.architecture == "llama") and m.num_heads > 0 and head_size(m) % 2:
        problems.append("rotary positions (model.positions=rotary, model.architecture=llama) need an even head size "
                        "(model.head_dim, or d_model / num_heads)")
    problems += _llama_problems(m) + llama_option_problems(m, seq_len=d.seq_len)
    if not 0.0 <= m.dropout < 1.0:
        problems.append(f"model.dropout must be in [0, 1), got {m.dropout}")
    if d.tokenizer == "byte" and m.vocab_size < BYTE_VOCAB_SIZE:
        problems.append(f"model.vocab_size ({m.vocab_size}) is smaller than the byte tokenizer's {BYTE_VOCAB_SIZE} tokens")
    if d.seq_len > m.max_seq_len and m.positions == "learned" and m.architecture == "gpt":
        problems.append(
            f"data.seq_len ({d.seq_len}) exceeds model.max_seq_len ({m.max_seq_len}); raise model.max_seq_len or lower data.seq_len"
        )
    return problems


def _llama_problems(m: ModelConfig) -> list[str]:
    problems = []
    if min(m.num_kv_heads, m.mlp_hidden) < 0 or m.mlp_multiple_of <= 0 or m.rope_theta <= 0 or m.norm_eps <= 0:
        problems.append(
            "model.num_kv_heads and model.mlp_hidden must be >= 0 (0 = derived), "
            "model.mlp_multiple_of, model.rope_theta and model.norm_eps > 0"
        )
    elif m.architecture == "llama" and m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads:
        fits = [h for h in range(1, m.num_heads + 1) if m.num_heads % h == 0]
        problems.append(
            f"model.num_kv_heads ({m.num_kv_heads}) must divide model.num_heads ({m.num_heads}); one of {fits}"
        )
    return problems


def _data_problems(d: DataConfig) -> list[str]:
    problems = []
    if d.max_tokens < 0:
        problems.append(f"data.max_tokens must be >= 0 (0 = whole corpus), got {d.max_tokens}")
    if d.source != "stdlib" and "://" not in d.source and not any(c in d.source for c in "*?[") and not Path(d.source).expanduser().exists():
        problems.append(
            f"data.source '{d.source}' does not exist; give a text file, directory or glob, a prepare-data output, or 'stdlib'"
        )
    if d.val_fraction is not None and not 0.0 < d.val_fraction <= 0.5:
        problems.append(f"data.val_fraction must be in (0, 0.5] (the share of documents held out for validation), got {d.val_fraction}")
    if d.val_fraction is not None and d.val_input is not None:
        problems.append("set either data.val_fraction (a share of data.source) or data.val_input (a separate corpus), not both")
    if d.val_input is not None and "://" not in d.val_input and not any(c in d.val_input for c in "*?[") and not Path(d.val_input).expanduser().exists():
        problems.append(f"data.val_input '{d.val_input}' does not exist; give a text file, directory or glob")
    tokenizer = Path(d.tokenizer).expanduser()
    if d.tokenizer != "byte" and "://" not in d.tokenizer and not (tokenizer.is_file() or (tokenizer / "tokenizer.json").is_file()):
        problems.append(
            f"data.tokenizer '{d.tokenizer}' is neither 'byte' nor an existing tokenizer.json file or a directory "
            "holding one; give 'byte', the path of a HuggingFace tokenizer.json or its directory (e.g. train-tokenizer's output)"
        )
    return problems


def _schedule_problems(o: OptimConfig, steps: int) -> list[str]:
    """optim.schedule's wsd fields: a decay of at least one step that starts after the warmup."""
    problems = []
    if o.decay_steps is not None and o.decay_steps < 1:
        problems.append(f"optim.decay_steps must be >= 1 (or null: optim.decay_fraction of train.steps), got {o.decay_steps}")
    if not 0.0 < o.decay_fraction <= 1.0:
        problems.append(f"optim.decay_fraction must be in (0, 1] (the wsd decay's share of train.steps), got {o.decay_fraction}")
    if o.schedule != "wsd":
        if o.decay_steps is not None:
            problems.append(
                f"optim.decay_steps ({o.decay_steps}) is only used by optim.schedule=wsd, and the schedule is {o.schedule}; "
                "fix: --set optim.schedule=wsd, or --set optim.decay_steps=null"
            )
        return problems
    if problems or steps <= 0 or not 0 <= o.warmup_steps <= steps:
        return problems  # the fields' own problems, or the warmup's (reported by _optim_problems)
    decay, room = wsd_decay_steps(optim=o, total_steps=steps), steps - o.warmup_steps
    if decay > room:
        if o.decay_steps is not None:
            field, fix = f"optim.decay_steps ({decay})", f"--set optim.decay_steps={room}"
        else:
            field, fix = f"optim.decay_fraction ({o.decay_fraction}: {decay} steps)", f"--set optim.decay_fraction={_fraction(room, steps)}"
        fixes = f"{fix}, lower optim.warmup_steps" if room >= 1 else "lower optim.warmup_steps"
        problems.append(
            f"{field} + optim.warmup_steps ({o.warmup_steps}) exceed train.steps ({steps}): the wsd decay would start "
            f"inside the warmup; fix: {fixes}, or raise train.steps"
        )
    return problems


def _fraction(room: int, steps: int) -> str:
    """The largest decay_fraction (4 decimals) whose rounded decay fits in `room` (>= 1) steps."""
    fraction = math.floor(room / steps * 10_000) / 10_000
    while fraction > 0.0001 and round(fraction * steps) > room:
        fraction = round(fraction - 0.0001, 4)
    return f"{fraction:g}"


def _optim_problems(config: Config) -> list[str]:
    """The optimizer and the engine."""
    o, e, t = config.optim, config.engine, config.train
    problems = []
    if o.warmup_steps < 0:
        problems.append(f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    elif t.steps > 0 and o.warmup_steps > t.steps:
        problems.append(
            f"optim.warmup_steps ({o.warmup_steps}) exceeds train.steps ({t.steps}); fix: --set optim.warmup_steps="
            f"{max(0, t.steps // 10)} (a tenth of the steps), or raise train.steps"
        )
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        problems.append(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    problems += _schedule_problems(o, t.steps)
    if o.grad_clip < 0:
        problems.append(f"optim.grad_clip must be >= 0 (0 = off), got {o.grad_clip}")
    if e.zero_stage not in (0, 1, 2):
        problems.append(f"engine.zero_stage must be 0, 1 or 2, got {e.zero_stage}")
    h = config.health
    if h.max_rollbacks < 0:
        problems.append(f"health.max_rollbacks must be >= 0 (0 = stop at the first divergence), got {h.max_rollbacks}")
    if h.spike_mads <= 0 or h.spike_windows < 5:
        problems.append(f"health.spike_mads must be > 0 and health.spike_windows >= 5, got {h.spike_mads} and {h.spike_windows}")
    if h.divergence_windows < 1 or not 0 < h.divergence_climb <= 1:
        problems.append(f"health.divergence_windows must be >= 1 and health.divergence_climb in (0, 1], got "
                        f"{h.divergence_windows} and {h.divergence_climb}")
    return problems + _not_positive("engine", e, ("reduce_bucket_size", "allgather_bucket_size"))


def _elastic_batch_problems(config: Config, *, suggest: bool = True) -> list[str]:
    """An elastic run keeps its global batch at every size in its range: each count must divide it.
    Checked on train.global_batch alone, so that this problem is named in the same message as any
    batch arithmetic of the largest size (`_batch_problems`), not only once that is fixed."""
    r, t = config.resources, config.train
    if not r.elastic or t.global_batch <= 0 or r.num_workers <= 0:
        return []
    misfits = [n for n in range(r.min_workers, r.num_workers + 1) if t.global_batch % n]
    if not misfits:
        return []
    fits = [n for n in range(1, r.num_workers + 1) if t.global_batch % n == 0]
    example = f"; e.g. {_worker_suggestion(config, r.min_workers, r.num_workers)}" if suggest else ""
    return [
        f"resources.num_workers={r.min_workers}-{r.num_workers}: the global batch of {t.global_batch} sequences cannot be "
        f"kept on {', '.join(map(str, misfits))} worker(s) (not a divisor). Use a range of counts that divide it "
        f"(these do: {', '.join(map(str, fits))}{example}), "
        "or a train.global_batch that every count in the range divides"
    ]


def _worker_suggestion(config: Config, low: int, high: int) -> str:
    """A `--set resources.num_workers=...` (with the micro_batch it needs) that validates for this
    config: the range as asked (MIN and MAX in order), else the widest smaller range, else a
    fixed count. A suggestion that itself fails is worse than none."""
    low, high = sorted((max(1, low), max(1, high)))
    # Elastic ranges first (the widest, then from the top count down), fixed counts last.
    elastic = [(a, b) for b in range(high, 1, -1) for a in range(1, b) if (a, b) != (low, high)]
    candidates = [(low, high), *elastic, *((b, b) for b in range(high, 0, -1))]
    for a, b in candidates:
        workers: int | str = f"{a}-{b}" if a < b else b
        trial = dataclasses.replace(config, resources=dataclasses.replace(config.resources, num_workers=workers, min_workers=None))
        fix = ""
        t = trial.train
        if isinstance(t.micro_batch, int) and t.grad_accum is None and t.micro_batch > 0 and t.global_batch % (t.micro_batch * b):
            per_worker, remainder = divmod(t.global_batch, b)
            fitting = [m for m in range(min(t.micro_batch, per_worker), 0, -1) if per_worker % m == 0] if not remainder else []
            if not fitting:
                continue
            fix = f" --set train.micro_batch={fitting[0]}"
            trial = dataclasses.replace(trial, train=dataclasses.replace(t, micro_batch=fitting[0]))
        if not (_batch_problems(trial.train, trial.resources) or _elastic_batch_problems(trial, suggest=False)):
            return f"--set resources.num_workers={workers}{fix}"
    return "--set resources.num_workers=1"


def _batch_problems(t: TrainConfig, r: ResourcesConfig) -> list[str]:
    """global_batch = micro_batch x grad_accum x num_workers, or what lets it be derived."""
    problems = []
    if t.micro_batch == "auto":
        if t.grad_accum is not None:
            problems.append("train.micro_batch=auto derives train.grad_accum from the global batch: set train.grad_accum=null")
        if t.global_batch > 0 and r.num_workers > 0 and t.global_batch % r.num_workers:
            problems.append(
                f"train.global_batch ({t.global_batch}) must be a multiple of resources.num_workers ({r.num_workers}) "
                "for train.micro_batch=auto"
            )
    elif t.micro_batch > 0 and t.global_batch > 0 and r.num_workers > 0:
        per_step = t.micro_batch * r.num_workers
        if t.grad_accum is None:
            if t.global_batch % per_step:
                problems.append(
                    f"train.global_batch ({t.global_batch}) is not a multiple of train.micro_batch x "
                    f"resources.num_workers ({t.micro_batch} x {r.num_workers} = {per_step}); fix it with one of: "
                    + _batch_fixes(t.global_batch, t.micro_batch, r.num_workers)
                )
        elif t.grad_accum > 0 and per_step * t.grad_accum != t.global_batch:
            problems.append(
                f"train.global_batch ({t.global_batch}) != micro_batch x grad_accum x num_workers "
                f"({t.micro_batch} x {t.grad_accum} x {r.num_workers} = {per_step * t.grad_accum}); fix it with one of: "
                + _batch_fixes(t.global_batch, t.micro_batch, r.num_workers, grad_accum=t.grad_accum)
            )
    return problems


def _batch_fixes(global_batch: int, micro_batch: int, num_workers: int, *, grad_accum: int | None = None) -> str:
    """Every way to make global_batch = micro_batch x grad_accum x num_workers: micro_batch or
    grad_accum first (same training run), the global batch last (it changes the run)."""
    fixes = []
    per_worker, remainder = divmod(global_batch, num_workers)
    if not remainder:
        divisors = [m for m in range(min(micro_batch, per_worker), 0, -1) if per_worker % m == 0]
        if grad_accum is None:
            fixes.append(f"--set train.micro_batch={divisors[0]} (grad_accum is derived: {per_worker // divisors[0]})")
            if len(divisors) > 1:
                fixes.append(f"--set train.micro_batch={divisors[1]} --set train.grad_accum={per_worker // divisors[1]}")
        else:
            if per_worker % grad_accum == 0:
                fixes.append(f"--set train.micro_batch={per_worker // grad_accum}")
            if per_worker % micro_batch == 0:
                fixes.append(f"--set train.grad_accum={per_worker // micro_batch}")
            if not fixes:
                fixes.append(f"--set train.micro_batch={divisors[0]} --set train.grad_accum={per_worker // divisors[0]}")
    step = micro_batch * (grad_accum or 1) * num_workers
    fixes.append(f"--set train.global_batch={max(step, round(global_batch / step) * step)} (changes the training run)")
    return "; ".join(fixes)


def _worker_range_problems(config: Config) -> list[str]:
    """resources.num_workers: a positive int or an elastic range "MIN-MAX" with 1 <= MIN <= MAX.
    The example given is one that validates for this config (see `_worker_suggestion`)."""
    r = config.resources
    if isinstance(r.num_workers, str):
        digits = [int(n) for n in re.findall(r"\d+", r.num_workers)] or [1, 4]
        example = f"e.g. {_worker_suggestion(config, min(digits), max(digits))}"
        return [f"resources.num_workers: expected a number of workers or a range MIN-MAX (in YAML quoted: \"1-4\"), "
                f"got {r.num_workers!r}; {example}"]
    if r.min_workers is not None and r.num_workers > 0 and not 1 <= r.min_workers <= r.num_workers:
        return [
            f"resources.num_workers: the range {r.min_workers}-{r.num_workers} must have 1 <= MIN <= MAX; "
            f"e.g. {_worker_suggestion(config, r.min_workers, r.num_workers)} (this one fits the batch settings)"
        ]
    return []


def _resources_problems(config: Config, *, cluster_cpus: float | None, cluster_gpus: float | None) -> list[str]:
    """The resources section, and whether the Ray cluster (when known) can give them."""
    t, r = config.train, config.resources
    problems = []
    if r.cpus_per_worker < 0:
        problems.append(f"resources.cpus_per_worker must be >= 0 (0 = automatic), got {r.cpus_per_worker}")
    if r.memory_budget_gb is not None and r.memory_budget_gb <= 0:
        problems.append(f"resources.memory_budget_gb must be > 0 (or null), got {r.memory_budget_gb}")
    if (
        t.micro_batch == "auto" and r.memory_budget_gb is None and cluster_gpus is not None
        and not (r.use_gpu is True or (r.use_gpu == "auto" and cluster_gpus >= r.fewest_workers))
    ):
        problems.append(
            "train.micro_batch=auto on CPU workers needs resources.memory_budget_gb (the memory one worker may use, "
            "e.g. --set resources.memory_budget_gb=8), or set train.micro_batch to a number"
        )
    for name in ("max_failures", "max_preemption_failures"):
        if getattr(r, name) < -1:
            problems.append(f"resources.{name} must be -1 (unlimited) or >= 0, got {getattr(r, name)}")
    for name in ("preemption_grace_s", "elastic_resize_interval_s"):
        if getattr(r, name) < 0:
            problems.append(f"resources.{name} must be >= 0 seconds, got {getattr(r, name)}")
    if r.use_gpu is True and cluster_gpus is not None and cluster_gpus < r.fewest_workers:
        problems.append(
            f"resources.use_gpu=true with {r.fewest_workers} workers, but the Ray cluster has {cluster_gpus:g} GPUs; "
            "set resources.use_gpu=false (or auto) or fewer workers"
        )
    if cluster_cpus is not None and r.cpus_per_worker > 0 and r.cpus_per_worker * r.fewest_workers > cluster_cpus:
        problems.append(
            f"resources.cpus_per_worker x num_workers = {r.cpus_per_worker * r.fewest_workers} CPUs, but the Ray cluster "
            f"has {cluster_cpus:g}; the workers would wait forever. Lower one of them (0 = automatic)"
        )
    return problems


def _checkpoint_problems(c: CheckpointConfig) -> list[str]:
    problems = []
    if c.every_steps < 0 or c.every_minutes < 0:
        problems.append("checkpoint.every_steps and checkpoint.every_minutes must be >= 0 (0 = off)")
    if c.keep_best < 0:
        problems.append(f"checkpoint.keep_best must be >= 0, got {c.keep_best}")
    if c.upload_attempts < 1:
        problems.append(f"checkpoint.upload_attempts must be >= 1, got {c.upload_attempts}")
    if isinstance(c.resume, int) and (isinstance(c.resume, bool) or c.resume < 0):
        problems.append(f"checkpoint.resume must be auto, must, never or a step >= 0, got {c.resume}")
    problems += allowed_groups(c.allow_changes)[1]
    return problems


def _eval_problems(config: Config) -> list[str]:
    """The eval section on its own; what depends on the data's split is checked once it is prepared."""
    e = config.eval
    problems = []
    if e.sequences < 1:
        problems.append(f"eval.sequences must be >= 1, got {e.sequences} (to turn evaluation off: eval.enabled=false)")
    if e.every_steps is not None and e.every_steps < 1:
        problems.append(f"eval.every_steps must be >= 1 or null (= checkpoint.every_steps), got {e.every_steps}; to turn evaluation off: eval.enabled=false")
    if e.micro_batch is not None and e.micro_batch < 1:
        problems.append(f"eval.micro_batch must be >= 1 or null (= train.micro_batch), got {e.micro_batch}")
    if e.task_limit is not None and e.task_limit < 1:
        problems.append(f"eval.task_limit must be >= 1 or null (= every item of each task), got {e.task_limit}; to score no task: eval.tasks=[]")
    return problems
