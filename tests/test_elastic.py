"""Spot and elastic clusters on a simulated multi-node cluster (`ray.cluster_utils.Cluster`: several
Ray nodes, each with its own resources, on this machine): a drained node's notice yields a
checkpoint at the next log step and the run recovers on another node; an elastic run
(num_workers "1-2") goes on when a node goes away. Real Ray, real DeepSpeed, the real CLI; the
range form of resources.num_workers is checked before any worker starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from raytrain_fast.config import Config, validate
from raytrain_fast.errors import ConfigError
from tests.shared_ray import without_shared_ray

pytestmark = pytest.mark.unit

RAY = str(Path(sys.executable).with_name("ray"))

MICRO = [
    "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32",
    "data.seq_len=32", "data.max_tokens=60000", "train.micro_batch=4", "optim.warmup_steps=3",
    "train.log_every=2", "engine.precision=fp32", "metrics.profile_every=0", "metrics.peak_measure_s=0",
    "resources.cpus_per_worker=1", "resources.max_failures=0", "checkpoint.every_minutes=0",
]


# --- the range form, before any worker starts ----------------------------------------------------

@pytest.mark.parametrize(
    ("value", "expected"),
    [("1-4", (1, 4)), (" 2 - 3 ", (2, 3)), (3, 3), ("2-2", 2)],
)
def test_num_workers_range_becomes_scaling_config_workers(value, expected):
    config = Config.from_dict({"resources": {"num_workers": value}, "train": {"global_batch": 48, "micro_batch": 4}})
    validate(config)
    assert config.resources.scaling_workers() == expected
    assert Config.from_dict(config.to_dict()).resources.scaling_workers() == expected  # what the workers rebuild


@pytest.mark.parametrize(
    ("value", "problem"),
    [("4-1", "the range 4-1 must have 1 <= MIN <= MAX"), ("0-2", "the range 0-2 must have 1 <= MIN <= MAX"),
     ("two", "got 'two'"), ("1..4", "got '1..4'")],
)
def test_a_bad_worker_range_is_named_with_the_fix(value, problem):
    config = Config.from_dict({"resources": {"num_workers": value}})
    with pytest.raises(ConfigError) as error:
        validate(config)
    assert problem in str(error.value)
    suggestion = re.search(r"e\.g\. (--set resources\.num_workers=\S+(?: --set \S+)*)", str(error.value))
    assert suggestion, str(error.value)  # a fix that validates for this config (tests/test_config_problems_and_resume_changes.py checks that)


def test_an_elastic_run_needs_room_for_its_fewest_workers_only():
    settings = {"train": {"global_batch": 48, "micro_batch": 4}}  # 1, 2, 3 and 4 workers all divide 48
    elastic = Config.from_dict({**settings, "resources": {"num_workers": "1-4", "cpus_per_worker": 1}})
    validate(elastic, cluster_cpus=2, cluster_gpus=0)  # starts with 2, grows when nodes join
    fixed = Config.from_dict({**settings, "resources": {"num_workers": 4, "cpus_per_worker": 1}})
    with pytest.raises(ConfigError, match="cpus_per_worker x num_workers = 4 CPUs"):
        validate(fixed, cluster_cpus=2, cluster_gpus=0)
    too_few = Config.from_dict({**settings, "resources": {"num_workers": "3-4", "cpus_per_worker": 1}})
    with pytest.raises(ConfigError, match="cpus_per_worker x num_workers = 3 CPUs"):
        validate(too_few, cluster_cpus=2, cluster_gpus=0)


def test_every_size_of_the_range_keeps_the_global_batch_or_the_range_is_refused():
    from raytrain_fast.launch.plan import batch_table

    refused = Config.from_dict({"train": {"global_batch": 16, "micro_batch": 4}, "resources": {"num_workers": "1-4"}})
    with pytest.raises(ConfigError, match=r"cannot be kept on 3 worker\(s\).*these do: 1, 2, 4"):
        validate(refused, cluster_cpus=8, cluster_gpus=0)
    config = Config.from_dict({"train": {"global_batch": 96, "micro_batch": 8}, "resources": {"num_workers": "1-4"}})
    validate(config, cluster_cpus=8, cluster_gpus=0)
    table = batch_table(config)  # planned once on the driver, read by each worker group for its size
    assert sorted(table) == [1, 2, 3, 4] and table[4] == config.batch()  # the full size: as configured
    for workers in (1, 2, 3):  # a smaller group refits micro_batch x grad_accum, the global batch stays
        batch = table[workers]
        assert batch.global_batch == 96 and batch.micro_batch <= 8 and batch.world_size == workers


def test_a_range_given_as_a_mapping_is_refused_by_the_loader():
    with pytest.raises(ConfigError, match="resources.num_workers: expected int or str"):
        Config.from_dict({"resources": {"num_workers": {"min": 1, "max": 4}}})


# --- the notice and the resize marker, on their own -----------------------------------------------

def test_the_notice_saves_once_and_times_from_the_log_step_that_saw_it():
    from types import SimpleNamespace

    from raytrain_fast.loop.preemption import PreemptionNotice

    info = None
    notice = PreemptionNotice(reader=lambda: info)
    assert notice.flag() is False and notice.save_due(False) is False
    info = SimpleNamespace(deadline_ms=(time.time() + 100) * 1000, preempted_node_ids=["ab" * 20], preempted_ranks=[1])
    assert notice.flag() is True
    assert notice.save_due(True) is True
    assert notice.save_due(True) is False  # the bit stays up on later log steps: one save per notice
    values = notice.saved()
    assert 0 <= values["preemption/notice_to_checkpoint_s"] < 5
    assert 90 < values["preemption/deadline_margin_s"] <= 100
    line = notice.message(step=8, metrics=values)
    assert "checkpoint at step 8 complete" in line and "ranks [1]" in line and "before the node's deadline" in line
    other_rank = PreemptionNotice(reader=lambda: None)  # never saw it itself: the flags word told it
    assert other_rank.save_due(True) is True and "preemption/notice_to_checkpoint_s" in other_rank.saved()


def test_each_resize_is_a_marker_with_its_worker_counts():
    from raytrain_fast.report import from_records
    from raytrain_fast.report.plots import _pyplot, _resize_markers

    records = [{"step": s, "train/loss": 3.0, "time/step_s": 0.1} for s in range(2, 41, 2)]
    records += [{"step": 10, "resize/from_workers": 2.0, "resize/to_workers": 1.0},
                {"step": 30, "resize/from_workers": 1.0, "resize/to_workers": 2.0}]
    run = from_records(records)
    assert run.resizes() == [(10, 2, 1), (30, 1, 2)]
    figure, axis = _pyplot().subplots()
    _resize_markers(run, axis)
    assert sorted(line.get_xdata()[0] for line in axis.lines) == [10, 30]
    assert [text.get_text() for text in axis.texts] == ["2\u21921", "1\u21922"]
    _pyplot().close(figure)


# --- a simulated cluster -------------------------------------------------------------------------

@pytest.fixture
def cluster(monkeypatch):
    """A head node without CPUs (the driver, Ray Train's controller and the coordinator actor need
    none) and worker nodes added by each test. Nodes inherit this environment: Ray Train's
    preemption watcher polls the drain state every 0.5 s instead of 5 s."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S", "0.5")
    # Right after a node goes, Ray Train may still see its CPU and try the old size first: it gives
    # up after this timeout (60 s by default) and retries with what is left.
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "20")
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    monkeypatch.setenv("RAY_worker_niceness", "0")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with without_shared_ray():  # this process holds no other Ray instance meanwhile
        cluster = Cluster()
        try:
            _add_node(cluster, num_cpus=0, include_dashboard=False)  # the head
            yield cluster
        finally:
            cluster.shutdown()


