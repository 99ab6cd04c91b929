"""`train.micro_batch: auto`: before training, the fastest micro-batch that fits the memory budget,
each candidate probed in a fresh process (a process's peak RSS never goes down) on the program a
training worker builds (engine/program.py), the choice cached in storage under `_autobatch/<key>.json`.
The whole procedure, as users read it: docs/sweeps.md#trainmicro_batch-auto.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from raytrain_fast.config import Config
from raytrain_fast.console import say
from raytrain_fast.errors import ConfigError, RaytrainFastError
from raytrain_fast.metrics.memory import peak_memory_gb, reset_peak_memory
from raytrain_fast.microbatch.plan import (
    FAILED,
    OK,
    candidate_micro_batches,
    classify_error,
    classify_peak,
    fastest,
    plan_candidates,
)

logger = logging.getLogger("raytrain_fast")

GPU_MEMORY_MARGIN = 0.10
"""Share of the device memory left free on GPU when no budget is set (fragmentation, NCCL buffers,
the data pipeline's prefetched batches)."""
CACHE_DIR = "_autobatch"
_GB = 1e9


@dataclass(kw_only=True)
class Probe:
    """One candidate micro-batch, measured in its own process."""

    micro_batch: int
    grad_accum: int
    status: str
    """ok (fits), over_budget (ran, but its peak exceeds the budget), oom (ran out of memory) or failed:
    a `microbatch.Outcome` status (caches written before it say error for failed)."""
    peak_gb: float | None = None
    tokens_per_sec: float | None = None
    """Per worker, over the timed optimizer steps."""
    device_total_gb: float | None = None
    reason: str = ""
    activation_checkpointing: str = "none"
    """The model.activation_checkpointing it was measured with (caches written before it: none)."""
    compiled: bool = False
    """Whether its blocks were compiled, as the run's are (engine.compile)."""


@dataclass(kw_only=True)
class AutoBatchChoice:
    micro_batch: int
    grad_accum: int
    budget_gb: float | None
    """None on GPU without a configured budget until a probe reported the device's memory."""
    budget_source: str
    probes: list[Probe] = field(default_factory=list)
    reason: str = ""
    activation_checkpointing: str | None = None
    """`full` when the search turned activation checkpointing on (nothing fit without it); None: the
    config's own setting, unchanged."""
    cache_uri: str = ""
    cached: bool = False


def _budget(config: Config) -> tuple[float | None, str]:
    if config.resources.memory_budget_gb is not None:
        return config.resources.memory_budget_gb, "resources.memory_budget_gb"
    if config.resources.use_gpu:
        return None, f"device memory minus {GPU_MEMORY_MARGIN:.0%}"
    raise ConfigError(
        "train.micro_batch=auto on CPU workers needs resources.memory_budget_gb (the memory one worker may use, "
        "e.g. --set resources.memory_budget_gb=8)"
    )


# --------------------------------------------------------------------------- one probe (worker side)


def probe_micro_batch(
    config_dict: dict[str, Any], *, micro_batch: int, grad_accum: int, budget_gb: float | None,
    warmup_steps: int = 1, timed_steps: int = 2,
) -> Probe:
    """Measure one candidate in THIS process (call it in a fresh one: see `probe_in_fresh_process`),
    on the program a training worker builds (engine/program.py), on one worker."""
    import torch
    import torch.distributed as dist

    from raytrain_fast.engine.process_group import single_process_group
    from raytrain_fast.engine.program import build_program, one_process, prepare_process
    from raytrain_fast.model import document_masking

    # What a training worker's process imports too (Ray Train, Ray Data, the loop): about 0.14 GB
    # of RSS on CPU, which a budget must hold as well.
    import ray.data  # noqa: F401
    import ray.train.torch  # noqa: F401

    import raytrain_fast.loop.train_loop  # noqa: F401

    config = Config.from_dict(config_dict)
    device = prepare_process(threads=config.resources.cpus_per_worker, seed=config.train.seed)
    cuda = device.type == "cuda"
    total_gb = torch.cuda.get_device_properties(device).total_memory / _GB if cuda else None
    if budget_gb is None and total_gb is not None:
        budget_gb = total_gb * (1 - GPU_MEMORY_MARGIN)
    probe = Probe(micro_batch=micro_batch, grad_accum=grad_accum, status=FAILED, device_total_gb=total_gb)
    single_process_group("nccl" if cuda else "gloo")
    program = tokens = None
    try:
        program = build_program(
            one_process(config, micro_batch=micro_batch, grad_accum=grad_accum, steps=warmup_steps + timed_steps),
            # Any id will do: random tokens end a document as often whichever id ends one.
            device=device, documents=document_masking(config.data, eod_id=0),
        )
        probe.compiled = program.compiled
        tokens = torch.randint(0, config.model.vocab_size, (micro_batch, config.data.seq_len + 1), device=device)
        reset_peak_memory(device)  # as the training loop does once set up: the same statistic
        elapsed = _timed_steps(program.engine, tokens, grad_accum=grad_accum, warmup_steps=warmup_steps, timed_steps=timed_steps)
        probe.tokens_per_sec = timed_steps * grad_accum * micro_batch * config.data.seq_len / elapsed
        probe.peak_gb = peak_memory_gb(device)
        outcome = classify_peak(probe.peak_gb, budget_gb)
    except Exception as error:  # noqa: BLE001 - reported with the candidate (oom or failed), the search decides
        outcome = classify_error(error)
        probe.peak_gb = peak_memory_gb(device)  # how far it got
    finally:
        # Free the device memory before the next candidate (this process exits too: max_calls=1).
        program = tokens = None
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        if dist.is_initialized():
            dist.destroy_process_group()
    probe.status, probe.reason = outcome.status, outcome.reason
    return probe


def _timed_steps(engine: Any, tokens: Any, *, grad_accum: int, warmup_steps: int, timed_steps: int) -> float:
    """Seconds of `timed_steps` training steps (engine/step.py, with the loop's on-device sums) after
    `warmup_steps` untimed ones, on one batch."""
    import itertools

    from raytrain_fast.engine.step import train_step
    from raytrain_fast.metrics.accumulators import StepAccumulators

    batches = itertools.repeat((tokens, None))
    sums = StepAccumulators(device=tokens.device, profile_every=0, start_step=0)
    for _ in range(warmup_steps):
        train_step(engine, batches, grad_accum=grad_accum, metrics=sums)
    loss = None
    start = time.perf_counter()
    for _ in range(timed_steps):
        loss = train_step(engine, batches, grad_accum=grad_accum, metrics=sums)
    float(loss.detach())  # host sync: the clock stops when the device is done
    return time.perf_counter() - start


def probe_in_fresh_process(config: Config, *, micro_batch: int, grad_accum: int, budget_gb: float | None) -> Probe:
    """`probe_micro_batch` in a new Ray worker process with one training worker's resources."""
    import ray

    resources = config.resources
    env_vars = {"DS_ACCELERATOR": "cuda" if resources.use_gpu else "cpu", "OMP_NUM_THREADS": str(max(1, resources.cpus_per_worker))}
    task = ray.remote(max_calls=1)(probe_micro_batch).options(
        num_cpus=resources.cpus_per_worker, num_gpus=1 if resources.use_gpu else 0,
        runtime_env={"env_vars": env_vars}, max_retries=0,
    )
    try:
        return ray.get(task.remote(config.to_dict(), micro_batch=micro_batch, grad_accum=grad_accum, budget_gb=budget_gb))
    except ray.exceptions.RayError as error:
        # Ray's memory monitor or the kernel's OOM killer ended the process (oom: it did not fit), or
        # the probe failed outside its own try (failed).
        outcome = classify_error(error)
        return Probe(micro_batch=micro_batch, grad_accum=grad_accum, status=outcome.status, reason=outcome.reason)


# --------------------------------------------------------------------------- choice, cache, resolve


def _device_key(config: Config) -> str:
    if not config.resources.use_gpu:
        return "cpu"
    import ray

    types = sorted(k.split(":", 1)[1] for k in ray.cluster_resources() if k.startswith("accelerator_type:"))
    return "cuda:" + ",".join(types) if types else "cuda"


def cache_key(config: Config) -> tuple[str, dict[str, Any]]:
    """(hash, what it hashes): everything that changes which micro-batch fits and is fastest. The
    model config includes model.activation_checkpointing: `none` (which the search may turn on) and
    `full` are different questions; compiled blocks and document masking change the program too."""
    inputs = {
        "model": dataclasses.asdict(config.model), "seq_len": config.data.seq_len, "device": _device_key(config),
        "compile": config.engine.compile, "document_masking": config.data.document_masking,
        "world_size": config.resources.num_workers, "zero_stage": config.engine.zero_stage,
        "precision": config.engine.precision, "global_batch": config.train.global_batch,
        "memory_budget_gb": config.resources.memory_budget_gb, "cpus_per_worker": config.resources.cpus_per_worker,
    }
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    return digest, inputs


def _cache_path(config: Config, key: str) -> tuple[Any, str, str]:
    from raytrain_fast.storage.filesystem import resolve_filesystem, uri_of

    filesystem, root = resolve_filesystem(config.storage.uri, config.storage)
    path = f"{root.rstrip('/')}/{CACHE_DIR}/{key}.json"
    return filesystem, path, uri_of(path, like=config.storage.uri)


def _read_cache(config: Config, key: str) -> AutoBatchChoice | None:
    import pyarrow.fs as pafs

    filesystem, path, uri = _cache_path(config, key)
    if filesystem.get_file_info(path).type != pafs.FileType.File:
        return None
    with filesystem.open_input_stream(path) as stream:
        data = json.loads(stream.read())
    probes = [Probe(**p) for p in data.pop("probes", [])]
    data.pop("key_inputs", None)
    data.pop("measured_at", None)
    return AutoBatchChoice(**{**data, "probes": probes, "cache_uri": uri, "cached": True})


def _write_cache(config: Config, key: str, inputs: dict[str, Any], choice: AutoBatchChoice) -> None:
    filesystem, path, _ = _cache_path(config, key)
    filesystem.create_dir(path.rsplit("/", 1)[0], recursive=True)
    record = dataclasses.asdict(choice)
    record.pop("cached")
    record.pop("cache_uri")
    record.update(key_inputs=inputs, measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    with filesystem.open_output_stream(path) as stream:
        stream.write(json.dumps(record, indent=2).encode())


def format_probes(probes: list[Probe], *, chosen: int | None = None, checkpointing: str | None = None) -> str:
    """The probes as a table; with an activation-checkpointing column when they were not all
    measured with the same setting (the chosen one is then the probe of `chosen` with `checkpointing`)."""
    mixed = len({p.activation_checkpointing for p in probes}) > 1
    lines = [f"  {'micro':>5} {'accum':>5}" + (f" {'act. ckpt':>9}" if mixed else "") + f" {'tok/s/worker':>12} {'peak GB':>8}  status"]
    for p in probes:
        speed = f"{p.tokens_per_sec:,.0f}" if p.tokens_per_sec is not None else "-"
        peak = f"{p.peak_gb:.2f}" if p.peak_gb is not None else "-"
        is_chosen = p.micro_batch == chosen and (not mixed or p.activation_checkpointing == checkpointing)
        status = p.status + (f" ({p.reason})" if p.reason else "") + ("  <- chosen" if is_chosen else "")
        ckpt = f" {p.activation_checkpointing:>9}" if mixed else ""
        lines.append(f"  {p.micro_batch:>5} {p.grad_accum:>5}{ckpt} {speed:>12} {peak:>8}  {status}")
    return "\n".join(lines)


def search(config: Config, *, probe=probe_in_fresh_process) -> AutoBatchChoice:
    """Probe the candidates smallest first, stop at the first that does not fit, take the fastest.
    When none fits and the config leaves activation checkpointing off: the same again with it on
    (full), and the choice turns it on."""
    train, workers = config.train, config.resources.num_workers
    budget_gb, source = _budget(config)
    candidates, _ = plan_candidates(train.global_batch, workers)  # the default list: nothing to skip
    if not candidates:
        raise ConfigError(
            f"train.micro_batch=auto: train.global_batch ({train.global_batch}) must be a multiple of "
            f"resources.num_workers ({workers})"
        )
    probes, budget_gb = _probe_candidates(config, candidates, budget_gb=budget_gb, probe=probe)
    best = fastest(probes)
    if best is not None:
        return AutoBatchChoice(
            micro_batch=best.micro_batch, grad_accum=best.grad_accum, budget_gb=budget_gb, budget_source=source,
            probes=probes, reason=_why(best, probes, budget_gb=budget_gb, source=source),
        )
    first = probes[0]  # the search stopped at it
    _raise_if_failed(first)
    fixes = "Raise resources.memory_budget_gb, use a smaller model or data.seq_len, or add workers (ZeRO-2 shards the optimizer)"
    own = config.model.activation_checkpointing
    if own != "none":  # the user's own setting: searched with it only
        hint = " or model.activation_checkpointing=full (it keeps fewer activations than every_n)" if own == "every_n" else ""
        raise ConfigError(
            f"train.micro_batch=auto: not even micro_batch={first.micro_batch} fits with model.activation_checkpointing={own} "
            f"({first.status}: {first.reason}). {fixes}{hint}"
        )
    retry, budget_gb = _probe_candidates(
        _with_checkpointing(config, "full"), candidates, budget_gb=budget_gb, probe=probe
    )
    probes += retry
    best = fastest(retry)
    if best is None:
        _raise_if_failed(retry[0])
        raise ConfigError(
            f"train.micro_batch=auto: not even micro_batch={first.micro_batch} fits, neither without activation "
            f"checkpointing ({first.status}: {first.reason}) nor with it, full ({retry[0].status}: {retry[0].reason}). {fixes}"
        )
    reason = (
        f"no micro-batch fits without activation checkpointing (micro_batch={first.micro_batch} did not fit: {first.reason}); "
        f"with it (full), micro_batch={best.micro_batch} fits: " + _why(best, retry, budget_gb=budget_gb, source=source)
    )
    return AutoBatchChoice(
        micro_batch=best.micro_batch, grad_accum=best.grad_accum, budget_gb=budget_gb, budget_source=source,
        probes=probes, reason=reason, activation_checkpointing="full",
    )


def _with_checkpointing(config: Config, value: str) -> Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, activation_checkpointing=value))


