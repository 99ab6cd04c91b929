"""End to end, the single-node job path of docs/cluster.md, its commands as printed there, in a
user's shell (a fresh bash with a clean environment and a HOME of its own: the user's `~/.ray` is
never touched): the token made or found, a real `ray start --head` with token authentication on, the
job submitted with `ray job submit --working-dir . -- python jobs/pretrain.py ...` (checkpoints on
the loopback S3 server, credentials only in the runtime env), stopped with `ray job stop` once a
complete checkpoint is in the bucket, submitted again and resumed at that checkpoint's step, and the
head node stopped with the page's `kill`.

Two machines: one where a local run came first (a token in `~/.ray/auth_token`, which any local
`ray.init()` writes: with the page's earlier commands `ray job submit` failed there with `Missing
authentication token`), and one where none did. The head nodes are this test's own (their own temp
dir and ports): only the page's `kill` of the head's own process stops them, never `ray stop`, which
ends every Ray process on the machine, other people's included.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
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
from tests.shell import HEAD_PORTS, processes_naming
from tests.test_cluster import commands, doc_section

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

REPO = Path(__file__).resolve().parent.parent
BUCKET = "job-submit"
STEPS, EVERY = 80, 10
DOC_ADDRESS = "http://127.0.0.1:8265"
# Detached singletons Ray itself keeps per cluster (Train's placement-group cleaner, Ray Data's stats
# and autoscaling coordinators): not state of the run.
RAY_DETACHED_HELPERS = {"PlacementGroupCleaner", "_AutoscalingCoordinatorActor", "_StatsActor"}


def documented() -> list[str]:
    """The single-node job commands of docs/cluster.md, from the token's line on: continuation lines
    joined, comments dropped, runs of spaces made one."""
    lines = [" ".join(line.split()) for line in commands(doc_section("docs/cluster.md", "Single GPU node"))]
    return lines[next(i for i, line in enumerate(lines) if line.startswith("ray get-auth-token")):]


def documented_line(start: str) -> str:
    [line] = [line for line in documented() if line.startswith(start)]
    return line


@dataclass
class Head:
    """A head node started by the page's commands in `workdir` (ray-head.log, ray-head.pid there)."""

    address: str
    """The job server URL, what `ray job ... --address` takes (the page's 8265, here a free port)."""
    env: dict[str, str]
    workdir: Path
    temp_dir: str
    group: int
    """The process group of the shell that started it: only this test's processes."""

    def shell(self, *lines: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        """`lines` typed into a fresh bash after the page's `export` line, with the page's address
        replaced by this head's."""
        script = "\n".join([documented_line("export RAY_AUTH_MODE"), *lines]).replace(DOC_ADDRESS, self.address)
        return subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=cwd or self.workdir, env=self.env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    def job(self, command: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        """`ray job <command>` as the page writes it (the address first), run from the repository root."""
        line = f"ray job {command} --address {DOC_ADDRESS} " + shlex.join(args)
        return self.shell(line, cwd=REPO, timeout=timeout)

    def processes(self) -> list[int]:
        """Live processes of this head node: those whose command line names its temp dir."""
        return processes_naming(self.temp_dir)


def user_env(home: Path) -> dict[str, str]:
    """A user's shell: the venv's bin on PATH (as on a node set up by cluster.yaml), a HOME, nothing of
    pytest's (no RAY_*, no AWS credentials: the job gets those from the runtime env)."""
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
        # A quicker test, no other effect: the head node's processes end at once on SIGTERM, and Ray
        # Train's controller polls its workers' checkpoint reports more often (see conftest).
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.1",
    }


def start_head(home: Path) -> Head:
    """The page's lines up to the first `ray job` command, in a working directory of their own, with
    this test's ports and temp dir added to `ray start --head` (other Ray instances share the machine)."""
    temp_dir = tempfile.mkdtemp(prefix="rtf-job-", dir="/tmp")  # short: Ray's Unix sockets live under it
    ports = {name: free_port() for name in HEAD_PORTS}
    ours = " ".join([f"--num-cpus 2 --temp-dir {temp_dir}/ray --disable-usage-stats",
                     *(f"--{name} {port}" for name, port in ports.items())])
    lines = documented()
    setup = lines[: next(i for i, line in enumerate(lines) if line.startswith("ray job"))]
    assert any("ray start --head --block" in line for line in setup), setup
    script = "\n".join(line.replace("ray start --head --block", f"ray start --head --block {ours}") for line in setup)
    workdir = Path(temp_dir, "shell")
    workdir.mkdir()
    env = user_env(home)
    shell = subprocess.Popen(["bash", "--noprofile", "--norc", "-c", script], cwd=workdir, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    head = Head(address=f"http://127.0.0.1:{ports['dashboard-port']}", env=env, workdir=workdir, temp_dir=temp_dir, group=shell.pid)
    try:
        output, _ = shell.communicate(timeout=180)  # the page's `until` line waits for the head
    except subprocess.TimeoutExpired:
        shell.kill()
        output = ""
    log = (workdir / "ray-head.log").read_text() if (workdir / "ray-head.log").exists() else ""
    if shell.returncode != 0 or "Ray runtime started" not in log:
        stop_head(head, checked=False)
        pytest.fail(f"the page's commands did not start a head node:\n{output}\n{log[-3000:]}")
    return head


def stop_head(head: Head, *, checked: bool = True) -> None:
    """The page's `kill` line; then (a failed test only) whatever of this head is left, by its group."""
    stopped = head.shell(documented_line("kill "))
    deadline = time.monotonic() + 60
    while head.processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = head.processes()
    try:
        os.killpg(head.group, signal.SIGKILL)  # the group of the shell that started the head: ours alone
    except ProcessLookupError:
        pass
    shutil.rmtree(head.temp_dir, ignore_errors=True)
    assert not checked or (stopped.returncode == 0 and not left), (stopped.stderr, left)


def auth_is_on(head: Head) -> bool:
    """A request without the token is refused."""
    try:
        urllib.request.urlopen(f"{head.address}/api/jobs/", timeout=10).close()
    except urllib.error.HTTPError as error:
        return error.code == 401
    return False


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """~1.5 MB of text (stdlib sources): quick to prepare, plenty for 80 steps of the tiny preset."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
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


def submit(head: Head, s3_server, corpus: str, *, name: str, submission_id: str, wait: bool) -> subprocess.CompletedProcess:
    """The page's `ray job submit` line with the tiny preset shrunk to a test run and the loopback endpoint."""
    documented_submit = documented_line("ray job submit")
    assert documented_submit.startswith(f"ray job submit --address {DOC_ADDRESS} --working-dir . -- python jobs/pretrain.py ")
    runtime_env = {"env_vars": {
        **s3_server.env,  # credentials: from this shell to the job, never into a file
        "RAY_JOB_STOP_WAIT_TIME_S": "120",  # `ray job stop` waits for the stop-notice checkpoint (docs/cluster.md)
    }}
    return head.job(
        "submit", "--submission-id", submission_id, *([] if wait else ["--no-wait"]),
        "--working-dir", ".", "--runtime-env-json", json.dumps(runtime_env), "--",
        "python", "jobs/pretrain.py", "--config", "tiny", "--name", name,
        "--set", f"storage.uri=s3://{BUCKET}/runs", "--set", f"storage.endpoint_url={s3_server.endpoint_url}",
        "--set", f"data.source={corpus}", "--set", f"data.cache_dir={head.temp_dir}/prepared",
        "--set", f"train.steps={STEPS}", "--set", f"checkpoint.every_steps={EVERY}",
        "--set", "engine.precision=fp32", "--set", "metrics.peak_measure_s=0",
    )


def alive_actors(head: Head, job_id: str) -> list[dict]:
    listed = head.shell(f"ray list actors --address {head.address} --filter state=ALIVE --format json --limit 1000", timeout=60)
    assert listed.returncode == 0, listed.stderr
    return [a for a in json.loads(listed.stdout) if a.get("job_id") == job_id]


def job_id_of(head: Head, submission_id: str) -> str | None:
    """The Ray job id (hex) of a submission: the owner of the driver's actors."""
    listed = head.shell(f"ray list jobs --address {head.address} --format json --limit 1000", timeout=60)
    assert listed.returncode == 0, listed.stderr
    return next((job.get("job_id") for job in json.loads(listed.stdout) if job.get("submission_id") == submission_id), None)


@pytest.fixture(scope="module")
def after_a_local_run(tmp_path_factory, s3_server, corpus):
    """The whole path on a machine where a local run came first: its token in ~/.ray/auth_token.
    Yields (the stopped job's log, the resubmitted job's output, the complete checkpoints when stopped)."""
    home = tmp_path_factory.mktemp("home-after-a-run")
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))  # what a local ray.init() writes there
    s3_server.make_bucket(BUCKET)
    head = start_head(home)
    try:
        assert auth_is_on(head)
        started = time.monotonic()
        first = submit(head, s3_server, corpus, name="e2e", submission_id="e2e-first", wait=False)
        assert first.returncode == 0, first.stdout + first.stderr
        deadline = time.monotonic() + 240
        polls = 0
        while not complete_checkpoints(s3_server, "e2e"):
            polls += 1
            if polls % 10 == 0:  # a `ray job status` costs seconds of CPU on a small machine: not every poll
                status = head.job("status", "e2e-first", timeout=60).stdout
                assert "failed" not in status and "succeeded" not in status, status + head.job("logs", "e2e-first").stdout
            assert time.monotonic() < deadline, "no complete checkpoint within 240 s"
            time.sleep(0.5)
        print(f"[{time.monotonic() - started:.0f}s] first complete checkpoint", flush=True)
        stopped = head.job("stop", "e2e-first", timeout=120)  # SIGTERM to the driver; waits until it exited
        assert "was stopped" in stopped.stdout + stopped.stderr, stopped.stdout + stopped.stderr
        first_log = head.job("logs", "e2e-first").stdout
        kept = complete_checkpoints(s3_server, "e2e")
        # The driver's actors (Train controller, workers, the run's coordinator) die with it: nothing of
        # the stopped run is left to collide with the next submission of the same name.
        first_job = job_id_of(head, "e2e-first")
        assert first_job
        deadline = time.monotonic() + 30
        while run_actors := [a for a in alive_actors(head, first_job) if a["class_name"] not in RAY_DETACHED_HELPERS]:
            assert time.monotonic() < deadline, f"actors of the stopped run still alive: {run_actors}"
            time.sleep(1)
        print(f"[{time.monotonic() - started:.0f}s] stopped at {kept}; resubmitting", flush=True)
        again = submit(head, s3_server, corpus, name="e2e", submission_id="e2e-again", wait=True)
        yield first_log, again.stdout + again.stderr, kept
    finally:
        stop_head(head)


