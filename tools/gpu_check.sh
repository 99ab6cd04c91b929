#!/usr/bin/env bash
# The GPU check on a node without internet access: install the offline wheelhouse (.wheelhouse/, built
# by tools/offline_wheels.py) into a private directory, then run every stage of tools/gpu_check.py.
#   tools/gpu_check.sh OUTDIR [gpu_check.py options, e.g. --only pretrain,bench_model]
# OUTDIR gets summary.json (updated after each stage) and one log per stage.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUTDIR [--size gpu|cpu] [--only STAGE,...]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
site=${GPU_CHECK_SITE:-/tmp/raytrain-fast-site}
ls .wheelhouse/*.whl >/dev/null 2>&1 || { echo "error: no wheels in .wheelhouse/: run tools/offline_wheels.py first" >&2; exit 2; }
start=$(date +%s)
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .wheelhouse/*.whl \
  >"$out/install.log" 2>&1 || { echo "error: installing the wheelhouse failed: see $out/install.log" >&2; tail -5 "$out/install.log" >&2; exit 1; }
echo "[gpu_check] installed the wheelhouse into $site in $(( $(date +%s) - start )) s"
# The tree's own raytrain_fast goes first: the check tests this checkout, whatever wheel of it the
# wheelhouse holds (that one is for installing on nodes).
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
exec "$python" tools/gpu_check.py "$out" "$@"