def _probe_candidates(
    config: Config, candidates: list[tuple[int, int]], *, budget_gb: float | None, probe,
) -> tuple[list[Probe], float | None]:
    """Smallest first, up to the first that does not fit: (the probes, the budget: on GPU without
    one configured, known once a probe reported the device's memory)."""
    probes: list[Probe] = []
    for micro_batch, grad_accum in candidates:
        result = probe(config, micro_batch=micro_batch, grad_accum=grad_accum, budget_gb=budget_gb)
        result.activation_checkpointing = config.model.activation_checkpointing
        probes.append(result)
        if budget_gb is None and result.device_total_gb:
            budget_gb = result.device_total_gb * (1 - GPU_MEMORY_MARGIN)
        if result.status != OK:
            break  # a larger micro-batch needs more memory still
    return probes, budget_gb


def _raise_if_failed(probe: Probe) -> None:
    """A probe that failed for another reason than memory: the search cannot go on."""
    if probe.status == FAILED:
        setting = probe.activation_checkpointing
        with_ckpt = "" if setting == "none" else f" (model.activation_checkpointing={setting})"
        raise RaytrainFastError(
            f"train.micro_batch=auto: the probe of micro_batch={probe.micro_batch}{with_ckpt} failed: {probe.reason}"
        )


def _why(best: Probe, probes: list[Probe], *, budget_gb: float | None, source: str) -> str:
    """One line on the choice: what fit, what stopped the search, what was slower."""
    others = [p for p in probes if p.status == OK and p is not best]
    why = f"fastest of {len(others) + 1} that fit ({best.tokens_per_sec:,.0f} tokens/s per worker, peak {best.peak_gb:.2f} GB"
    why += f" of {budget_gb:.2f} GB, {source})" if budget_gb else ")"
    stopped = [p for p in probes if p.status != OK]
    if stopped:
        verb = "failed" if stopped[0].status == FAILED else "did not fit"
        why += f"; micro_batch={stopped[0].micro_batch} {verb} ({stopped[0].reason})"
    larger = [p for p in others if p.micro_batch > best.micro_batch]
    if larger:
        why += f"; the larger {', '.join(str(p.micro_batch) for p in larger)} fit but ran slower"
    return why