def test_a_job_stopped_with_ray_job_stop_resumes_at_its_last_complete_checkpoint_when_submitted_again(after_a_local_run, s3_server):
    first_log, log, kept = after_a_local_run
    assert "Done. Run directory" not in first_log, "the job finished before it was stopped: nothing was tested"
    assert kept and max(kept) < STEPS, kept
    # The stop notice: the driver got SIGTERM, the workers saved at their next log step, then it exited.
    assert "SIGTERM: saving a checkpoint at the next log step" in first_log, first_log[-5000:]
    assert "Stopped by SIGTERM" in first_log, first_log[-5000:]
    latest = re.search(r"Latest checkpoint: \S*/runs/e2e/checkpoint_(\d+)", first_log)
    assert latest and int(latest.group(1)) == max(kept), (kept, first_log[-5000:])
    assert "Job 'e2e-again' succeeded" in log, log[-5000:]
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


def test_on_a_machine_with_no_token_yet_the_commands_make_one_and_keep_authentication_on(after_a_local_run, s3_server, corpus, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    head = start_head(home)
    try:
        assert (home / ".ray" / "auth_token").is_file() and auth_is_on(head)
        again = submit(head, s3_server, corpus, name="e2e", submission_id="e2e-done", wait=True)  # the finished run
        log = again.stdout + again.stderr
        assert again.returncode == 0 and "Job 'e2e-done' succeeded" in log, log[-5000:]
        assert f"Run 'e2e' already reached train.steps={STEPS}" in log, log[-5000:]
        logs = head.job("logs", "e2e-done")
        assert logs.returncode == 0 and "nothing to do" in logs.stdout, logs.stdout + logs.stderr
    finally:
        stop_head(head)