def _add_node(cluster, **node_args):
    """cluster.add_node, tried twice: Ray gives a starting raylet 30 s to register, which a loaded
    2-core machine can miss (a node that failed to start is killed when the test process exits)."""
    try:
        return cluster.add_node(**node_args)
    except Exception as error:  # noqa: BLE001 - Ray raises a bare Exception for it
        if "timed out during startup" not in str(error):
            raise
        return cluster.add_node(**node_args)


class _Cli:
    """`raytrain-fast pretrain` in its own process, joined to the cluster, output collected live."""

    def __init__(self, tmp_path: Path, address: str, name: str, *settings: str, drills: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "RAY_ADDRESS": address}
        args = [sys.executable, "-m", "raytrain_fast.cli", "pretrain", "--config", "tiny", "--name", name]
        # Every simulated node is this machine: the local directory is shared, as an NFS mount would be.
        for value in (*MICRO, *settings, f"storage.uri={tmp_path / 'runs'}", "storage.shared=true"):
            args += ["--set", value]
        for drill in drills:
            args += ["--drill", drill]
        self.started = time.monotonic()
        self.process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
        self.lines: list[tuple[float, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line))

    def wait_for(
        self, pattern: str, timeout_s: float, *, fail_on: str | None = None, after: float = 0.0,
        accept: Callable[[re.Match], bool] = lambda _: True,
    ) -> tuple[float, re.Match]:
        """The first line printed after `after` (a monotonic time) matching `pattern` and `accept`;
        fails at once on a line matching `fail_on`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in list(self.lines):
                if at <= after:
                    continue
                if (match := re.search(pattern, line)) and accept(match):
                    return at, match
                if fail_on and re.search(fail_on, line):
                    raise AssertionError(f"{line.strip()}\noutput:\n{self.output}")
            if self.process.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s}s; output:\n{self.output}")

    def finish(self, timeout_s: float) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            self._reader.join(timeout=10)
        return code

    def stop(self) -> None:
        """Cleanup: kill the CLI (and so its driver) if it still runs."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._reader.join(timeout=10)

    @property
    def output(self) -> str:
        return "".join(line for _, line in self.lines)


