"""Sinks: the bounded non-blocking queue, JSONL across resumes (local and S3), W&B offline, TensorBoard."""

from __future__ import annotations

import glob
import os
import threading
import time

import pytest

from raytrain_fast.metrics import JsonlSink, MetricsConfig, SinkWriter, TensorBoardSink, WandbSink, build_sinks, read_metrics
from raytrain_fast.metrics.sinks import resolve_wandb_mode, wandb_run_id
from raytrain_fast.storage import StorageConfig

pytestmark = pytest.mark.unit


class _BlockingSink:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.steps: list[int] = []
        self.closed = False

    def log(self, metrics, step):
        self.started.set()
        self.release.wait(10)
        self.steps.append(step)

    def close(self):
        self.closed = True


def test_full_queue_drops_oldest_and_never_blocks():
    sink = _BlockingSink()
    writer = SinkWriter([sink], max_queue=3)
    writer.log({"x": 0.0}, 0)
    assert sink.started.wait(5)  # the sink thread holds record 0 and is stuck in the sink
    started = time.perf_counter()
    for step in range(1, 10):
        writer.log({"x": float(step)}, step)
    # The training thread never waited for the stuck sink (stuck for 10 s): 9 puts take microseconds,
    # 2 s is room for a loaded machine.
    assert time.perf_counter() - started < 2.0
    assert writer.dropped == 6 and writer.backlog == 3
    sink.release.set()
    assert writer.flush(5)
    writer.close()
    assert sink.steps == [0, 7, 8, 9]  # the newest records survive
    assert sink.closed


def test_writer_opens_its_sinks_on_its_thread_before_the_first_record():
    class SlowToOpen:
        def __init__(self) -> None:
            self.calls: list[tuple[str, str]] = []

        def open(self):
            time.sleep(0.5)  # like W&B's import + init, only shorter
            self.calls.append(("open", threading.current_thread().name))

        def log(self, metrics, step):
            self.calls.append(("log", threading.current_thread().name))

        def close(self):
            pass

    sink = SlowToOpen()
    started = time.perf_counter()
    writer = SinkWriter([sink])
    assert time.perf_counter() - started < 0.4  # building the writer does not wait for the open
    assert writer.opened.wait(10)
    assert sink.calls == [("open", "raytrain-fast-metric-sinks")]  # opened with no record yet
    writer.log({"x": 1.0}, 1)
    assert writer.flush(5)
    writer.close()
    assert [call for call, _ in sink.calls] == ["open", "log"]


def test_failing_sink_is_counted_and_others_still_get_records(caplog):
    class Broken:
        def log(self, metrics, step):
            raise RuntimeError("bucket unreachable")

        def close(self):
            pass

    good = _BlockingSink()
    good.release.set()
    writer = SinkWriter([Broken(), good], max_queue=10)
    for step in range(3):
        writer.log({"x": 1.0}, step)
    writer.close()
    assert good.steps == [0, 1, 2]
    assert writer.errors == 3
    assert caplog.text.count("bucket unreachable") == 1  # warned once, then counted


@pytest.fixture(params=["local", "s3"])
def run_storage(request, tmp_path, monkeypatch):
    """(run URI, StorageConfig) of a run directory, on local disk or in a loopback S3 bucket."""
    if request.param == "local":
        yield str(tmp_path / "runs" / "my-run"), StorageConfig(uri=str(tmp_path / "runs"))
        return
    server = request.getfixturevalue("s3_server")
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    bucket = server.make_bucket(f"metrics-{os.getpid()}-{time.monotonic_ns()}")
    yield f"s3://{bucket}/runs/my-run", StorageConfig(uri=f"s3://{bucket}/runs", endpoint_url=server.endpoint_url)


def _attempt(run_uri, storage, *, start_step: int, steps: range, tag: float, max_part_bytes: int = 1 << 20):
    """One (re)start of the run: rank 0's sink thread writing JSONL, as the loop does."""
    sink = JsonlSink(run_uri, start_step=start_step, storage=storage, flush_every_s=0.0, max_part_bytes=max_part_bytes)
    writer = SinkWriter([sink])
    for step in steps:
        writer.log({"train/loss": 10.0 - step / 10, "attempt": tag}, step)
    writer.close()
    return sink


def test_resumed_run_reads_as_one_continuous_series(run_storage):
    run_uri, storage = run_storage
    # Attempt 0 logs to step 50 and dies; its last complete checkpoint was step 30.
    first = _attempt(run_uri, storage, start_step=0, steps=range(10, 51, 10), tag=0, max_part_bytes=150)
    # Attempt 1 resumes from step 30 and logs 40..80 (40 and 50 again, with new values).
    second = _attempt(run_uri, storage, start_step=30, steps=range(40, 81, 10), tag=1)
    # Attempt 2 resumes from step 80 and dies before its first log step.
    third = _attempt(run_uri, storage, start_step=80, steps=range(0), tag=2)
    assert (first.restart, second.restart, third.restart) == (0, 1, 2)
    assert not first.path.endswith("-p0000.jsonl")  # small parts: attempt 0 rolled over to new parts

    records = read_metrics(run_uri, storage=storage)
    assert [r["step"] for r in records] == [10, 20, 30, 40, 50, 60, 70, 80]
    assert [r["attempt"] for r in records] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert all(r["train/loss"] == pytest.approx(10.0 - r["step"] / 10) for r in records)
    assert all("time" in r for r in records)


