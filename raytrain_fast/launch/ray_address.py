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

_canonicalize = canonicalize_bootstrap_address()  # None on a Ray without it: nothing is pinned


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


def ensure_ray(env_vars: dict[str, str] | None = None) -> None:
    """Join RAY_ADDRESS (a cluster, or the job's cluster under `ray job submit`), else start a local
    instance; nothing when Ray is already initialized in this process. `env_vars` reach every process
    of the job (Ray Train's controller too), and so does the joined cluster's address as RAY_ADDRESS."""
    import ray

    if not ray.is_initialized():
        workers_at_normal_priority()  # a local instance started here: training workers at niceness 0, not 15
        address = cluster_address()
        if address is not None:
            env_vars = {**(env_vars or {}), "RAY_ADDRESS": address}
        ray.init(address=address, log_to_driver=True, configure_logging=False,
                 runtime_env={"env_vars": env_vars} if env_vars else None)
