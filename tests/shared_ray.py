"""The suite's one shared local Ray instance, and a way to set it aside while a test runs a cluster of
its own (`ray.cluster_utils.Cluster`, `ray start`).

Why set it aside: a process that holds two Ray instances is not what a user runs, and Ray resolves a
cluster by "the latest one on this machine" in places we do not control (the state API inside
Ray Train's placement-group cleaner, `ray.init(address="auto")`). The elastic grow-back test failed
only in full runs, where the shared instance was up beside its cluster. While a cluster
test runs, this process holds no other instance and none of the environment `ray.init` left behind.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

_ENV_SET_BY_RAY_INIT: dict[str, str] = {}
_SHARED_INSTANCE_ENV = {
    # Ray ends a task's idle worker process after 1 s, so each run on this instance started Ray Data's
    # read tasks in new processes (each importing ray.data again). Kept for 10 minutes, the next run
    # reuses them: a 10-step run 16.5 s instead of 18.9 s, 27 instead of 32 CPU seconds (2-core VM).
    "RAY_idle_worker_killing_time_threshold_ms": "600000",
    # Ray Train's preemption watcher is an actor process per run (Ray imported, then idle, polling every
    # 5 s for a drained node). No node of this one-node instance is ever drained: the drills that
    # drain one (tests/test_elastic.py) run on a cluster of their own, with the watcher on.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}
"""Read by the raylet that ray.init starts, and by the processes it starts: this instance only, not
the tests' own clusters nor the CLI's instances."""


def start_shared_ray() -> None:
    """A new local instance with 2 CPUs. address="local": never a cluster that RAY_ADDRESS or
    /tmp/ray/ray_current_cluster (written by `ray start` and ray.cluster_utils) happens to name."""
    import ray

    # What an earlier start left (RAY_AUTH_MODE=token) goes first, so that ray.init sets it again by its
    # own path, which also refreshes the auth mode Ray caches in-process. Left in place, the variable
    # says "token" while the cache can say "disabled" (a driver that connected to a test's own cluster
    # re-read the environment without it): the new GCS then wants a token the driver never sends
    # ("InvalidAuthToken", the CI failure of stop 26).
    for key, value in _ENV_SET_BY_RAY_INIT.items():
        if os.environ.get(key) == value:
            del os.environ[key]
    before = dict(os.environ)
    for key, value in _SHARED_INSTANCE_ENV.items():
        os.environ.setdefault(key, value)
    try:
        ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, log_to_driver=True)
    finally:
        for key in _SHARED_INSTANCE_ENV:
            if before.get(key) is None:
                os.environ.pop(key, None)
    _ENV_SET_BY_RAY_INIT.update({k: v for k, v in os.environ.items() if before.get(k) != v})


def shared_ray_back() -> None:
    """The shared instance up again if a test before set it aside (`without_shared_ray` in a test
    that held none, or a test's own cluster shut down)."""
    import ray

    if not ray.is_initialized():
        start_shared_ray()


@contextlib.contextmanager
def without_shared_ray() -> Iterator[None]:
    """Shut the shared instance down (if this process holds it) and take back the environment
    variables `ray.init` set (RAY_AUTH_MODE, say), so that a cluster the test starts sees this process
    as a fresh one would be; start the shared instance again afterwards."""
    import ray

    held = ray.is_initialized()
    if held:
        ray.shutdown()
    taken = {key: os.environ.pop(key) for key in list(_ENV_SET_BY_RAY_INIT) if key in os.environ}
    try:
        yield
    finally:
        if ray.is_initialized():  # the test's own driver connection
            ray.shutdown()
        if held:
            start_shared_ray()  # sets what it took again, by ray.init's own path
        else:
            os.environ.update(taken)
