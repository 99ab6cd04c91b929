"""Metric sinks, written from rank 0 on one background thread (`SinkWriter`, in sink_writer.py); every
sink has `log(metrics, step)` and `close()`. JSONL in the run's storage is always on (read back by
`read_metrics`, metric_files.py); W&B and TensorBoard when asked for (their libraries imported on the
sink thread), with `LocalDirSync` copying their node-local files into the run's storage.
`SinkWriter`, `MetricSink` and `read_metrics` are handed on from here, where callers import them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from raytrain_fast.metrics.metric_files import METRICS_DIR, list_segments, metrics_filesystem, read_metrics, segment_name
from raytrain_fast.metrics.sink_writer import MetricSink, SinkWriter

if TYPE_CHECKING:
    from raytrain_fast.config.metrics import MetricsConfig
    from raytrain_fast.storage import StorageConfig

logger = logging.getLogger("raytrain_fast.metrics")


class JsonlSink:
    """One JSON object per line: `{"step": 10, "time": 1700000000.0, "train/loss": 2.1, ...}`.

    Files live in `<run_uri>/metrics/`. Objects in S3 cannot be appended to, so every (re)start of
    the run writes its own numbered segment `metrics-r<restart>-p<part>.jsonl`: the current part is
    rewritten whole on each flush and a new part begins once it passes `max_part_bytes`. Its first
    line records the step the run (re)started from; `read_metrics` uses it to drop the steps an
    interrupted attempt logged past the checkpoint the next attempt resumed from.

    Flushes happen at most every `flush_every_s` and on close, on the sink thread: a crash loses
    at most that much. Local files are replaced atomically (write, then rename).
    """

    def __init__(
        self,
        run_uri: str,
        *,
        start_step: int,
        storage: StorageConfig | None = None,
        flush_every_s: float = 10.0,
        max_part_bytes: int = 1 << 20,
    ) -> None:
        import pyarrow.fs as pafs

        self._fs, root = metrics_filesystem(run_uri, storage)
        self._dir = f"{root}/{METRICS_DIR}"
        self._local = isinstance(self._fs, pafs.LocalFileSystem)
        self._fs.create_dir(self._dir, recursive=True)
        existing = list_segments(self._fs, self._dir)
        self.restart = existing[-1][0] + 1 if existing else 0
        self.flush_every_s = flush_every_s
        self.max_part_bytes = max_part_bytes
        self._part = 0
        self._lines: list[bytes] = []
        self._size = 0
        self._dirty = True  # the header below
        self._last_flush = time.monotonic()
        header = {"_segment": {"restart": self.restart, "start_step": start_step, "time": time.time(), "host": socket.gethostname()}}
        self._append(header)
        self.flush()  # the segment exists from the start, so the restart number is taken

    @property
    def path(self) -> str:
        """The part being written now."""
        return f"{self._dir}/{segment_name(self.restart, self._part)}"

    def _append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        self._lines.append(line)
        self._size += len(line)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self._append({"step": step, "time": round(time.time(), 3), **metrics})
        self._dirty = True
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if not self._dirty:
            return
        data = b"".join(self._lines)
        if self._local:
            tmp = f"{self.path}.tmp"
            with self._fs.open_output_stream(tmp) as out:
                out.write(data)
            self._fs.move(tmp, self.path)
        else:
            with self._fs.open_output_stream(self.path) as out:  # the object appears whole on close
                out.write(data)
        self._dirty = False
        self._last_flush = time.monotonic()
        if self._size >= self.max_part_bytes:
            self._part += 1
            self._lines, self._size = [], 0

    def close(self) -> None:
        self.flush()


def wandb_run_id(run_name: str, project: str) -> str:
    """Stable across resumes: the same run name continues the same W&B run."""
    slug = re.sub(r"[^a-z0-9_-]+", "-", run_name.lower()).strip("-")[:40] or "run"
    digest = hashlib.sha256(f"{project}/{run_name}".encode()).hexdigest()[:8]
    return f"{slug}-{digest}"


def resolve_wandb_mode(mode: str) -> str:
    """auto = online only when an API key is in the environment (nothing to prompt for)."""
    if mode == "auto":
        return "online" if os.environ.get("WANDB_API_KEY") else "offline"
    return mode


class WandbSink:
    """A W&B run, opened on the sink thread (`wandb.init` takes seconds): when the writer starts, or at the first record.

    System-stats sampling is off (its thread costs CPU on every node), console capture is off,
    and the run id derives from the run name so a resumed job continues the same curves. Steps
    at or below what the run already holds are skipped (W&B would drop them with a warning each):
    after a resume from an older checkpoint the curve continues where W&B left it.
    The API key is read by wandb from the environment; it never goes into the config or logs.
    """

    def __init__(
        self,
        *,
        run_name: str,
        project: str,
        local_dir: str,
        mode: str = "auto",
        entity: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        from raytrain_fast.storage import redact

        self.dir = os.path.abspath(os.path.expanduser(local_dir))
        self._init_args = dict(  # wandb.init's
            project=project, entity=entity, name=run_name, id=wandb_run_id(run_name, project), resume="allow",
            mode=resolve_wandb_mode(mode), dir=self.dir, reinit="create_new",
            config=redact(dict(config or {})),  # credential-like values masked before W&B sees them
        )
        self._run: Any = None
        self._next_step = 0

    def open(self) -> None:
        if self._run is not None:
            return
        import wandb

        os.makedirs(self.dir, exist_ok=True)
        settings = wandb.Settings(
            x_disable_stats=True,  # no system-metrics sampling thread
            console="off",  # no stdout/stderr capture (it would copy whatever the job prints)
            save_code=False,
            disable_git=True,
            silent=True,
            x_save_requirements=False,
        )
        self._run = wandb.init(**self._init_args, settings=settings)
        self._next_step = int(getattr(self._run, "step", 0) or 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.open()
        if step < self._next_step:
            return
        self._run.log(dict(metrics), step=step)
        self._next_step = step + 1

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


class TensorBoardSink:
    """Scalars to TensorBoard event files in a local directory, flushed every `flush_every_s`."""

    def __init__(self, *, log_dir: str, flush_every_s: float = 30.0) -> None:
        self.log_dir = os.path.abspath(os.path.expanduser(log_dir))
        self.flush_every_s = flush_every_s
        self._writer: Any = None

    def open(self) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir, flush_secs=max(1, int(self.flush_every_s)))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.open()
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class LocalDirSync:
    """Copies the files W&B and TensorBoard write under rank 0's node-local `local_dir` into the
    run's storage (`<run>/wandb/...`, `<run>/tensorboard/...`): at each checkpoint (the writer's
    flush) and at the end (close; listed after those sinks, so their files are complete by then).

    Only files that changed since the last copy go (size or mtime); symlinks (W&B's `latest-run`,
    debug logs) are skipped; nothing in storage is ever deleted. A restart, on this node or another,
    opens new files beside the old ones rather than appending to them: W&B (offline) starts a new
    `offline-run-<time>-<id>` directory for the same run id (`wandb sync` takes them all, in order),
    TensorBoard a new `events.out.tfevents.<time>.<host>...` file, and TensorBoard reads every
    event file of a directory as one series. So storage holds the whole history without a download.

    `local_dir` is a temporary copy (run_uri is remote): once close's last copy has gone through, it
    is removed. If that copy fails, it stays, and the writer's warning names the sink.
    """

    def __init__(self, local_dir: str, run_uri: str, *, storage: StorageConfig | None = None) -> None:
        self.local_dir = os.path.abspath(local_dir)
        self._fs, self._root = metrics_filesystem(run_uri, storage)
        self._sent: dict[str, tuple[int, int]] = {}

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def close(self) -> None:
        import shutil

        self.flush()  # raises on a failed copy: the local files stay
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def flush(self) -> None:
        """Copy what changed."""
        import stat

        for directory, subdirs, names in os.walk(self.local_dir):
            subdirs.sort()
            for name in sorted(names):
                path = os.path.join(directory, name)
                info = os.lstat(path)
                if not stat.S_ISREG(info.st_mode):
                    continue
                relative = os.path.relpath(path, self.local_dir).replace(os.sep, "/")
                key = (info.st_size, info.st_mtime_ns)
                if self._sent.get(relative) == key:
                    continue
                target = f"{self._root}/{relative}"
                self._fs.create_dir(target.rsplit("/", 1)[0], recursive=True)
                with open(path, "rb") as source, self._fs.open_output_stream(target) as sink:
                    while chunk := source.read(1 << 20):
                        sink.write(chunk)
                self._sent[relative] = key


def build_sinks(
    config: MetricsConfig,
    *,
    run_uri: str,
    run_name: str,
    start_step: int,
    local_dir: str,
    storage: StorageConfig | None = None,
    run_config: Mapping[str, Any] | None = None,
) -> list[MetricSink]:
    """The sinks rank 0 writes to: JSONL in `run_uri` always, W&B and TensorBoard when enabled.

    `local_dir` is a directory on this node for the files W&B and TensorBoard keep locally (the
    run's directory when storage is local, a temporary directory otherwise; never the repo).
    """
    sinks: list[MetricSink] = [
        JsonlSink(run_uri, start_step=start_step, storage=storage, flush_every_s=config.jsonl_flush_every_s)
    ]
    if config.wandb:
        sinks.append(
            WandbSink(
                run_name=run_name, project=config.wandb_project, entity=config.wandb_entity, mode=config.wandb_mode,
                local_dir=local_dir, config=run_config,
            )
        )
    if config.tensorboard:
        sinks.append(TensorBoardSink(log_dir=os.path.join(local_dir, "tensorboard"), flush_every_s=config.tensorboard_flush_every_s))
    if (config.wandb or config.tensorboard) and "://" in run_uri:  # local_dir is a node-local temp dir then
        sinks.append(LocalDirSync(local_dir, run_uri, storage=storage))
    return sinks
