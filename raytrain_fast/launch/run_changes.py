"""What a resume may not change silently: the settings that define the token stream (data), the
tokenizer and the model. Compared between the checkpoint's saved run config (`config.yaml`, as
redacted when it was written) and this command's config, before any worker starts.

Optimizer settings are never refused: a resumed run trains with this command's optim.* from the
resumed step on (engine/deepspeed_engine.py's `apply_optim_settings`, after the checkpoint load),
and `optim_changes` names each one that differs in one printed line.
To extend: add a group to `GROUPS`, or a key to one.
"""

from __future__ import annotations

import os
from typing import Any

from raytrain_fast.config.checkpoint import CHANGE_GROUPS, allowed_groups

GROUPS: dict[str, tuple[str, ...]] = {
    "data": (
        "data.source", "data.sources", "data.seq_len", "data.max_tokens", "data.shuffle_seed", "data.val_fraction", "data.val_input",
    ),
    "tokenizer": ("data.tokenizer",),
    "model": ("model.*",),
}
"""checkpoint.allow_changes names -> the config keys they cover ("section.*": every key of it)."""
assert tuple(GROUPS) == CHANGE_GROUPS  # one list of names: validation reads it without this module

NOT_COMPARED = {"model.activation_checkpointing", "model.activation_checkpointing_n", "model.chunked_loss"}
"""How the model is computed, not what it is: free to change on a resume."""


def _keys(group: str, saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    keys = []
    for pattern in GROUPS[group]:
        if pattern.endswith(".*"):
            section = pattern[:-2]
            names = dict.fromkeys([*(saved.get(section) or {}), *(current.get(section) or {})])
            keys += [f"{section}.{name}" for name in names if f"{section}.{name}" not in NOT_COMPARED]
        else:
            keys.append(pattern)
    return keys


PATH_KEYS = ("data.source", "data.val_input", "data.tokenizer")
"""Compared as the files they name: a saved run config may hold a path as it was typed (relative)."""


def _normal(key: str, value: Any) -> Any:
    """`value` as compared: a local path absolute, data.sources' paths too."""
    if key in PATH_KEYS and isinstance(value, str) and "://" not in value:
        return os.path.abspath(os.path.expanduser(value))
    if key == "data.sources" and isinstance(value, list):
        return [{**item, "source": _normal("data.source", item.get("source"))} if isinstance(item, dict) else item for item in value]
    return value


def _same(key: str, old: Any, new: Any) -> bool:
    return old == new or _normal(key, old) == _normal(key, new)


def _shown(key: str, value: Any) -> str:
    """data.sources as `name weight, ...`; anything else as its repr."""
    if key == "data.sources" and isinstance(value, list) and all(isinstance(item, dict) for item in value):
        from raytrain_fast.config.data import SourceConfig, source_name

        return ", ".join(f"{source_name(SourceConfig(source=str(i.get('source', '')), name=i.get('name')))} {i.get('weight', 1.0):g}"
                         for i in value) or "[]"
    return repr(value)


def run_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, list[tuple[str, Any, Any]]]:
    """{group: [(key, saved value, this command's value), ...]} for every group with a difference.
    A key the saved config lacks (written by an older version) counts as unchanged."""
    changes: dict[str, list[tuple[str, Any, Any]]] = {}
    for group in GROUPS:
        for key in _keys(group, saved, current):
            section, _, name = key.partition(".")
            if name not in (saved.get(section) or {}):
                continue
            old, new = saved[section][name], (current.get(section) or {}).get(name)
            if not _same(key, old, new):
                changes.setdefault(group, []).append((key, old, new))
    return changes


def optim_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """[(key, saved value, this command's value), ...] for every optim.* setting that differs. A key
    the saved config lacks had its default then (the schedule was cosine before there was a choice)."""
    from dataclasses import asdict

    from raytrain_fast.config.engine import OptimConfig

    defaults = asdict(OptimConfig())
    old_section, new_section = saved.get("optim") or {}, current.get("optim") or {}
    changes = []
    for name in dict.fromkeys([*defaults, *old_section, *new_section]):
        old, new = old_section.get(name, defaults.get(name)), new_section.get(name, defaults.get(name))
        if old != new:
            changes.append((f"optim.{name}", old, new))
    return changes


def describe(changes: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{key}: {_shown(key, old)} -> {_shown(key, new)}" for key, old, new in changes)


def check_run_unchanged(saved: dict[str, Any], current: dict[str, Any], *, allow_changes: str, name: str, step: int,
                        checkpoint: str) -> list[str]:
    """Raises CheckpointError listing every refused difference (old -> new) and the ways on.
    Returns the lines to print for the differences allowed by checkpoint.allow_changes, and one for
    the optim.* settings that differ (they take effect, see `optim_changes`)."""
    from raytrain_fast.errors import CheckpointError

    changes = run_changes(saved, current)
    allowed, _ = allowed_groups(allow_changes)
    refused = {group: items for group, items in changes.items() if group not in allowed}
    if refused:
        listed = "; ".join(describe(items) for items in refused.values())
        raise CheckpointError(
            f"run '{name}' was checkpointed at step {step} with other {' and '.join(refused)} settings than this "
            f"command's ({listed}): resuming would mix both into one run's metrics. Start a new run "
            f"with another --name (its weights: --set checkpoint.init_from={checkpoint}), put the old values back, "
            f"or resume anyway with --set checkpoint.allow_changes={','.join(refused)}"
        )
    lines = [
        f"Resuming with changed {group} settings (checkpoint.allow_changes): {describe(items)}"
        for group, items in changes.items()
    ]
    if any(key == "data.sources" for key, _, _ in changes.get("data", [])):
        lines.append(f"The mixture changes at step {step}: from there each source goes on from the sequences it has given "
                     "(`raytrain-fast report` shows the shares before and after)")
    optim = optim_changes(saved, current)
    steps = (current.get("train") or {}).get("steps")
    if optim and not (isinstance(steps, int) and step >= steps):  # a finished run trains no step with them
        lines.append(f"Resuming at step {step} with changed optimizer settings, in effect from this step on: {describe(optim)}")
    return lines