def test_resume_from_scratch_replaces_the_whole_earlier_series(run_storage):
    run_uri, storage = run_storage
    _attempt(run_uri, storage, start_step=0, steps=range(10, 31, 10), tag=0)
    _attempt(run_uri, storage, start_step=0, steps=range(10, 21, 10), tag=1)  # no checkpoint: from step 0
    records = read_metrics(run_uri, storage=storage)
    assert [(r["step"], r["attempt"]) for r in records] == [(10, 1), (20, 1)]


def test_wandb_offline_writes_and_never_logs_the_api_key(tmp_path, monkeypatch, capfd):
    secret = "fake-api-key-0123456789abcdef0123456789abcdef"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.chdir(tmp_path)  # nothing may land in the current directory
    assert resolve_wandb_mode("auto") == "online"  # a key means online ...
    local_dir = tmp_path / "run-local"
    sink = WandbSink(
        run_name="tiny/resume-me", project="raytrain-fast-tests", local_dir=str(local_dir), mode="offline",
        config={"train": {"steps": 3}, "storage": {"secret_key": "s3-secret-value"}, "wandb_api_key": secret},
    )
    writer = SinkWriter([sink])
    # The writer opens W&B on its thread at once (seconds of import and init), before any record.
    assert writer.opened.wait(120) and sink._run is not None
    for step in (10, 20, 30):
        writer.log({"train/loss": 3.0 / step, "throughput/tokens_per_sec": 1000.0}, step)
    writer.close()
    assert writer.errors == 0

    files = [f for f in glob.glob(str(tmp_path / "**" / "*"), recursive=True) if os.path.isfile(f)]
    runs = glob.glob(str(local_dir / "wandb" / f"offline-run-*-{wandb_run_id('tiny/resume-me', 'raytrain-fast-tests')}" / "*.wandb"))
    assert len(runs) == 1
    # wandb's service process writes the offline file; under load it was seen to hold only its
    # header right after finish() returned, so give it a bounded while to land.
    deadline = time.monotonic() + 30
    while b"tokens_per_sec" not in (data := open(runs[0], "rb").read()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert b"train/loss" in data and b"tokens_per_sec" in data
    for path in files:
        content = open(path, "rb").read()
        assert secret.encode() not in content, path
        assert b"s3-secret-value" not in content, path
    out, err = capfd.readouterr()
    assert secret not in out + err
    assert not (tmp_path / "wandb").exists()

    monkeypatch.delenv("WANDB_API_KEY")
    assert resolve_wandb_mode("auto") == "offline"  # ... and no key means offline, never a prompt


def test_wandb_run_id_is_stable_and_valid():
    assert wandb_run_id("gpt2-124m", "p") == wandb_run_id("gpt2-124m", "p")
    assert wandb_run_id("gpt2-124m", "p") != wandb_run_id("gpt2-125m", "p")
    assert all(c.isalnum() or c in "-_" for c in wandb_run_id("My Run/α:1", "p"))


def test_tensorboard_writes_event_files(tmp_path):
    pytest.importorskip("tensorboard")
    sink = TensorBoardSink(log_dir=str(tmp_path / "tb"), flush_every_s=1)
    writer = SinkWriter([sink])
    writer.log({"train/loss": 1.5}, 10)
    writer.close()
    events = glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
    assert events and os.path.getsize(events[0]) > 0


def test_build_sinks_always_has_jsonl(tmp_path):
    sinks = build_sinks(
        MetricsConfig(), run_uri=str(tmp_path / "run"), run_name="run", start_step=0, local_dir=str(tmp_path / "local")
    )
    assert [type(s).__name__ for s in sinks] == ["JsonlSink"]
    sinks = build_sinks(
        MetricsConfig(wandb=True, tensorboard=True), run_uri=str(tmp_path / "run"), run_name="run", start_step=0,
        local_dir=str(tmp_path / "local"),
    )
    assert [type(s).__name__ for s in sinks] == ["JsonlSink", "WandbSink", "TensorBoardSink"]


def test_the_node_local_copy_is_removed_once_its_last_sync_went_through(tmp_path):
    from raytrain_fast.metrics.sinks import LocalDirSync

    local = tmp_path / "raytrain-fast-sinks-x"
    (local / "tensorboard").mkdir(parents=True)
    (local / "tensorboard" / "events.out.tfevents.1").write_bytes(b"first")
    remote = tmp_path / "storage" / "run"
    sync = LocalDirSync(str(local), str(remote))
    writer = SinkWriter([sync])
    writer.request_flush()
    assert writer.flush(30) and (remote / "tensorboard" / "events.out.tfevents.1").read_bytes() == b"first"
    assert local.exists()  # a checkpoint's sync keeps the files: W&B and TensorBoard go on writing
    (local / "tensorboard" / "events.out.tfevents.1").write_bytes(b"first+last")
    writer.close()
    assert writer.errors == 0
    assert (remote / "tensorboard" / "events.out.tfevents.1").read_bytes() == b"first+last"
    assert not local.exists()

    failing = tmp_path / "raytrain-fast-sinks-y"
    failing.mkdir()
    (failing / "kept").write_bytes(b"not copied")
    (tmp_path / "blocked").write_bytes(b"a file where the run's directory should be")
    broken = LocalDirSync(str(failing), str(tmp_path / "blocked" / "run"))
    writer = SinkWriter([broken])
    writer.close()
    assert writer.errors == 1 and (failing / "kept").read_bytes() == b"not copied"  # nothing lost
