#!/usr/bin/env python3
"""Build an offline wheelhouse for a GPU node without internet access (an air-gapped cluster, or a
machine that reaches no package index), for CPython 3.12 on manylinux x86_64.

    tools/offline_wheels.py [--out .wheelhouse] [--s3] [--python .venv/bin/python]

It holds what such a node's CUDA image usually lacks (torch, pyarrow, pandas, aiohttp, grpcio,
protobuf, msgpack, tokenizers and transformers are expected there): this package, DeepSpeed built
as a wheel, Ray pruned and stripped into a valid wheel, pydantic, jsonschema, py-spy (the hang
watchdog's stacks), torchao (engine.precision: fp8), and with --s3 boto3 for S3 storage. The
versions are the ones installed in the project's virtual environment (--python), so the node runs
what the test suite ran.

On the node: `python3 -m pip install --no-index --no-deps --target /tmp/site .wheelhouse/*.whl`
and `export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH` (tools/gpu_check.sh does this).
The last line printed is the wheelhouse's size together with the source tree's.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (17, 24, 27, 28, 31, 34, 35)] + ["manylinux2014_x86_64", "manylinux1_x86_64"]

PACKAGES = [
    "deepspeed", "hjson",  # deepspeed and what it needs beyond the image's torch, numpy, psutil, pydantic...
    "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",  # ray's
    "py-spy",  # the hang watchdog's stacks of a stuck rank
    "torchao",  # engine.precision: fp8 (float8 training); one abi3 wheel for every CPython
    "aiohttp-cors", "colorful", "opencensus", "opencensus-context", "smart-open",  # ray[default]'s dashboard
]
S3_PACKAGES = ["boto3", "botocore", "s3transfer", "jmespath"]

RAY_PRUNED = ["ray/jars", "ray/rllib", "ray/serve", "ray/llm", "ray/dashboard/client/build"]
"""Parts of the Ray wheel a training run never imports: Java, RLlib, Serve, Ray's LLM library and
the dashboard's web client (the dashboard's server, which the State API needs, stays)."""
RAY_STRIPPED = ["ray/_raylet.so", "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet"]
"""Native binaries shipped with their symbol tables; `strip --strip-unneeded` keeps them working."""


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def installed_versions(python: str, names: list[str]) -> dict[str, str]:
    """The versions of `names` installed for `python` (the tested ones)."""
    code = (
        "import json, sys\nfrom importlib.metadata import version, PackageNotFoundError\n"
        "out = {}\nfor n in sys.argv[1:]:\n    try: out[n] = version(n)\n    except PackageNotFoundError: pass\n"
        "print(json.dumps(out))"
    )
    found = json.loads(subprocess.run([python, "-c", code, *names], check=True, capture_output=True, text=True).stdout)
    missing = [n for n in names if n not in found]
    if missing:
        sys.exit(f"error: {', '.join(missing)} not installed for {python}: install the project first "
                 "(the README's test command), or pass --python a venv's python that has them")
    return found


def download(python: str, pins: list[str], dest: Path) -> None:
    """cp312 manylinux wheels of exactly these pins, without their dependencies."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run(
        [python, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platforms, "--dest", str(dest), *pins],
        check=True,
    )


def build_wheel(python: str, source: str, dest: Path, env: dict[str, str] | None = None) -> None:
    """A wheel of a source tree or sdist, built with the venv's own setuptools and torch."""
    subprocess.run(
        [python, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dest), source],
        check=True, env={**os.environ, **(env or {})},
    )


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def prune_ray(wheel: Path) -> Path:
    """Rewrite the Ray wheel without RAY_PRUNED, with RAY_STRIPPED stripped and a new RECORD: a valid
    wheel (pip checks nothing else), every file keeping its permissions."""
    if shutil.which("strip") is None:
        sys.exit("error: `strip` not found: install binutils (apt-get install binutils)")
    pruned = wheel.with_suffix(".pruned")
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(wheel) as source, \
            zipfile.ZipFile(pruned, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as target:
        record_name = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
        records = []
        for info in source.infolist():
            name = info.filename
            if name == record_name or any(name == p or name.startswith(p + "/") for p in RAY_PRUNED):
                continue
            data = source.read(info)
            if name in RAY_STRIPPED:
                path = Path(tmp, Path(name).name)
                path.write_bytes(data)
                subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
                data = path.read_bytes()
            target.writestr(info, data)  # the ZipInfo keeps the file's mode (executables stay executable)
            records.append(_record_line(name, data))
        records.append(f"{record_name},,")
        target.writestr(source.getinfo(record_name), "\n".join(records) + "\n")
    pruned.replace(wheel)
    return wheel


def build(out: Path, *, python: str, s3: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    names = ["ray", *PACKAGES, *(S3_PACKAGES if s3 else [])]
    versions = installed_versions(python, names)
    say(f"Versions from {python}: " + ", ".join(f"{n} {v}" for n, v in versions.items()))
    with tempfile.TemporaryDirectory() as tmp:
        say("Downloading cp312 manylinux wheels ...")
        download(python, [f"{n}=={versions[n]}" for n in names if n != "deepspeed"], out)
        say(f"Building deepspeed {versions['deepspeed']} as a wheel (no ops compiled: they JIT-build where needed) ...")
        subprocess.run([python, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary=:all:", "--dest", tmp,
                        f"deepspeed=={versions['deepspeed']}"], check=True)
        sdist = next(Path(tmp).glob("deepspeed-*"))
        build_wheel(python, str(sdist), out, env={"DS_BUILD_OPS": "0"})
    say("Building raytrain_fast as a wheel ...")
    build_wheel(python, str(ROOT), out)
    ray_wheel = next(out.glob("ray-*.whl"))
    before = ray_wheel.stat().st_size
    prune_ray(ray_wheel)
    say(f"Ray pruned and stripped: {before / 2**20:.1f} MiB -> {ray_wheel.stat().st_size / 2**20:.1f} MiB")
    report(out)


def tree_bytes() -> int:
    """Bytes of what a copy of the working tree carries: git's tracked and untracked-not-ignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.split(b"\0")
    return sum((ROOT / name.decode()).stat().st_size for name in listed if name and (ROOT / name.decode()).is_file())


def report(out: Path) -> None:
    wheels = sorted(out.glob("*.whl"), key=lambda p: -p.stat().st_size)
    for wheel in wheels:
        say(f"  {wheel.stat().st_size / 2**20:7.2f} MiB  {wheel.name}")
    wheel_bytes = sum(w.stat().st_size for w in wheels)
    source = tree_bytes()
    print(f"Wheelhouse {out}: {len(wheels)} wheels, {wheel_bytes / 2**20:.1f} MiB; with the source tree "
          f"({source / 2**20:.1f} MiB): {(wheel_bytes + source) / 2**20:.1f} MiB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / ".wheelhouse"), help="the wheelhouse directory (default: .wheelhouse, git-ignored)")
    parser.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"),
                        help="the project's venv's python: its installed versions are the ones fetched (default .venv/bin/python)")
    parser.add_argument("--s3", action="store_true", help="add boto3 and its dependencies (S3 storage; about 14 MiB more)")
    args = parser.parse_args()
    build(Path(args.out), python=args.python, s3=args.s3)


if __name__ == "__main__":
    main()
