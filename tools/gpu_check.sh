#!/usr/bin/env bash
# The GPU check on a node without internet access: install the offline wheelhouse (.wheelhouse/, built
# by tools/offline_wheels.py) into a private directory, then run every stage of tools/gpu_check.py.
#   tools/gpu_check.sh OUTDIR [gpu_check.py options, e.g. --only pretrain,engine]
# OUTDIR gets summary.json (updated after each stage), check.log (the install's and every stage's
# output, in order), pretrain_metrics.jsonl and profile_trace.json.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: tools/gpu_check.sh OUTDIR [--size gpu|cpu] [--only STAGE,...] [--budget-s S]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 GPU_CHECK_STARTED=$(date +%s)  # the budget counts from here: the install is part of it
python=${PYTHON:-python3}
site=${GPU_CHECK_SITE:-/tmp/raytrain-fast-site}
ls .wheelhouse/*.whl >/dev/null 2>&1 || { echo "error: no wheels in .wheelhouse/: run tools/offline_wheels.py first" >&2; exit 2; }
echo "===== install ($(date +%H:%M:%S)): .wheelhouse/*.whl into $site" >>"$out/check.log"
"$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .wheelhouse/*.whl \
  >>"$out/check.log" 2>&1 || { echo "error: installing the wheelhouse failed: see $out/check.log" >&2; tail -5 "$out/check.log" >&2; exit 1; }
echo "[gpu_check] installed the wheelhouse into $site in $(( $(date +%s) - GPU_CHECK_STARTED )) s"
# The tree's own raytrain_fast goes first: the check tests this checkout, whatever wheel of it the
# wheelhouse holds (that one is for installing on nodes).
export PYTHONPATH="$PWD:$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$site/bin:$PATH"
exec "$python" tools/gpu_check.py "$out" "$@"
