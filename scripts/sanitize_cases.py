"""Forward and backward once per dtype x causal at a size that is not a tile multiple.

Run under compute-sanitizer (memcheck, racecheck) by scripts/gpu_run.sh; each case is also
checked against the reference, so a clean report is a report on correct runs.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from test_kernels_gpu import run_case  # noqa: E402

for dtype in ("float16", "bfloat16"):
    for causal in (False, True):
        for D in (64, 128):
            run_case(D=D, dtype=dtype, causal=causal, M=150, N=201, w=40, group=2, transposed=False)
            print(f"ok {dtype} causal={causal} D={D}", flush=True)
