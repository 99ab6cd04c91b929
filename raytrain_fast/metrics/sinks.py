"""Metric sinks, written from rank 0 on one background thread.

Every sink has `log(metrics, step)` and `close()`. The training thread only ever hands a record to
`SinkWriter`, which puts it on a bounded queue and returns: a slow or stuck sink (a network stall
in W&B, a slow bucket) costs the training thread nothing. When the queue is full the oldest record
is dropped and counted (`sink/dropped`).

- `JsonlSink`: always on. Metrics as JSON lines in the run's storage (local or S3-compatible), read
  back by `read_metrics`, which merges the segments of every (re)start into one series.
- `WandbSink`, `TensorBoardSink`: when asked for; their libraries are imported lazily, on the sink
  thread, the first time they log.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import pyarrow.fs as pafs

    from raytrain_fast.config.metrics import MetricsConfig
    from raytrain_fast.storage import StorageConfig

logger = logging.getLogger("raytrain_fast.metrics")


class MetricSink(Protocol):
    """Where metrics go. Called from the sink thread only, never from the training thread."""

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self) -> None: ...


_FLUSH = ("__flush__",)  # queue marker: flush the sinks, in order with the records before it


class SinkWriter:
    """A bounded queue and one daemon thread that feeds every sink in order.

    The thread first opens every sink that has an `open` (W&B's import and `wandb.init`,
    TensorBoard's writer: seconds of CPU), so a writer built during setup has its sinks open
    before training starts instead of taking those seconds from the first steps.
    `log` never blocks and never raises because of a sink. A sink that raises is reported once
    (a warning naming it) and counted in `errors`; the other sinks keep going.
    """

    def __init__(self, sinks: Sequence[MetricSink], *, max_queue: int = 1000, close_timeout_s: float = 60.0) -> None:
        if max_queue <= 0:
            raise ValueError(f"max_queue must be > 0, got {max_queue}")
        self.sinks = list(sinks)
        self.max_queue = max_queue
        self.close_timeout_s = close_timeout_s
        self.dropped = 0
        """Records dropped because the queue was full (oldest first)."""
        self.errors = 0
        """Sink calls that raised."""
        self._cpu_in_calls = 0.0
        self._queue: deque[tuple[dict[str, float], int] | None] = deque()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._warned: set[tuple[str, str]] = set()
        self.opened = threading.Event()
        """Set once every sink's `open` has returned (or raised)."""
        self._thread = threading.Thread(target=self._run, name="raytrain-fast-metric-sinks", daemon=True)
        self._thread.start()
        # The sink thread's own CPU clock, readable from the training thread while a sink call is
        # still running (a long call would otherwise show up only when it returns).
        try:
            self._clock_id: int | None = time.pthread_getcpuclockid(self._thread.ident)  # type: ignore[arg-type]
        except (AttributeError, OSError):
            self._clock_id = None
        self._last_cpu_s = 0.0

    @property
    def cpu_s(self) -> float:
        """CPU time the sink thread has used so far (time it may have taken from training)."""
        if self._clock_id is not None and self._thread.is_alive():
            try:
                self._last_cpu_s = time.clock_gettime(self._clock_id)
                return self._last_cpu_s
            except OSError:
                pass
        return max(self._last_cpu_s, self._cpu_in_calls)

    @property
    def backlog(self) -> int:
        """Records waiting for the sink thread."""
        return len(self._queue)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        record = (dict(metrics), step)
        with self._cond:
            if self._closed:
                return
            if len(self._queue) >= self.max_queue:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(record)
            self._cond.notify()

    def request_flush(self) -> None:
        """Ask every sink to persist what it has (e.g. at a checkpoint), without waiting for it."""
        with self._cond:
            if not self._closed:
                self._queue.append(_FLUSH)
                self._cond.notify()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued record has been handed to the sinks (tests, end of run)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self) -> None:
        """Deliver what is queued, close every sink, stop the thread (bounded by close_timeout_s)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._queue.append(None)  # sentinel: after everything already queued
            self._cond.notify()
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            logger.warning(
                "metric sinks did not finish within %.0f s; %d records may be lost", self.close_timeout_s, len(self._queue)
            )

    def _run(self) -> None:
        for sink in self.sinks:
            if hasattr(sink, "open"):
                self._call(sink, "open")
        self.opened.set()
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
                self._busy = item is not None
            if item is None:
                break
            if item is _FLUSH:
                for sink in self.sinks:
                    if hasattr(sink, "flush"):
                        self._call(sink, "flush")
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
                continue
            metrics, step = item
            for sink in self.sinks:
                self._call(sink, "log", metrics, step)
            with self._cond:
                self._busy = False
                self._cond.notify_all()
        for sink in self.sinks:
            self._call(sink, "close")
        with self._cond:
            self._cond.notify_all()

    def _call(self, sink: MetricSink, method: str, *args: Any) -> None:
        started = time.thread_time()
        try:
            getattr(sink, method)(*args)
        except Exception as error:  # a sink must never take training down
            self.errors += 1
            name = type(sink).__name__
            if (name, method) not in self._warned:
                self._warned.add((name, method))
                logger.warning("metric sink %s.%s failed (further failures are counted in sink/errors): %r", name, method, error)
        finally:
            self._cpu_in_calls += time.thread_time() - started


# --- JSONL in the run's storage ------------------------------------------------------------------

METRICS_DIR = "metrics"
_SEGMENT = re.compile(r"^metrics-r(\d{4,})-p(\d{4,})\.jsonl$")


def _segment_name(restart: int, part: int) -> str:
    return f"metrics-r{restart:04d}-p{part:04d}.jsonl"


def _filesystem(uri: str, storage: StorageConfig | None, filesystem: pafs.FileSystem | None) -> tuple[pafs.FileSystem, str]:
    if filesystem is not None:
        return filesystem, uri.split("://", 1)[-1].rstrip("/")
    from raytrain_fast.storage import StorageConfig, resolve_filesystem

    return resolve_filesystem(uri, storage or StorageConfig())


def _list_segments(fs: pafs.FileSystem, directory: str) -> list[tuple[int, int, str]]:
    import pyarrow.fs as pafs

    try:
        infos = fs.get_file_info(pafs.FileSelector(directory, allow_not_found=True))
    except FileNotFoundError:
        return []
    segments = []
    for info in infos:
        match = _SEGMENT.match(info.base_name)
        if match and info.type == pafs.FileType.File:
            segments.append((int(match.group(1)), int(match.group(2)), info.path))
    return sorted(segments)


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
        filesystem: pafs.FileSystem | None = None,
        flush_every_s: float = 10.0,
        max_part_bytes: int = 1 << 20,
    ) -> None:
        import pyarrow.fs as pafs

        self._fs, root = _filesystem(run_uri, storage, filesystem)
        self._dir = f"{root}/{METRICS_DIR}"
        self._local = isinstance(self._fs, pafs.LocalFileSystem)
        self._fs.create_dir(self._dir, recursive=True)
        existing = _list_segments(self._fs, self._dir)
        self.restart = existing[-1][0] + 1 if existing else 0
        self.flush_every_s = flush_every_s
        self.max_part_bytes = max_part_bytes
        self._part = 0
        self._lines: list[bytes] = []
        self._size = 0
        self._dirty = False
        self._last_flush = time.monotonic()
        header = {"_segment": {"restart": self.restart, "start_step": start_step, "time": time.time(), "host": socket.gethostname()}}
        self._append(header)
        self._dirty = True
        self.flush()  # the segment exists from the start, so the restart number is taken

    @property
    def path(self) -> str:
        """The part being written now."""
        return f"{self._dir}/{_segment_name(self.restart, self._part)}"

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


def read_metrics(run_uri: str, *, storage: StorageConfig | None = None, filesystem: pafs.FileSystem | None = None) -> list[dict[str, Any]]:
    """Every metrics record of a run as one continuous series ordered by step, one record per step
    (records written for the same step, such as an evaluation's, are merged).

    Segments are replayed in (re)start order. When a restart resumed from step s, what earlier
    attempts logged after s was superseded (those steps ran again), so it is dropped.
    """
    fs, root = _filesystem(run_uri, storage, filesystem)
    records: list[dict[str, Any]] = []
    by_restart: dict[int, list[str]] = {}
    for restart, _, path in _list_segments(fs, f"{root}/{METRICS_DIR}"):
        by_restart.setdefault(restart, []).append(path)
    for restart in sorted(by_restart):
        segment: list[dict[str, Any]] = []
        start_step: int | None = None
        for path in by_restart[restart]:
            with fs.open_input_stream(path) as stream:
                text = stream.read().decode("utf-8", errors="replace")
            for line in text.splitlines():
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a torn line; never written by JsonlSink itself, but be lenient
                if "_segment" in record:
                    start_step = int(record["_segment"].get("start_step", 0))
                elif isinstance(record.get("step"), int):
                    segment.append(record)
        if start_step is None:
            start_step = min((r["step"] for r in segment), default=1) - 1
        records = [r for r in records if r["step"] <= start_step]
        records.extend(segment)
    records.sort(key=lambda r: r["step"])  # stable: keeps the order of equal steps
    merged: list[dict[str, Any]] = []
    for record in records:  # one record per step: an evaluation's values join that step's window record
        if merged and merged[-1]["step"] == record["step"]:
            merged[-1].update(record)
        else:
            merged.append(record)
    return merged


# --- Weights & Biases ------------------------------------------------------------------------------

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
        self.run_name = run_name
        self.project = project
        self.entity = entity
        self.mode = resolve_wandb_mode(mode)
        self.run_id = wandb_run_id(run_name, project)
        self.dir = os.path.abspath(os.path.expanduser(local_dir))
        from raytrain_fast.storage import redact

        self.config = redact(dict(config or {}))  # credential-like values masked before W&B sees them
        self.skipped = 0
        self._run: Any = None
        self._next_step = 0

    def open(self) -> None:
        if self._run is None:
            self._open()

    def _open(self) -> None:
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
        self._run = wandb.init(
            project=self.project,
            entity=self.entity,
            name=self.run_name,
            id=self.run_id,
            resume="allow",
            mode=self.mode,
            dir=self.dir,
            config=self.config,
            settings=settings,
            reinit="create_new",
        )
        self._next_step = int(getattr(self._run, "step", 0) or 0)

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        if self._run is None:
            self._open()
        if step < self._next_step:
            self.skipped += 1
            return
        self._run.log(dict(metrics), step=step)
        self._next_step = step + 1

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


# --- TensorBoard -----------------------------------------------------------------------------------


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


# --- W&B and TensorBoard files into the run's storage ----------------------------------------------


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

    def __init__(
        self, local_dir: str, run_uri: str, *, storage: StorageConfig | None = None, filesystem: pafs.FileSystem | None = None
    ) -> None:
        self.local_dir = os.path.abspath(local_dir)
        self._fs, self._root = _filesystem(run_uri, storage, filesystem)
        self._sent: dict[str, tuple[int, int]] = {}
        self.files_copied = 0

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def flush(self) -> None:
        self.sync()

    def close(self) -> None:
        import shutil

        self.sync()  # raises on a failed copy: the local files stay
        shutil.rmtree(self.local_dir, ignore_errors=True)

    def sync(self) -> int:
        """Copy what changed; returns how many files went."""
        import stat

        copied = 0
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
                copied += 1
        self.files_copied += copied
        return copied


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


__all__ = [
    "JsonlSink",
    "LocalDirSync",
    "MetricSink",
    "SinkWriter",
    "TensorBoardSink",
    "WandbSink",
    "build_sinks",
    "read_metrics",
    "resolve_wandb_mode",
    "wandb_run_id",
]
