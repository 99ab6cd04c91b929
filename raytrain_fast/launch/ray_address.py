"""Which Ray cluster a run joins, pinned for every process of the job.

`ray.init()` with no address joins RAY_ADDRESS, else the latest `ray start` cluster recorded on this
machine, else starts a local instance. Processes that Ray starts for the job do not inherit that
choice: Ray Train's placement-group cleaner, for one, asks the state API for "the latest cluster"
every second. With two Ray instances on one machine (a test's simulated cluster beside the suite's
own, two users' runs on a shared box) that lookup can name the other one. Resolving the address once
here and handing it to the job's runtime environment as RAY_ADDRESS makes every such lookup name the
run's own cluster.
"""

from __future__ import annotations

import os

from raytrain_fast._ray_compat import canonicalize_bootstrap_address, workers_at_normal_priority

# Ray 2.60's resolver: RAY_ADDRESS, "auto", then the recorded cluster. Where it is missing (another
# Ray version), nothing is pinned and Ray resolves as before.
_canonicalize = canonicalize_bootstrap_address()


def cluster_address() -> str | None:
    """The GCS address (host:port) that `ray.init()` would join, or None where it would start a new
    local instance. A Ray Client address (ray://) is left to Ray: its processes live elsewhere."""
    address = os.environ.get("RAY_ADDRESS") or None
    if _canonicalize is None or (address is not None and "://" in address):
        return None
    try:
        return _canonicalize(address)
    except (ConnectionError, ValueError):  # nothing to join at "auto", or a malformed value: ray.init says which
        return None


def job_env(env_vars: dict[str, str] | None, address: str | None) -> dict[str, str] | None:
    """The job's runtime-environment variables, with RAY_ADDRESS pinned to the joined cluster."""
    if address is None:
        return env_vars or None
    return {**(env_vars or {}), "RAY_ADDRESS": address}


def ensure_ray(env_vars: dict[str, str] | None = None) -> None:
    """Join RAY_ADDRESS (a cluster, or the job's cluster under `ray job submit`), else start a local
    instance; nothing when Ray is already initialized in this process."""
    import ray

    if not ray.is_initialized():
        workers_at_normal_priority()  # a local instance started here: training workers at niceness 0, not 15
        # Joins RAY_ADDRESS (a cluster, or the job's cluster under `ray job submit`), else starts a
        # local instance. env_vars reach every process of the job (Ray Train's controller too), and
        # so does the joined cluster's address (see launch/ray_address.py).
        address = cluster_address()
        env_vars = job_env(env_vars, address)
        ray.init(address=address, log_to_driver=True, configure_logging=False,
                 runtime_env={"env_vars": env_vars} if env_vars else None)
