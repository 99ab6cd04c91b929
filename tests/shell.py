"""The CLI as a user types it: a fresh bash with a clean environment (PATH with this venv's `bin`
first, HOME, a UTF-8 locale, the machine's torch extensions cache; nothing of pytest's: no
DS_ACCELERATOR, no Ray settings, no shared Ray instance), in a directory of the test's choosing.
tests/test_fresh_shell.py runs every documented command shape this way."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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
    home.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8",
        "TORCH_EXTENSIONS_DIR": torch_extensions_dir(),
    }


def torch_extensions_dir() -> str:
    """Where torch builds JIT extensions for this process: TORCH_EXTENSIONS_DIR, else a folder per
    Python and accelerator under the user's cache (torch.utils.cpp_extension names it so only when the
    variable is unset: setting the variable to the cache itself would build everything again beside it)."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return os.environ["TORCH_EXTENSIONS_DIR"]
    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return os.path.join(get_default_build_root(), f"{python}_{accelerator}")


def shell(line: str, *, cwd: Path, home: Path, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`line` typed into a fresh bash in `cwd` (with `env` added to its environment); stdout and
    stderr collected apart."""
    return subprocess.run(
        ["bash", "--noprofile", "--norc", "-c", line], cwd=cwd, env={**fresh_env(home), **(env or {})}, text=True,
        capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


@dataclass
class RayHead:
    """A Ray head node started from a fresh shell, as docs/cluster.md starts one (`ray start --head --block`,
    `RAY_worker_niceness=0`), with 2 CPUs, a temp dir and ports of its own (other Ray instances share the
    machine). A command with `env` in its environment joins it (`RAY_ADDRESS`, which docs/configuration.md
    documents for `pretrain`) instead of starting a local instance of its own: the start-up of Ray's GCS,
    raylet and dashboard (about 16 s of a micro run on 2 cores, docs/test-time.md) is paid once for a
    file's commands. tests/test_fresh_shell.py keeps the commands that start their own."""

    env: dict[str, str]
    """What a shell that joins it adds to its environment."""
    temp_dir: str
    process: subprocess.Popen

    def processes(self) -> list[int]:
        """Live processes of this head node: those whose command line names its temp dir."""
        return processes_naming(self.temp_dir)


HEAD_PORTS = ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "metrics-export-port", "runtime-env-agent-port")
"""The `ray start --head` options that name a port: a test's head takes free ones for all of them, as
other Ray instances share the machine."""


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line contains `text` (a head node's temp dir names all of its own)."""
    alive = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    alive.append(int(entry.name))
            except OSError:
                continue
    return alive


def start_ray_head(home: Path, *, timeout: float = 180) -> RayHead:
    """`ray start --head --block` in a fresh shell (tests/shell.py's environment under `home`); returns
    once the head has written its address."""
    from tests.s3_server import free_port

    temp_dir = tempfile.mkdtemp(prefix="rtf-head-", dir="/tmp")  # short: Ray's Unix sockets live under it
    ports = " ".join(f"--{name} {free_port()}" for name in HEAD_PORTS)
    line = f"exec ray start --head --block --num-cpus 2 --temp-dir {temp_dir}/ray --disable-usage-stats {ports}"
    # RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0: the head's processes end at once on SIGTERM (no other effect).
    env = {**fresh_env(home), "RAY_worker_niceness": "0", "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    if "PYTHONPATH" in os.environ:  # another source tree under test: its workers import what the drivers import
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    log = open(Path(temp_dir, "ray-head.log"), "w")
    process = subprocess.Popen(["bash", "--noprofile", "--norc", "-c", line], cwd=temp_dir, env=env, stdout=log,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    log.close()
    head = RayHead(env={}, temp_dir=temp_dir, process=process)
    address_file = Path(temp_dir, "ray", "ray_current_cluster")  # where `ray start` records its GCS address
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        text = Path(temp_dir, "ray-head.log").read_text()
        if "Ray runtime started" in text and address_file.is_file() and address_file.read_text().strip():
            head.env["RAY_ADDRESS"] = address_file.read_text().strip()
            return head
        time.sleep(0.5)
    output = Path(temp_dir, "ray-head.log").read_text()
    stop_ray_head(head)
    raise RuntimeError(f"`{line}` did not start a head node:\n{output[-3000:]}")


def stop_ray_head(head: RayHead) -> None:
    """docs/cluster.md's `kill` of the head's own process (never `ray stop`, which ends every Ray process on
    the machine, other people's included); then whatever of it is left, by its process group."""
    if head.process.poll() is None:
        head.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while head.processes() and time.monotonic() < deadline:
        time.sleep(0.5)
    try:
        os.killpg(head.process.pid, signal.SIGKILL)  # the group of the shell that started it: ours alone
    except ProcessLookupError:
        pass
    for pid in head.processes():  # one that left the group: its command line names this head's temp dir
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    head.process.wait(timeout=30)
    shutil.rmtree(head.temp_dir, ignore_errors=True)


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
