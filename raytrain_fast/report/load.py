"""A run's metrics as the report sees them: every JSONL record, the run's config when a checkpoint
holds one, and which log windows are past warm-up."""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from raytrain_fast.config.metrics import MetricsConfig
from raytrain_fast.errors import RaytrainFastError

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from raytrain_fast.storage import StorageConfig

# Warm-up (metrics.slowdown_warmup_steps) is never more than this share of the run's windows, so a
# short run still has some to judge.
MAX_WARMUP_SHARE = 0.3
# A gap between two records this much longer than their steps could take means the run stopped and
# was resumed: the first window after it is a warm-up again (restore, new workers, cold data).
RESTART_GAP_FACTOR = 5.0
RESTART_GAP_MIN_S = 30.0


@dataclass(kw_only=True)
class RunMetrics:
    name: str
    uri: str
    """The run's directory (local path or s3:// URI)."""
    records: list[dict[str, Any]]
    """Every metrics record, ordered by step: {"step": ..., "time": ..., "<metric>": value}."""
    config: dict[str, Any] | None = None
    """The run's (redacted) config from its newest checkpoint; None when no checkpoint has one."""
    warmup_steps: int = 0
    """Records at or below this step are warm-up and left out of the judgements."""
    restart_steps: list[int] = field(default_factory=list)
    """Log steps whose window began with a resume (also left out)."""
    auto_micro_batch: int | None = None
    """The micro-batch `train.micro_batch: auto` chose for this run's model, batch and workers (from
    its cache in the storage), so advice never suggests `auto` where it picked the run's setting."""
    saved_steps: list[int] = field(default_factory=list)
    """Steps of the checkpoints the run's directory holds now (retention may have removed older ones)."""
    hangs: list[dict[str, Any]] = field(default_factory=list)
    """The hang watchdog's records (`<run>/hangs/hang-*.json`, watchdog/stacks.py), oldest first."""
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """The divergence rollbacks (`<run>/health.json`, loop/health.py), oldest first."""
    divergence_stop: dict[str, Any] | None = None
    """The divergence the run stopped on (`<run>/health.json`), if it did."""

    @property
    def steady(self) -> list[dict[str, Any]]:
        """The records the diagnosis judges: past warm-up and not the first window after a resume."""
        skip = set(self.restart_steps)
        return [r for r in self.records if r["step"] > self.warmup_steps and r["step"] not in skip]

    @property
    def world_size(self) -> int | None:
        """Ranks, from the config (None when unknown; multi-rank runs also show time/step_s_rank_spread)."""
        value = self.setting("resources", "num_workers")
        return int(value) if isinstance(value, int) else None

    @property
    def last_step(self) -> int:
        return self.records[-1]["step"] if self.records else 0

    def setting(self, section: str, key: str, default: Any = None) -> Any:
        """A value of the run's config, or `default` when the config or the key is missing."""
        if not self.config:
            return default
        return (self.config.get(section) or {}).get(key, default)

    def has(self, metric: str) -> bool:
        return any(metric in r for r in self.records)

    def names_under(self, prefix: str, suffix: str = "") -> list[str]:
        """The <name>s of the `<prefix><name><suffix>` metrics in the records, in first-seen order."""
        names: dict[str, None] = {}
        for record in self.records:
            for key in record:
                if key.startswith(prefix) and key.endswith(suffix) and len(key) > len(prefix) + len(suffix):
                    names.setdefault(key[len(prefix):len(key) - len(suffix)], None)
        return list(names)

    def series(self, metric: str, *, steady: bool = False) -> tuple[list[int], list[float]]:
        """(steps, values) of the records that hold `metric`."""
        records = self.steady if steady else self.records
        points = [(r["step"], float(r[metric])) for r in records if isinstance(r.get(metric), (int, float))]
        return [s for s, _ in points], [v for _, v in points]

    @property
    def log_every(self) -> int:
        """The log cadence: train.log_every from the config, else the smallest gap between records
        (records can be missing: a sink that dropped some, a run that stopped between log steps)."""
        configured = self.setting("train", "log_every")
        if isinstance(configured, int) and configured > 0:
            return configured
        gaps = [b["step"] - a["step"] for a, b in zip(self.records, self.records[1:]) if b["step"] > a["step"]]
        return min(gaps) if gaps else max(1, self.records[0]["step"] if self.records else 1)

    def window_steps(self) -> dict[int, int]:
        """Optimizer steps in each record's log window (step -> steps since the log step before it).

        Log steps are the multiples of log_every plus the run's last step, so this does not depend
        on the previous record being there.
        """
        every = self.log_every
        return {r["step"]: max(1, r["step"] - ((r["step"] - 1) // every) * every) for r in self.records}


    def saves_in_window(self, step: int) -> list[int]:
        """The steps of the checkpoints whose blocked time the record at `step` holds.

        A save after step s is timed into the window that ends at the next log step, so the window
        (a, b] holds the saves at the multiples of checkpoint.every_steps in [a, b). Without a
        known cadence (every_minutes saves) it is the window's first step, a."""
        start = step - self.window_steps()[step]
        every = self.setting("checkpoint", "every_steps")
        saves = [s for s in range(start, step) if s > 0 and s % every == 0] if isinstance(every, int) and every > 0 else []
        return saves or [start]

    def resizes(self) -> list[tuple[int, int, int]]:
        """(step, workers before, workers after) of each resize of an elastic run (or a resume on
        another worker count), from the records the loop writes when it resumes at a new size."""
        return [
            (r["step"], int(r["resize/from_workers"]), int(r["resize/to_workers"]))
            for r in self.records if isinstance(r.get("resize/to_workers"), (int, float))
        ]

    def planned_saves(self) -> list[int]:
        """Every checkpoint.every_steps step up to the last logged step, the last step itself when it
        is train.steps (the run's final save, which no later record times), and every checkpoint the
        run's directory holds (a save on a stop signal, or at the end of an earlier train.steps)."""
        every, total = self.setting("checkpoint", "every_steps"), self.setting("train", "steps")
        saves = set(range(every, self.last_step + 1, every)) if isinstance(every, int) and every > 0 else set()
        if total == self.last_step:
            saves.add(self.last_step)
        saves.update(s for s in self.saved_steps if s <= self.last_step)
        return sorted(saves)


def load_run(storage_uri: str, name: str, *, storage: StorageConfig | None = None) -> RunMetrics:
    """Read run `name` under `storage_uri` (local or s3://). Raises ReportError when it has no metrics."""
    from raytrain_fast.checkpoint.verify import list_checkpoint_dirs
    from raytrain_fast.loop.health import read_health
    from raytrain_fast.metrics.sinks import read_metrics
    from raytrain_fast.storage import StorageConfig, resolve_filesystem

    storage = storage or StorageConfig(uri=storage_uri)
    uri = f"{storage_uri.rstrip('/')}/{name}"
    records = read_metrics(uri, storage=storage)
    if not records:
        root = storage_uri.rstrip("/")
        parent, _, last = root.rpartition("/")
        if parent and read_metrics(root, storage=storage):  # --storage names the run itself
            raise ReportError(
                f"{root} is a run's own directory, not the storage that holds runs: use "
                f"`raytrain-fast report --storage {parent} --name {last}`."
            )
        raise ReportError(
            f"run '{name}' has no metrics under {uri}/metrics/. Check --storage and --name "
            f"(`raytrain-fast runs --storage {storage_uri}` lists the runs there)."
        )
    run = from_records(records, name=name, uri=uri, config=newest_config(uri, storage))
    filesystem, path = resolve_filesystem(uri, storage)  # read_metrics has just read through it
    with contextlib.suppress(OSError):  # unreadable: the report goes on without them
        run.saved_steps = sorted(step for step, _ in list_checkpoint_dirs(filesystem, path))
    run.auto_micro_batch = _auto_micro_batch(storage_uri, storage, run.config)
    with contextlib.suppress(OSError, ValueError):  # the hang watchdog's records (none when it never acted)
        run.hangs = _json_files(filesystem, f"{path}/hangs", prefix="hang-")
    health = read_health(filesystem, path)
    run.rollbacks, run.divergence_stop = list(health.get("rollbacks", [])), health.get("stopped")
    return run


def _json_files(filesystem: pafs.FileSystem, directory: str, *, prefix: str = "") -> list[Any]:
    """The parsed `<prefix>*.json` files of `directory`, by name ([] when it does not exist)."""
    import json

    import pyarrow.fs as pafs

    found = []
    infos = filesystem.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    for info in sorted(infos, key=lambda i: i.path):
        if info.base_name.startswith(prefix) and info.base_name.endswith(".json"):
            with filesystem.open_input_stream(info.path) as stream:
                found.append(json.loads(stream.read()))
    return found


def _auto_micro_batch(storage_uri: str, storage: StorageConfig, config: dict[str, Any] | None) -> int | None:
    """The micro-batch `auto` chose for this run's inputs, from the choices autobatch caches under
    <storage>/_autobatch/ (key_inputs: model, batch, workers, precision, memory budget). The model's
    activation_checkpointing is left out of the match: the choice itself may have turned it on."""
    from raytrain_fast.microbatch.auto import CACHE_DIR
    from raytrain_fast.storage import resolve_filesystem

    if not config:
        return None
    section = lambda name: config.get(name) or {}  # noqa: E731
    wanted = {
        "seq_len": section("data").get("seq_len"), "world_size": section("resources").get("num_workers"),
        "zero_stage": section("engine").get("zero_stage"), "precision": section("engine").get("precision"),
        "global_batch": section("train").get("global_batch"), "memory_budget_gb": section("resources").get("memory_budget_gb"),
        "cpus_per_worker": section("resources").get("cpus_per_worker"),
    }
    model = {k: v for k, v in section("model").items() if k != "activation_checkpointing"}
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # an unreadable cache: no claim either way
        filesystem, root = resolve_filesystem(storage_uri, storage)
        for cached in _json_files(filesystem, f"{root.rstrip('/')}/{CACHE_DIR}"):
            inputs = cached.get("key_inputs") or {}
            cached_model = {k: v for k, v in (inputs.get("model") or {}).items() if k != "activation_checkpointing"}
            if cached_model == model and all(inputs.get(k) == v for k, v in wanted.items()):
                return int(cached["micro_batch"])
    return None


def from_records(records: list[dict[str, Any]], *, name: str = "run", uri: str = "", config: dict[str, Any] | None = None) -> RunMetrics:
    """A RunMetrics from records already in memory (tests, notebooks); warm-up and resumes are found here."""
    records = sorted(records, key=lambda r: r["step"])
    run = RunMetrics(name=name, uri=uri, records=records, config=config)
    configured = run.setting("metrics", "slowdown_warmup_steps", MetricsConfig.slowdown_warmup_steps)
    run.warmup_steps = _warmup_step(records, configured)
    run.restart_steps = _restart_steps(records)
    return run


def _warmup_step(records: list[dict[str, Any]], configured: int) -> int:
    """The last warm-up step: the configured warm-up, at least the first window, at most MAX_WARMUP_SHARE."""
    if not records:
        return 0
    steps = [r["step"] for r in records]
    cap_index = max(0, int(len(steps) * MAX_WARMUP_SHARE) - 1)
    within = [s for s in steps if s <= configured]
    last_warm = within[-1] if within else steps[0]
    return max(steps[0], min(last_warm, steps[cap_index]))


def _restart_steps(records: list[dict[str, Any]]) -> list[int]:
    restarts = []
    for previous, record in zip(records, records[1:]):
        elapsed = record.get("time", 0.0) - previous.get("time", 0.0)
        expected = float(record.get("time/step_s", 0.0)) * (record["step"] - previous["step"])
        if elapsed > max(RESTART_GAP_MIN_S, RESTART_GAP_FACTOR * expected):
            restarts.append(record["step"])
    return restarts


def newest_config(run_uri: str, storage: StorageConfig) -> dict[str, Any] | None:
    """The config.yaml of the newest checkpoint that has one (the loop writes it with every save)."""
    import yaml

    from raytrain_fast.checkpoint.layout import CONFIG_FILE
    from raytrain_fast.checkpoint.verify import list_checkpoint_dirs
    from raytrain_fast.storage import resolve_filesystem

    with contextlib.suppress(OSError):
        filesystem, path = resolve_filesystem(run_uri, storage)
        for _, directory in list_checkpoint_dirs(filesystem, path):
            try:
                with filesystem.open_input_stream(f"{directory}/{CONFIG_FILE}") as stream:
                    loaded = yaml.safe_load(stream.read())
            except OSError:  # FileNotFoundError included: a checkpoint without one
                continue
            if isinstance(loaded, dict):
                return loaded
    return None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class ReportError(RaytrainFastError):
    """The report cannot be made (no such run, no metrics)."""