def resolve_micro_batch(config: Config, *, probe=probe_in_fresh_process) -> Config:
    """Replace micro_batch=auto with the cached or measured choice (after `launch.plan.on_the_cluster`:
    use_gpu, cpus_per_worker and precision must be resolved), and turn activation checkpointing on
    when the choice did (nothing fit without it). Other configs pass through."""
    if config.train.micro_batch != "auto":
        return config
    key, inputs = cache_key(config)
    choice = _read_cache(config, key)
    if choice is None:
        say(f"micro_batch=auto: measuring candidates for global_batch={config.train.global_batch} "
            f"on {config.resources.num_workers} worker(s), one fresh process each...")
        choice = search(config, probe=probe)
        _write_cache(config, key, inputs, choice)
        choice.cache_uri = _cache_path(config, key)[2]
        checkpointing = choice.activation_checkpointing or config.model.activation_checkpointing
        say(format_probes(choice.probes, chosen=choice.micro_batch, checkpointing=checkpointing))
    where = f"cached in {choice.cache_uri}" if choice.cached else f"saved to {choice.cache_uri}"
    turned_on = choice.activation_checkpointing not in (None, config.model.activation_checkpointing)
    message = (
        f"micro_batch=auto -> micro_batch={choice.micro_batch}, grad_accum={choice.grad_accum}"
        + (f", model.activation_checkpointing={choice.activation_checkpointing}" if turned_on else "")
        + f" (x {config.resources.num_workers} workers = global batch {config.train.global_batch}): {choice.reason} [{where}]"
    )
    logger.info(message)
    say(message)
    if turned_on:
        config = _with_checkpointing(config, choice.activation_checkpointing)
    return dataclasses.replace(
        config, train=dataclasses.replace(config.train, micro_batch=choice.micro_batch, grad_accum=choice.grad_accum)
    )
