#!/usr/bin/env bash
# Rehearse the GPU node's offline install and check here, on the CPU, before a GPU node sees them:
# a fresh python3.12 venv holding torch and only the GPU image's other packages
# (tools/gpu_image_packages.txt, installed without their dependencies), then tools/gpu_check.sh at
# CPU sizes, which installs .wheelhouse/ with --no-index --no-deps --target exactly as on the node.
#   tools/rehearse_gpu_kit.sh [OUTDIR]     (default /tmp/raytrain-fast-rehearsal-out)
# REHEARSAL_VENV=DIR reuses a venv made by an earlier rehearsal (the install takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp/raytrain-fast-rehearsal-out}
shift $(( $# > 0 ? 1 : 0 ))
py=${PYTHON312:-}
if [ -z "$py" ]; then
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$candidate" --version >/dev/null 2>&1; then py=$candidate; break; fi
  done
fi
[ -n "$py" ] || { echo "error: no python3.12 found: install one (pyenv install 3.12) or set PYTHON312" >&2; exit 2; }
venv=${REHEARSAL_VENV:-}
if [ -z "$venv" ] || [ ! -x "$venv/bin/python" ]; then
  venv=${venv:-/tmp/raytrain-fast-rehearsal-venv}
  rm -rf "$venv"
  "$py" -m venv "$venv"
  echo "[rehearsal] torch 2.13.0 and the GPU image's packages into $venv ..."
  # PyPI's cp312 torch is the CUDA build: it runs on the CPU too, and no CPU wheel of it is at hand here.
  "$venv/bin/python" -m pip install -q torch==2.13.0
  grep -v '^#' tools/gpu_image_packages.txt | "$venv/bin/python" -m pip install -q --no-deps -r /dev/stdin
fi
rm -rf "$out" /tmp/raytrain-fast-rehearsal-site
echo "[rehearsal] tools/gpu_check.sh $out --size cpu, with $venv/bin/python"
PYTHON="$venv/bin/python" GPU_CHECK_SITE=/tmp/raytrain-fast-rehearsal-site GPU_CHECK_WORK=/tmp/raytrain-fast-rehearsal-work \
  tools/gpu_check.sh "$out" --size cpu "$@"
