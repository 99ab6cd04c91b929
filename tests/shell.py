"""The CLI as a user types it: a fresh bash with a clean environment (PATH with this venv's `bin`
first, HOME, a UTF-8 locale, the machine's torch extensions cache; nothing of pytest's: no
DS_ACCELERATOR, no Ray settings, no shared Ray instance), in a directory of the test's choosing.
tests/test_fresh_shell.py runs every documented command shape this way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

MICRO = [
    "model.d_model=32", "model.num_heads=2", "model.num_layers=2", "model.max_seq_len=32", "data.seq_len=32",
    "train.micro_batch=4", "train.global_batch=4", "train.steps=4", "train.log_every=2", "optim.warmup_steps=1",
    "checkpoint.every_steps=2", "resources.num_workers=1", "engine.precision=fp32", "metrics.peak_measure_s=0.2",
    "eval.sequences=4",
]
"""A model and run small enough for seconds of training."""
SETS = " ".join(f"--set {item}" for item in MICRO)


def fresh_env(home: Path) -> dict[str, str]:
    """The environment of a new login shell: this venv's `bin` on PATH, its own HOME, and the machine's
    torch extensions cache. DeepSpeed's CPU backend JIT-compiles its shared-memory op for a process
    group of two ranks once per machine and user (~60 s of CPU on 2 cores); under a new HOME per test
    every such command would compile it again. The cache is the one the suite's own processes use."""
    from torch.utils.cpp_extension import get_default_build_root

    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
        "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root(),
    }


def shell(line: str, *, cwd: Path, home: Path, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`line` typed into a fresh bash in `cwd` (with `env` added to its environment); stdout and
    stderr collected apart."""
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", line], cwd=cwd, env={**fresh_env(home), **(env or {})}, text=True,
        capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def package_texts(directory: Path, *packages: str) -> None:
    """Real text to train on: the sources of these standard-library packages, one file each."""
    import importlib

    directory.mkdir(parents=True)
    for name in packages:
        package = importlib.import_module(name)
        for path in sorted(Path(package.__file__).parent.glob("*.py")):
            (directory / f"{name}-{path.name}.txt").write_text(path.read_text())


WITHOUT_MODULES = """
import os, sys

_BLOCKED = set(filter(None, os.environ.get("WITHOUT_MODULES", "").split(",")))


class _NotInstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NotInstalled())
"""


def without_modules(folder: Path, *names: str) -> dict[str, str]:
    """The environment of an install that lacks the packages `names` (an optional extra not
    installed): a sitecustomize on PYTHONPATH makes their import fail as a missing package's does."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(WITHOUT_MODULES)
    return {"PYTHONPATH": str(folder), "WITHOUT_MODULES": ",".join(names)}
