"""Strict conversion between plain dicts (YAML) and the typed config dataclasses.

Unknown keys and wrong types are collected as problems (never skipped silently), so one
`ConfigError` can list every mistake in a file at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints


def from_dict(cls: type, data: Any, *, path: str, problems: list[str]) -> Any:
    """Build dataclass `cls` from `data`, appending a message to `problems` for every error."""
    if not isinstance(data, dict):
        problems.append(f"{path or 'top level'}: expected a mapping, got {type(data).__name__}")
        return cls()
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in fields:
            known = ", ".join(sorted(fields))
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.7)
            hint = f"did you mean '{f'{path}.{close[0]}' if path else close[0]}'? " if close else ""
            problems.append(f"unknown key '{key_path}' ({hint}known keys here: {known})")
            continue
        kwargs[key] = coerce(hints[key], value, path=key_path, problems=problems)
    return cls(**kwargs)


_EXPECTED = {bool: "true or false", int: "an integer", str: "a string"}
"""The plain types checked as they are, and how a problem names them."""


def coerce(tp: Any, value: Any, *, path: str, problems: list[str]) -> Any:
    """Check `value` against the type annotation `tp`; convert where lossless (int -> float)."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path=path, problems=problems)
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            attempt: list[str] = []
            result = coerce(arg, value, path=path, problems=attempt)
            if not attempt:
                return result
        names = " or ".join(_type_name(a) for a in args)
        problems.append(f"{path}: expected {names}, got {value!r}")
        return None
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            problems.append(f"{path}: must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {value!r}")
            return value
        item_type = (get_args(tp) or (Any,))[0]
        items = [coerce(item_type, v, path=f"{path}[{i}]", problems=problems) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
        return value
    if tp is Any:
        return value
    if tp in _EXPECTED:
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            problems.append(f"{path}: expected {_EXPECTED[tp]}, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 6e-4 (no dot) as a string: accept it as a number
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {value!r}")
            return value
        return float(value)
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")  # internal: a new field type


def to_dict(obj: Any) -> Any:
    """Dataclass -> plain dict of builtins (tuples become lists), for YAML and Ray's config passing."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def field_docs(cls: type) -> dict[str, str]:
    """Field docstrings (the string literal under each field), for the config reference."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return " or ".join(map(repr, get_args(tp)))
    return getattr(tp, "__name__", str(tp))
