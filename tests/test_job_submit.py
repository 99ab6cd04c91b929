"""End to end, the cluster path of docs/cluster.md: a real local Ray cluster (`ray start --head`), the job
submitted with `ray job submit --working-dir . -- python jobs/pretrain.py ...`, checkpoints on the
loopback S3 server, credentials only in the runtime env. The first job is stopped with `ray job stop`
once a complete checkpoint is in the bucket; submitting the same command again resumes from the
newest complete checkpoint and finishes.

The cluster is this test's own: its own temp dir and ports, stopped by signalling the `ray start
--block` process it started (never `ray stop`, which kills every Ray process on the machine,
including the test session's `ray_session` and other people's). Nothing here touches the pytest
process's environment: every Ray command gets an explicit env.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.s3_server import free_port

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")
BUCKET = "job-submit"
STEPS, EVERY = 80, 10
# Detached singletons Ray itself keeps per cluster (Train's placement-group cleaner, Ray Data's stats
# and autoscaling coordinators): not state of the run.
RAY_DETACHED_HELPERS = {"PlacementGroupCleaner", "_AutoscalingCoordinatorActor", "_StatsActor"}



@dataclass
class LocalCluster:
    address: str
    """The job server (dashboard) URL, what `ray job submit --address` takes."""
    env: dict[str, str]
    temp_dir: str

    def ray(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return subprocess.run(
            [RAY, *args], cwd=REPO, env=self.env, capture_output=True, text=True, timeout=timeout,
        )

    def job(self, command: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        return self.ray("job", command, "--address", self.address, *args, timeout=timeout)


def _cluster_env() -> dict[str, str]:
    # No RAY_ADDRESS / RAY_* from this process (the session's in-process Ray must stay out of it) and
    # no AWS credentials: the job gets those from the runtime env, as docs/cluster.md says.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "AWS_"))}
    env.update(
        # `python` in the entrypoint is this virtualenv's, as on a node set up by cluster.yaml.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        # A loopback-only cluster: no token auth, whether or not ~/.ray/auth_token exists.
        RAY_AUTH_MODE="disabled",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # SIGTERM tears the node down at once
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.1",  # checkpoint reports return sooner (see conftest)
        RAY_worker_niceness="0",  # training workers at normal priority (see conftest)
        DS_ACCELERATOR="cpu",
    )
    return env


def _stop_head(head: subprocess.Popen) -> None:
    """SIGTERM to our `ray start --block`: it kills the node's processes; then SIGKILL whatever is left
    in its process group (all started by it)."""
    if head.poll() is None:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(head.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    head.wait()


@pytest.fixture(scope="module")
def cluster():
    # A short directory: Ray's Unix sockets live under it (paths are limited to ~107 bytes).
    temp_dir = tempfile.mkdtemp(prefix="rtf-job-", dir="/tmp")
    env = _cluster_env()
    ports = {
        name: free_port()
        for name in ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
                     "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")
    }
    log = open(os.path.join(temp_dir, "head.log"), "w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus", "2", "--include-dashboard", "true",
         "--dashboard-host", "127.0.0.1", "--temp-dir", os.path.join(temp_dir, "ray"), "--disable-usage-stats",
         *(arg for name, port in ports.items() for arg in (f"--{name}", str(port)))],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        address = f"http://127.0.0.1:{ports['dashboard-port']}"
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{address}/api/version", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break  # it answers (e.g. 401 under token auth)
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"ray start --head did not come up:\n{Path(temp_dir, 'head.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield LocalCluster(address=address, env=env, temp_dir=temp_dir)
    finally:
        _stop_head(head)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(cluster) -> str:
    """~1.5 MB of text (stdlib sources): quick to prepare, plenty for 80 steps of the tiny preset."""
    path = Path(cluster.temp_dir, "corpus.txt")
    with path.open("w") as out:
        for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
            out.write(source.read_text(encoding="utf-8", errors="replace"))
            if out.tell() > 1_500_000:
                break
    return str(path)


def complete_checkpoints(s3_server, run: str) -> list[int]:
    """Steps of the run's checkpoints whose manifest and every file it lists (with its size) are in
    the bucket, listed with boto3, independently of Ray and pyarrow. One worker: one manifest."""
    client = s3_server.client()
    sizes = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=f"runs/{run}/"):
        sizes.update({item["Key"]: item["Size"] for item in page.get("Contents", [])})
    steps = []
    for key in sizes:
        match = re.fullmatch(rf"runs/{run}/checkpoint_(\d+)/manifest\.rank0\.json", key)
        if not match:
            continue
        manifest = json.loads(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
        directory = key.rsplit("/", 1)[0]
        if all(sizes.get(f"{directory}/{f['path']}") == f["size"] for f in manifest["files"]):
            steps.append(int(match.group(1)))
    return sorted(steps)


def submit(cluster: LocalCluster, s3_server, corpus: str, *, name: str, submission_id: str, wait: bool):
    """The documented command, with the tiny preset shrunk to a test run and the loopback endpoint."""
    runtime_env = {"env_vars": {
        **s3_server.env,  # credentials: from this shell to the job, never into a file
        "RAY_JOB_STOP_WAIT_TIME_S": "120",  # `ray job stop` waits for the stop-notice checkpoint (docs/cluster.md)
    }}
    return cluster.job(
        "submit", "--submission-id", submission_id, *([] if wait else ["--no-wait"]),
        "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
        "python", "jobs/pretrain.py", "--config", "tiny", "--name", name,
        "--set", f"storage.uri=s3://{BUCKET}/runs", "--set", f"storage.endpoint_url={s3_server.endpoint_url}",
        "--set", f"data.source={corpus}", "--set", f"data.cache_dir={cluster.temp_dir}/prepared",
        "--set", f"train.steps={STEPS}", "--set", f"checkpoint.every_steps={EVERY}",
        "--set", "engine.precision=fp32", "--set", "metrics.peak_measure_s=0",
        timeout=300,
    )


def alive_actors(cluster: LocalCluster, job_id: str) -> list[dict]:
    listed = cluster.ray(
        "list", "actors", "--address", cluster.address, "--filter", "state=ALIVE", "--format", "json", "--limit", "1000",
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    return [a for a in json.loads(listed.stdout) if a.get("job_id") == job_id]


def job_id_of(cluster: LocalCluster, submission_id: str) -> str | None:
    """The Ray job id (hex) of a submission: the owner of the driver's actors."""
    listed = cluster.ray("list", "jobs", "--address", cluster.address, "--format", "json", "--limit", "1000", timeout=60)
    assert listed.returncode == 0, listed.stderr
    for job in json.loads(listed.stdout):
        if job.get("submission_id") == submission_id:
            return job.get("job_id")
    return None