def _checkpoint_steps(run_dir: Path) -> list[int]:
    steps = (p.name.removeprefix("checkpoint_") for p in run_dir.glob("checkpoint_0*") if (p / "train_state.json").exists())
    return sorted(int(step) for step in steps if step.isdigit())  # not a resize's "<step>.universal" conversion


@pytest.mark.e2e
@pytest.mark.slow
def test_a_drained_node_yields_a_checkpoint_at_the_next_log_step_and_the_run_recovers(cluster, tmp_path):
    node_a = _add_node(cluster, num_cpus=1)
    cli = _Cli(
        tmp_path, cluster.address, "drained", "train.steps=120", "train.global_batch=4", "resources.num_workers=1",
        "checkpoint.every_steps=0",  # no step-based saves: a checkpoint before the end comes from the notice
        drills=("slow_step=0.1",),
    )
    try:
        cli.wait_for(r"step\s+6/120", timeout_s=240)
        _add_node(cluster, num_cpus=1)  # where the run goes once node A is gone
        deadline_s = 8  # shorter than the rest of the run (>= 114 steps of >= 0.1 s): the restart comes first
        drained_at = time.monotonic()
        subprocess.run(
            [RAY, "drain-node", "--address", cluster.address, "--node-id", node_a.node_id,
             "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot reclaim (test)",
             "--deadline-remaining-seconds", str(deadline_s)],
            check=True, capture_output=True, text=True, timeout=60,
        )
        saved_at, notice = cli.wait_for(
            r"Preemption notice .*checkpoint at step (\d+) complete ([\d.]+) s after the notice, (-?\d+) s before", timeout_s=60
        )
        step = int(notice[1])
        print(f"drain-node -> checkpoint complete: {saved_at - drained_at:.1f} s (the loop's own count from the log "
              f"step that saw it: {notice[2]} s; {notice[3]} s left before the node's deadline)")
        assert step % 2 == 0 and step < 120  # a log step, before the end
        assert saved_at - drained_at < deadline_s and int(notice[3]) >= 0  # in storage before the node goes
        resumed_at, _ = cli.wait_for(rf"Resumed from checkpoint at step {step}\b", timeout_s=120)
        print(f"deadline -> resumed on the other node: {resumed_at - drained_at - deadline_s:.1f} s")
        assert cli.finish(timeout_s=240) == 0, cli.output  # max_failures=0: the restart was charged to preemptions
    finally:
        cli.stop()
    assert re.search(r"step\s+120/120", cli.output)
    assert _checkpoint_steps(tmp_path / "runs" / "drained")[-1] == 120


_WHERE_COORDINATORS_LIVE = r"""
import ray
from ray._private.state import actors
from raytrain_fast.coordinator import Coordinator

ray.init()
handles = [Coordinator.start(f"placement-{i}") for i in range(8)]
[h.measurements() for h in handles]
print("driver", ray.get_runtime_context().get_node_id())
for actor in actors().values():
    if actor["ActorClassName"] == "_CoordinatorActor" and actor["State"] == "ALIVE":
        print("coordinator", actor["Address"]["NodeID"])
"""


@pytest.mark.e2e
def test_the_coordinator_lives_on_the_drivers_node_even_when_it_has_no_cpus(cluster):
    """A head started with --num-cpus=0 is the usual production layout. A soft pin spilled about one
    coordinator in four onto a worker node, and the run then died with that node (an elastic shrink
    ended in ActorDiedError). Eight coordinators: the soft pin would have kept all eight on the head
    about one time in ten."""
    _add_node(cluster, num_cpus=1)
    _add_node(cluster, num_cpus=1)
    found = subprocess.run([sys.executable, "-c", _WHERE_COORDINATORS_LIVE], capture_output=True, text=True, timeout=180,
                           env={**os.environ, "RAY_ADDRESS": cluster.address})
    assert found.returncode == 0, found.stderr[-2000:]
    lines = [line.split() for line in found.stdout.splitlines() if line.startswith(("driver ", "coordinator "))]
    driver = [node for kind, node in lines if kind == "driver"]
    placed = [node for kind, node in lines if kind == "coordinator"]
    assert len(driver) == 1 and len(placed) == 8, found.stdout
    assert driver[0] == cluster.head_node.node_id
    assert set(placed) == {driver[0]}


