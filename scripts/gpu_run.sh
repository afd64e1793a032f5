#!/usr/bin/env bash
# One call on a GPU machine: GPU tests, sanitizers, a short benchmark; logs to $1.
#   PYTHONPATH=$PWD bash scripts/gpu_run.sh OUTDIR [tests|sanitize|bench|all ...]
# Runs the project from its checkout (no install), as the lent H200 machines require.
set -uo pipefail
out=${1:?usage: gpu_run.sh OUTDIR [steps...]}; shift
steps=${*:-all}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONUNBUFFERED=1
has() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
status=0
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv;
  python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"; } 2>&1 | tee "$out/env.txt"
if has tests; then
  timeout 900 python3 -m pytest -q -ra -m gpu -p no:cacheprovider ${TEST_PATHS:-tests} ${PYTEST_ARGS:-} 2>&1 | tee "$out/pytest_gpu.log" | tail -40
  status=$((status | ${PIPESTATUS[0]}))
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    timeout 600 compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_cases.py \
      > "$out/sanitize_$tool.log" 2>&1
    rc=$?; echo "compute-sanitizer $tool: exit $rc"; tail -3 "$out/sanitize_$tool.log"
    status=$((status | rc))
  done
fi
if has bench; then
  timeout 900 python3 bench/bench.py --quick --out "$out/bench" 2>&1 | tee "$out/bench.log" | tail -60
  status=$((status | ${PIPESTATUS[0]}))
fi
exit $status