def test_stopped_job_resumes_from_its_last_complete_checkpoint_when_submitted_again(cluster, s3_server, corpus):
    s3_server.make_bucket(BUCKET)
    started = time.monotonic()

    first = submit(cluster, s3_server, corpus, name="e2e", submission_id="e2e-first", wait=False)
    assert first.returncode == 0, first.stdout + first.stderr
    deadline = time.monotonic() + 240
    print(f"[{time.monotonic() - started:.0f}s] submitted", flush=True)
    polls = 0
    while not complete_checkpoints(s3_server, "e2e"):
        polls += 1
        if polls % 10 == 0:  # a `ray job status` costs seconds of CPU on a small machine: not every poll
            status = cluster.job("status", "e2e-first", timeout=60).stdout
            assert "failed" not in status and "succeeded" not in status, status + cluster.job("logs", "e2e-first").stdout
        assert time.monotonic() < deadline, "no complete checkpoint within 240 s"
        time.sleep(0.5)
    print(f"[{time.monotonic() - started:.0f}s] first complete checkpoint {complete_checkpoints(s3_server, 'e2e')}", flush=True)
    stopped = cluster.job("stop", "e2e-first", timeout=120)  # SIGTERM to the driver; waits until it exited
    assert "was stopped" in stopped.stdout + stopped.stderr, stopped.stdout + stopped.stderr
    first_log = cluster.job("logs", "e2e-first").stdout
    assert "Done. Run directory" not in first_log, "the job finished before it was stopped: nothing was tested"
    kept = complete_checkpoints(s3_server, "e2e")
    assert kept and max(kept) < STEPS, kept
    # The stop notice: the driver got SIGTERM, the workers saved at their next log step, then it exited.
    assert "SIGTERM: saving a checkpoint at the next log step" in first_log, first_log[-5000:]
    assert "Stopped by SIGTERM" in first_log, first_log[-5000:]
    latest = re.search(r"Latest checkpoint: \S*/runs/e2e/checkpoint_(\d+)", first_log)
    assert latest and int(latest.group(1)) == max(kept), (kept, first_log[-5000:])

    # The driver's actors (Train controller, workers, the run's coordinator) die with it: nothing of
    # the stopped run is left to collide with the next submission of the same name.
    print(f"[{time.monotonic() - started:.0f}s] stopped; complete checkpoints {kept}", flush=True)
    first_job = job_id_of(cluster, "e2e-first")
    assert first_job
    deadline = time.monotonic() + 30
    while run_actors := [a for a in alive_actors(cluster, first_job) if a["class_name"] not in RAY_DETACHED_HELPERS]:
        assert time.monotonic() < deadline, f"actors of the stopped run still alive: {run_actors}"
        time.sleep(1)
    print(f"[{time.monotonic() - started:.0f}s] resubmitting", flush=True)
    again = submit(cluster, s3_server, corpus, name="e2e", submission_id="e2e-again", wait=True)
    log = again.stdout + again.stderr
    assert again.returncode == 0 and "Job 'e2e-again' succeeded" in log, log[-5000:]
    assert f"Resumed from checkpoint at step {max(kept)} " in log, (kept, log[-5000:])
    assert f"step {STEPS}/{STEPS}" in log
    assert STEPS in complete_checkpoints(s3_server, "e2e")

    from raytrain_fast.metrics.sinks import read_metrics
    from raytrain_fast.storage import StorageConfig

    with pytest.MonkeyPatch.context() as patch:  # credentials for this read only
        for key, value in s3_server.env.items():
            patch.setenv(key, value)
        records = read_metrics(
            f"s3://{BUCKET}/runs/e2e", storage=StorageConfig(uri=f"s3://{BUCKET}/runs", endpoint_url=s3_server.endpoint_url)
        )
    # One loss curve across both jobs: every log step once, in order (tiny preset: log_every=10).
    assert [r["step"] for r in records if "train/loss" in r] == list(range(10, STEPS + 1, 10))
    leftover = sorted(a["class_name"] for a in alive_actors(cluster, first_job))
    print(f"[{time.monotonic() - started:.0f}s] done; Ray helpers of the stopped job still alive: {leftover}")
