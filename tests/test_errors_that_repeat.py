"""An error that will repeat is not retried: a ConfigError or DataError raised in a training worker
(the same settings, the same files on every try) ends the run at once with its one-line message and
exit status 2, where a crash or a lost node goes to Ray Train's failure budget (tests/test_train.py,
tests/test_elastic.py keep those retried). From a shell: tests/test_workflows_from_a_shell.py."""

from __future__ import annotations

import pytest

from raytrain_fast.errors import CheckpointError, ConfigError, DataError, StorageError, repeating_error

pytestmark = pytest.mark.unit


def _worker_group_error(failures: dict[int, Exception]):
    from ray.train import WorkerGroupError

    return WorkerGroupError("rank errors", worker_failures=failures)


def test_the_error_behind_a_worker_group_failure_is_found_lowest_rank_first():
    data, config = DataError("shard gone"), ConfigError("eval.enabled=true needs a split")
    assert repeating_error(_worker_group_error({1: RuntimeError("collective aborted"), 2: config, 0: data})) is data
    assert repeating_error(_worker_group_error({0: RuntimeError("crash"), 1: StorageError("unreachable")})) is None
    wrapped = RuntimeError("a Ray task failed")
    wrapped.cause = data  # how a Ray task error carries its cause
    assert repeating_error(wrapped) is data
    try:
        try:
            raise data
        except DataError as error:
            raise CheckpointError("while restoring") from error
    except CheckpointError as error:
        assert repeating_error(error) is data


def test_the_failure_policy_raises_on_an_error_that_will_repeat_and_retries_a_crash():
    from ray.train import FailureConfig
    from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

    from raytrain_fast._ray_compat import stop_retrying_on
    from raytrain_fast.launch.trainer import will_repeat

    policy = stop_retrying_on({"failure_policy": DefaultFailurePolicy(FailureConfig(max_failures=3))}, will_repeat)["failure_policy"]
    assert policy.make_decision(_worker_group_error({0: DataError("shard gone")})) == FailureDecision.RAISE
    assert policy.make_decision(_worker_group_error({0: RuntimeError("segfault")})) == FailureDecision.RETRY
