"""Package attributes imported on first use (PEP 562), so light modules never pay for heavy ones."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` for `package`: name -> the module that defines it, or
    "module:attribute" where the module names it otherwise. The value is cached in the package's
    namespace, so the lookup runs once per name."""

    def __getattr__(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module '{package}' has no attribute '{name}'")
        module, _, attribute = target.partition(":")
        value = getattr(importlib.import_module(module), attribute or name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
