#!/usr/bin/env bash
# Offline evidence for the two A/B builds of 2026-12-04 (no GPU): per-entry PTX md5 of the default
# and macro builds, and the static SASS of the loops quoted in bench/NOTES.md. From the repo root:
#   bash bench/results/2026-12-04-offline-ab-builds/run.sh [python]
set -euo pipefail
PY=${1:-python3}
R=bench/results/2026-12-04-offline-ab-builds
M=bench/results/2026-12-04-h200-fwd-one-key-slot/ptxmd5_normalised.py
$PY $M . forward.cu > $R/ptx_forward_default.txt
$PY $M . forward.cu -DPW_FWD_LAZY_RESCALE=1 > $R/ptx_forward_lazy.txt
$PY $M . backward.cu > $R/ptx_backward_default.txt
$PY $M . backward.cu -DPW_BWD_P_FIXED=1 > $R/ptx_backward_fixed_p.txt
T=$(mktemp -d)
{
  for spec in "fwd bfloat16 128 128 32 4 0" "fwd bfloat16 128 128 32 4 1"; do
    for m in "" "-DPW_FWD_LAZY_RESCALE=1"; do
      echo "== $spec ${m:-default}"; $PY $R/sass_any.py . $spec $T/x $m; $PY $R/loops.py $T/x.sass
    done
  done
  for dt in bfloat16 float16; do
    echo "== bwd_dkv $dt 128 32x64x4 non-causal default"
    $PY $R/sass_any.py . bwd_dkv $dt 128 32 64 4 0 $T/x; $PY $R/loops.py $T/x.sass
  done
  echo "== bwd_dkv float16 128 32x64x4 non-causal -DPW_BWD_P_FIXED=1"
  $PY $R/sass_any.py . bwd_dkv float16 128 32 64 4 0 $T/x -DPW_BWD_P_FIXED=1; $PY $R/loops.py $T/x.sass
} > $R/sass_loops.txt
rm -rf "$T"
