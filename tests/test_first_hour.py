"""Rough edges a new user's first hour found (issue 33): every config problem in one message with
suggestions that themselves validate, a resume that would silently change the run refused, a
validation split `pretrain` can ask for, and the checkpoint saved / resume-from-step lines."""

from __future__ import annotations

import re

import pytest

from raytrain_fast.config import load_config, presets, validate
from raytrain_fast.errors import ConfigError


def _problems(config_name: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        validate(load_config(config_name, overrides))
    return str(caught.value)


@pytest.mark.parametrize("preset", sorted(presets()))
@pytest.mark.parametrize("workers", ["4-1", "1-4", "3-x"])
def test_a_worker_count_suggestion_validates_for_the_config_at_hand(preset, workers):
    try:
        validate(load_config(preset, [f"resources.num_workers={workers}"]))
        return  # nothing to suggest
    except ConfigError as error:
        message = str(error)
    suggestions = re.findall(r"e\.g\. ((?:--set [\w.=-]+ ?)+)", message)
    assert suggestions, message
    for suggestion in suggestions:
        overrides = re.findall(r"--set ([\w.=-]+)", suggestion)
        validate(load_config(preset, [f"resources.num_workers={workers}", *overrides]))  # raises if it does not fit


def test_elastic_and_batch_problems_come_in_one_message():
    message = _problems("tiny", ["resources.num_workers=1-4"])
    assert "(2 problems)" in message
    assert "16 x 4 = 64" in message and "cannot be kept on 3 worker(s)" in message