_WHICH_CLUSTER_THE_JOB_SEES = r"""
import ray
from raytrain_fast.launch.ray_address import ensure_ray

ensure_ray()

@ray.remote(num_cpus=0)
def resolved():  # what the state API in Ray Train's placement-group cleaner does: no address given
    from ray._private.services import canonicalize_bootstrap_address_or_die
    return canonicalize_bootstrap_address_or_die(None)

print("driver", ray.get_runtime_context().gcs_address)
print("job", ray.get(resolved.remote()))
"""


@pytest.mark.e2e
def test_every_process_of_the_job_resolves_the_cluster_the_run_joined_when_another_is_newer(cluster):
    """Two Ray instances on one machine: the run joins the first (RAY_ADDRESS); a second, started
    later, is the one /tmp/ray/ray_current_cluster names. A process of the job that looks a cluster up
    by itself (Ray Train's placement-group cleaner does, every second) must still find the first."""
    from ray.cluster_utils import Cluster

    _add_node(cluster, num_cpus=1)
    newer = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        found = subprocess.run([sys.executable, "-c", _WHICH_CLUSTER_THE_JOB_SEES], capture_output=True, text=True,
                               timeout=180, env={**os.environ, "RAY_ADDRESS": cluster.address})
    finally:
        newer.shutdown()
    assert found.returncode == 0, found.stderr[-2000:]
    seen = dict(line.split() for line in found.stdout.splitlines() if line.startswith(("driver ", "job ")))
    assert seen == {"driver": cluster.address, "job": cluster.address}, (seen, newer.address)


@pytest.mark.e2e
@pytest.mark.slow
def test_an_elastic_run_goes_on_with_one_worker_when_a_node_goes_and_grows_back(cluster, tmp_path):
    _add_node(cluster, num_cpus=1)
    node_b = _add_node(cluster, num_cpus=1)
    cli = _Cli(
        # 300 steps: after the shrink, one worker has >= 30 s of steps left. Growing back took 14 s from add_node
        # on a quiet 2-core machine; with 80 steps (8 s left) a loaded CI machine finished the run first.
        tmp_path, cluster.address, "elastic", "train.steps=300", "train.global_batch=8", "resources.num_workers=1-2",
        "resources.elastic_resize_interval_s=2", "resources.max_failures=2", "checkpoint.every_steps=10",
        drills=("slow_step=0.1",),
    )
    try:
        cli.wait_for(r"1-2 workers \(elastic\)", timeout_s=60)
        cli.wait_for(r"step\s+12/300", timeout_s=240)
        cluster.remove_node(node_b)  # its worker dies with it: the group restarts on what is left
        # A restart that cannot resume on the new count would stop here: fail at once, not after the retries.
        mismatch = r"was saved by \d+ workers, this run has \d+"
        at, shrunk = cli.wait_for(r"Resized at step (\d+): 2 -> 1 workers", timeout_s=150, fail_on=mismatch)
        assert int(shrunk[1]) >= 10
        # One worker trains on, past its own next checkpoint (every 10 steps), before the node comes back. Without
        # this wait a loaded machine grew back before the 1-worker group logged a step (CI of stop 27: both resizes
        # at step 10), which tests no "goes on with one worker" at all.
        saved_alone = (int(shrunk[1]) // 10 + 1) * 10
        cli.wait_for(r"step\s+(\d+)/300", timeout_s=150, after=at, accept=lambda m: int(m[1]) >= saved_alone + 2)
        _add_node(cluster, num_cpus=1)  # room for a second worker again: the monitor grows the run
        _, grown = cli.wait_for(r"Resized at step (\d+): 1 -> 2 workers", timeout_s=150, fail_on=mismatch)
        assert int(grown[1]) >= saved_alone, "the run grew back from the checkpoint the one worker saved"
        # Two workers train on from there: a logged step past the regrowth, then a stop notice. Running on to step
        # 300 showed nothing more (the drained-node test runs an elastic restart to its end).
        cli.wait_for(r"step\s+(\d+)/300", timeout_s=150, after=cli.lines[-1][0],
                     accept=lambda m: int(m[1]) >= int(grown[1]) + 2)
        cli.process.send_signal(signal.SIGTERM)
        assert cli.finish(timeout_s=240) == 128 + signal.SIGTERM, cli.output
    finally:
        cli.stop()
    assert "Stopped by SIGTERM" in cli.output
    run_dir = tmp_path / "runs" / "elastic"
    last = _checkpoint_steps(run_dir)[-1]
    assert last > int(grown[1]), "the stop saved where the two workers had got to"
    shards = list(run_dir.glob(f"checkpoint_{last:08d}/**/*zero_pp_rank_*optim_states.pt"))
    assert len(shards) == 2, f"both workers' optimizer shards in the last save: {shards}"
