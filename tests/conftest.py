"""Shared fixtures: one real local Ray instance and one loopback S3 server per test session."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.s3_server import S3Server
from tests.shared_ray import shared_ray_back, start_shared_ray

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # faster reports in tests
# Ray starts worker processes at niceness 15: on 2 cores, pytest itself, the S3 server or a test's
# driver would win the CPU from the training workers and swing every timing a test reads.
os.environ.setdefault("RAY_worker_niceness", "0")
# The measured matmul peak is cached per user (metrics/peak.py): the suite keeps its own, removed at
# the end, so it neither reads a figure from the user's runs nor leaves one in their home.
_CACHE_DIR = tempfile.mkdtemp(prefix="raytrain-fast-test-cache-")
os.environ.setdefault("RAYTRAIN_FAST_CACHE_DIR", _CACHE_DIR)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


COST_MARKS = ("unit", "ray", "e2e")


def one_cost_mark_each(items) -> None:
    """Leave each test exactly one cost mark, the one closest to it: a file marked `unit` can hold one
    `ray` test, and `pytest -m unit` skips that test (pytest would otherwise see both marks on it)."""
    closest = {item: next((m.name for m in item.iter_markers() if m.name in COST_MARKS), None) for item in items}
    for item, name in closest.items():
        if name is not None and not any(m.name == name for m in item.own_markers):
            item.add_marker(name)
    for item in items:
        for node in item.listchain()[:-1]:  # the file's and the class's marks now sit on their tests
            node.own_markers[:] = [m for m in node.own_markers if m.name not in COST_MARKS]
        item.own_markers[:] = [m for m in item.own_markers if m.name not in COST_MARKS or m.name == closest[item]]


def quiet_last(items: list[pytest.Item]) -> set[pytest.Item]:
    """The tests to run after the rest: those marked `quiet`, which judge a clean run on the machine's
    own quiet (so no process the suite started a moment ago may still take a CPU), and the tests of
    their file that use the same module-scoped fixture (the run they judge). Moved apart, that run
    would be made twice: once for its file's other tests, once more for the quiet ones at the end."""
    quiet = [item for item in items if "quiet" in item.keywords]

    def module_fixtures(item: pytest.Item) -> set[tuple[str, str]]:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            return set()
        file = item.nodeid.split("::")[0]
        return {(file, name) for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope in ("module", "class")}

    shared = set().union(*(module_fixtures(item) for item in quiet))
    return set(quiet) | {item for item in items if module_fixtures(item) & shared}


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` selection reads the marks
def pytest_collection_modifyitems(config, items):
    one_cost_mark_each(items)
    items.sort(key=quiet_last(items).__contains__)  # stable: the rest keep their order
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def ray_session():
    """A real local Ray instance with 2 CPUs, shared by every test that needs one. A test that runs a
    cluster of its own sets it aside meanwhile (tests/shared_ray.py); `_shared_ray_is_up` brings it back
    for the next test that asks for it."""
    import ray

    start_shared_ray()
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def micro_run_uninterrupted(ray_session, tmp_path_factory):
    """tests/test_train.py's micro run (2 workers, ZeRO-2 in bf16, 30 steps, eval and a checkpoint every
    10) trained once for the session, with `sequences`: what each rank trained on at each step. The
    clean baseline that test_train.py's resumes and test_health.py's planted divergence compare with."""
    from raytrain_fast.drills import LoopHooks, RecordSequences
    from raytrain_fast.launch.trainer import run
    from tests.test_train import micro_config, recorded_sequences

    shared_ray_back()
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    result = run(micro_config(tmp_path, "straight"), hooks=LoopHooks(RecordSequences(str(tmp_path))))
    result.sequences = recorded_sequences(tmp_path)
    return result


@pytest.fixture(autouse=True)
def _shared_ray_is_up(request):
    if "ray_session" in request.fixturenames:
        shared_ray_back()


@pytest.fixture(scope="module", autouse=True)
def _shared_ray_is_up_for_the_module(request):
    """A module fixture that trains on the shared instance (a file's one run) is made before any
    function fixture, `_shared_ray_is_up` included: when an earlier file set the instance aside (its
    own cluster), bring it back here, or the run would start a Ray instance of its own."""
    if any("ray_session" in item.fixturenames for item in request.session.items if item.module is request.module):
        request.getfixturevalue("ray_session")  # started once per session; back if set aside since
        shared_ray_back()


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """A head node started from a fresh shell for one test file, stopped after its last test
    (tests/shell.py's RayHead): its commands join it with `env=ray_head.env` (RAY_ADDRESS) instead of
    each starting a local Ray instance of its own."""
    from tests.shell import start_ray_head, stop_ray_head

    head = start_ray_head(tmp_path_factory.mktemp("head-home"))
    try:
        yield head
    finally:
        stop_ray_head(head)


@pytest.fixture
def aws_env(s3_server, monkeypatch, tmp_path):
    """The server's credentials in the environment, and no ~/.aws files, instance metadata or
    checksum mode left over from another test."""
    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_REQUEST_CHECKSUM_CALCULATION",
                "AWS_RESPONSE_CHECKSUM_VALIDATION"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return s3_server
