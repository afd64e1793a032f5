"""Cold start: what a fresh process pays on its first forward+backward call, before and after
``python -m cupy_piecewise build --install``.

Three steps, each in its own process with ``CUPY_CACHE_DIR`` pointing at a new, empty
directory (so no earlier run's cache helps):

1. ``cold``: a fresh process times its first ``attention`` and first ``attention_backward``
   call (NVRTC compiles each kernel it launches);
2. ``install``: ``python -m cupy_piecewise build --install`` fills that cache directory;
3. ``warm``: another fresh process times the same first calls (modules load from the cache).

Each first call is timed from just before the call to the end of a device synchronise,
after CuPy has created the context and the inputs (what a user's first step pays for our
library, not for CUDA). ``--repeat`` warm processes give a median. Needs a GPU.

    PYTHONPATH=$PWD python3 scripts/cold_start.py --out cold_start.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_CHILD = r"""
import json, sys, time
t_import = time.perf_counter()
import cupy
import cupy_piecewise
t_import = time.perf_counter() - t_import
B, H, L, D, causal = 1, 8, 1024, 128, True
rng = cupy.random.default_rng(0)
q1, k1, q2, k2, v, do = (rng.standard_normal((B, H, L, D), dtype=cupy.float32).astype(cupy.float16)
                         for _ in range(6))
cupy.cuda.Device().synchronize()
t0 = time.perf_counter()
o, lse = cupy_piecewise.attention(q1, k1, q2, k2, v, L // 4, causal=causal, return_lse=True)
cupy.cuda.Device().synchronize()
t1 = time.perf_counter()
grads = cupy_piecewise.attention_backward(do, q1, k1, q2, k2, v, o, lse, L // 4, causal=causal)
cupy.cuda.Device().synchronize()
t2 = time.perf_counter()
assert all(bool(cupy.isfinite(g).all()) for g in grads)
print(json.dumps({"import_s": t_import, "forward_s": t1 - t0, "backward_s": t2 - t1,
                  "first_call_s": t2 - t0}))
"""


def _child(env) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the figures as JSON here")
    ap.add_argument("--repeat", type=int, default=3, help="warm processes to take the median of")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cupy_piecewise_cache_") as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache)
        cold = _child(env)
        print(f"cold:    first forward {cold['forward_s']:.3f} s, backward {cold['backward_s']:.3f} s",
              flush=True)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "cupy_piecewise", "build", "--install"], env=env,
                       check=True)
        install_s = time.perf_counter() - t
        warm = [_child(env) for _ in range(args.repeat)]
    med = {k: statistics.median(r[k] for r in warm) for k in warm[0]}
    print(f"install: {install_s:.1f} s")
    print(f"warm:    first forward {med['forward_s']:.3f} s, backward {med['backward_s']:.3f} s, "
          f"together {med['first_call_s']:.3f} s (median of {len(warm)} processes; "
          f"import {med['import_s']:.2f} s not counted)")
    if args.out:
        import cupy

        with open(args.out, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"),
                       "gpu": cupy.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "case": "B1 H8 L1024 D128 float16 causal, w = L/4",
                       "cold": cold, "install_s": install_s, "warm": warm, "warm_median": med},
                      f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
